"""``benchmarks/bench_gated_delta.py`` as a smoke run in the simulator: the chunked kernels at their default and at a
forced geometry are timed and agree with the reference kernel."""
import json
import os

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    """The script runs end to end and its check sees both geometries at the reference's result (a broken import of a
    kernel name, a geometry flag not reaching the launch, a check comparing the wrong arrays would show here)."""
    import bench_gated_delta
    out = tmp_path / "gdn.json"
    assert bench_gated_delta.main(["--json", str(out), "--geometry", "2,1,2"]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["geometry"] for r in rows] == [f"{tuple(result['default_geometry'][1:])} default", "(2, 1, 2)"]
    assert all(r["us"] > 0 and r["state_rel_l2"] < 1e-5 and r["out_bit_equal"] > 0.95 for r in rows)


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_decode_batch_times_the_fused_step_against_the_general_path(bench_modules, tmp_path):
    """``--decode-batch``: the decode launch is timed per batch size with its state bytes, and its outputs and states
    equal the general path's bit for bit."""
    import bench_gated_delta
    out = tmp_path / "decode.json"
    assert bench_gated_delta.main(["--decode-batch", "1,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["decode_rows"]
    h = bench_gated_delta.HEADS
    assert [r["B"] for r in rows] == [1, 3]
    for r in rows:
        assert r["state_bytes"] == 2 * r["B"] * h["num_v_heads"] * h["key_dim"] * h["value_dim"] * 4
        assert r["us"] > 0 and r["out_bit_equal"] == 1.0 and r["state_bit_equal"] == 1.0
