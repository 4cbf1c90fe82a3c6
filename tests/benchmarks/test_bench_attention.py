"""``benchmarks/bench_attention.py`` as a smoke run in the simulator: it finds the attention names it uses and runs
the decode and prefill paths, a forced prefill tile among them (the tiled prefill and split-K outputs agree)."""
import json
import os

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    import bench_attention
    out = tmp_path / "att.json"
    assert bench_attention.main(["--json", str(out), "--prefill-geometry", "1,2,32,3"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    assert all(r["us"] > 0 for r in rows)
    tiled = [r for r in rows if r["kind"] == "prefill" and r["method"] == "prefill"]
    assert [r["geometry"] for r in tiled if r["forced"]] == [[1, 2, 32, 3]] and len(tiled) == 2
    assert all(r["rel_l2_prefill_vs_split"] < 1e-2 for r in tiled)


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_batched_decode_smoke_run(bench_modules, tmp_path):
    """``--batch`` times one decode call of B sequences at the default geometry and at forced ones (warps, pairs, a
    walking grid), each forced output near the default's (a geometry flag not reaching the launch, or slots sharing
    pages, would show here)."""
    import bench_attention
    out = tmp_path / "batch.json"
    assert bench_attention.main(["--json", str(out), "--only", "batch", "--batch", "3", "--decode-geometry", "2,1",
                                 "--decode-geometry", "2,0", "--decode-geometry", "2,0,0,0,1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["batch"] * 4
    assert [r["geometry"] for r in rows if r["forced"]] == [[2, True, 0], [2, False, 0], [2, False, 1]]
    assert all(r["us"] > 0 and r["batch"] == 3 and r["rel_l2_vs_default"] < 1e-2 for r in rows)


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_batched_decode_with_forced_splits(bench_modules, tmp_path):
    """``--decode-geometry W,P,S,K`` forces S splits of at least K keys (a batched step at a short context runs one
    split by default): three splits of 16 keys over 40 keys give the default's output, and the row says so."""
    import bench_attention
    out = tmp_path / "batch.json"
    assert bench_attention.main(["--json", str(out), "--only", "batch", "--batch", "2", "--batch-context", "40",
                                 "--decode-geometry", "1,0,3,16"]) == 0
    default, forced = json.loads(out.read_text())["rows"]
    assert (forced["splits"], forced["min_split_tokens"], forced["geometry"]) == (3, 16, [1, False, 0])
    assert default["splits"] is None and forced["us"] > 0 and forced["rel_l2_vs_default"] < 1e-2
    with pytest.raises(SystemExit, match="warps,pairs"):
        bench_attention.main(["--only", "batch", "--batch", "2", "--decode-geometry", "1,0,2,16,1,1"])


def test_batch_part_needs_a_batch(bench_modules):
    import bench_attention
    with pytest.raises(SystemExit, match="--only batch needs --batch"):
        bench_attention.main(["--only", "batch"])


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_a_forced_block_that_cannot_launch_is_reported(bench_modules, tmp_path):
    """A forced block the kernel refuses (3 warps in pairs) is one failed row, and the run goes on."""
    import bench_attention
    out = tmp_path / "batch.json"
    assert bench_attention.main(["--json", str(out), "--only", "batch", "--batch", "2", "--decode-geometry", "3,1",
                                 "--decode-geometry", "2,0"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["geometry"] for r in rows if r["forced"]] == [[3, True, 0], [2, False, 0]]
    assert "error" in rows[1] and rows[2]["us"] > 0
