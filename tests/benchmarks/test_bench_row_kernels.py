"""``benchmarks/bench_row_kernels.py`` as a smoke run in the simulator: every heads-per-warp choice of qk-norm/RoPE
is timed and writes the bits of one head a warp, and the add + RMSNorm is timed."""
import json
import os

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    """The script runs end to end (a renamed kernel argument, a forced heads-per-warp not reaching the launch, a
    comparison of the wrong arrays would show here)."""
    import bench_row_kernels
    out = tmp_path / "rows.json"
    assert bench_row_kernels.main(["--tokens", "3", "--layers", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    rope = [r for r in rows if r["kernel"] == "qk_norm_rope_store"]
    assert [r["heads_per_warp"] for r in rope] == [1, 2, 4]
    assert all(r["bits_of_one_head"] and r["us"] > 0 for r in rope)
    assert [r["chosen"] for r in rope] == [True, False, False]        # 3 tokens: one head a warp
    assert [r["kernel"] for r in rows if r not in rope] == ["add_rms_norm_into"]
