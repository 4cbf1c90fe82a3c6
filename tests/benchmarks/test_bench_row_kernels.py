"""``benchmarks/bench_row_kernels.py`` as a smoke run in the simulator: every heads-per-warp choice of qk-norm/RoPE
is timed, launches the kernel built for it and writes the bits of one head a warp, and the add + RMSNorm is timed."""
import json
import os

import pytest

from tests.util import launch_records_during

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    """The script runs end to end, each RoPE row's heads-per-warp choice reaches its launches (the row's launches,
    its check's and its timing's, run the ``qk_norm_rope_kernel`` built for that many heads a warp: 1, then 2, then
    4, while ``choose_heads_per_warp`` would take 1 at 3 tokens), every choice writes the bits of one head a warp,
    and the norm row follows."""
    import bench_row_kernels
    from pegainfer.kernels.rope.store import choose_heads_per_warp, qk_norm_rope_kernel
    out = tmp_path / "rows.json"
    codes = []
    launched = launch_records_during(lambda: codes.append(bench_row_kernels.main(["--tokens", "3", "--layers", "1",
                                                                                  "--json", str(out)])))
    assert codes == [0]
    rows = json.loads(out.read_text())["rows"]
    rope = [r for r in rows if r["kernel"] == "qk_norm_rope_store"]
    assert [r["heads_per_warp"] for r in rope] == [1, 2, 4]
    assert all(r["bits_of_one_head"] and r["us"] > 0 for r in rope)
    assert [r["chosen"] for r in rope] == [True, False, False]        # 3 tokens: one head a warp
    assert [r["kernel"] for r in rows if r not in rope] == ["add_rms_norm_into"]

    D, nq, nkv = bench_row_kernels.D, bench_row_kernels.NQ, bench_row_kernels.NKV
    assert choose_heads_per_warp(3, nq, nkv) == 1
    kernels = [r.kernel for r in launched if r.name == "qk_norm_rope_store"]
    built = [qk_norm_rope_kernel(D, D, hpw, False) for hpw in (1, 2, 4)]     # as the launcher builds it: no stamps
    assert kernels == [k for k in built for _ in range(2)]           # per choice: the check's launch, the timed one
