"""``benchmarks/bench_gated_delta.py`` as a smoke run in the simulator: the chunked kernels at their default and at a
forced geometry are timed and agree with the reference kernel, the forced geometry reaching the launches."""
import json
import os

import pytest

from tests.util import launch_records_during

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    """The script runs end to end, its check sees both geometries at the reference's result, and each geometry
    reaches its launches: the default's scan kernel (1 warp, 2 stages in the simulator) and then the forced one's
    (``--geometry 2,1,1``: the scan kernel built for 2 warps and 1 stage, launched with 2 warps a block and that
    geometry's shared memory), and the prepare launch's ``head_parts`` at the default's 2 (the simulator's 4 SMs
    outnumber the 3 chunks, so a key head's 2 value heads take 2 blocks) and then at the forced 1."""
    import bench_gated_delta
    from pegainfer.kernels.gated_delta import ChunkGeometry
    from pegainfer.kernels.gated_delta.chunked_mma import _scan_kernel
    out = tmp_path / "gdn.json"
    codes = []
    launched = launch_records_during(lambda: codes.append(bench_gated_delta.main(["--json", str(out), "--geometry",
                                                                                  "2,1,1"])))
    assert codes == [0]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["geometry"] for r in rows] == [f"{tuple(result['default_geometry'][1:])} default", "(2, 1, 1)"]
    assert all(r["us"] > 0 and r["state_rel_l2"] < 1e-5 and r["out_bit_equal"] > 0.95 for r in rows)

    kd, vd = bench_gated_delta.HEADS["key_dim"], bench_gated_delta.HEADS["value_dim"]
    default, forced = ChunkGeometry(*result["default_geometry"]), ChunkGeometry(bench_gated_delta.CHUNK, 2, 1, 1)
    assert (default.scan_warps, default.scan_stages, default.prepare_split) == (1, 2, 0)
    prepares = [r for r in launched if r.name == "gated_delta_chunk_prepare"]
    scans = [r for r in launched if r.name == "gated_delta_chunk_scan"]
    calls = [(p.arg("head_parts"), s.kernel, s.block, s.shared) for p, s in zip(prepares, scans, strict=True)]
    assert list(dict.fromkeys(calls)) == [
        (parts, _scan_kernel(kd, vd, g.tiles, g.scan_warps, g.scan_stages, False), 32 * g.scan_warps,
         4 * g.scan_shared_words(kd)) for parts, g in ((2, default), (1, forced))]


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_decode_batch_times_the_fused_step_against_the_general_path(bench_modules, tmp_path):
    """``--decode-batch``: the decode launch is timed per batch size and state dtype with its state bytes, and its
    outputs and states equal the general path's bit for bit."""
    import bench_gated_delta
    out = tmp_path / "decode.json"
    assert bench_gated_delta.main(["--decode-batch", "1,3", "--state-dtype", "float32,bfloat16", "--json",
                                   str(out)]) == 0
    rows = json.loads(out.read_text())["decode_rows"]
    h = bench_gated_delta.HEADS
    assert [(r["B"], r["state_dtype"]) for r in rows] == [(1, "float32"), (1, "bfloat16"), (3, "float32"),
                                                         (3, "bfloat16")]
    for r in rows:
        width = 4 if r["state_dtype"] == "float32" else 2
        assert r["state_bytes"] == 2 * r["B"] * h["num_v_heads"] * h["key_dim"] * h["value_dim"] * width
        assert r["us"] > 0 and r["out_bit_equal"] == 1.0 and r["state_bit_equal"] == 1.0
