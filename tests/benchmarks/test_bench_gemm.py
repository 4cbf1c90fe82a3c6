"""``benchmarks/bench_gemm.py``: its sweep candidates, the ulp comparison it checks every candidate with, and a smoke
run of every mode in the simulator."""
import json
import os

import numpy as np
import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def bg(bench_modules):
    import bench_gemm
    return bench_gemm


def test_ulp_mismatch_counts_outputs_more_than_one_ulp_apart(bg):
    """bf16 bits as one ordered line: neighbours across zero and within a binade are one ulp apart, two steps are
    not."""
    one = np.array([0x3F80, 0x8000, 0x0000, 0x3F80], np.uint16)
    near = np.array([0x3F81, 0x0000, 0x8001, 0x3F7F], np.uint16)
    assert bg.ulp_mismatch(near, one) == 0.0
    far = np.array([0x3F82, 0x0001, 0x8002, 0x3F80], np.uint16)
    assert bg.ulp_mismatch(far, one) == 0.5


def test_sweep_candidates_split_only_where_k_allows(bg):
    """Every candidate keeps at least 4 K tiles a split, and a weight whose tiles already fill the GPU is not
    split further than the heuristic splits it (a one-tile weight of the same K is)."""
    L = bg.linear_api()
    short = bg.Shape.__new__(bg.Shape)
    short.n, short.k, short.gated = 64, 256, False
    cands = bg.sweep_candidates(L, short, 2)
    assert cands and all((256 // 32) // g.k_splits >= 4 or g.k_splits == 1 for g in cands)
    for n, fills in ((65536, True), (64, False)):       # 1024 tiles of 64 columns and more, or one
        shape = bg.Shape.__new__(bg.Shape)
        shape.n, shape.k, shape.gated = n, 4096, False
        heuristic = {1, L.mma_geometry(n, 4096, 2).k_splits, L.wgmma_geometry(n, 4096, 2).k_splits}
        swept = {g.k_splits for g in bg.sweep_candidates(L, shape, 2)}
        assert (swept <= heuristic) == fills, (n, swept, heuristic)


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_every_mode_smoke_run(bg, tmp_path, capsys):
    out = tmp_path / "gemm.json"
    tuning = tmp_path / "tuning.json"
    assert bg.main(["--check", "--sweep", "--tokens", "2,17", "--json", str(out), "--tuning-out", str(tuning)]) == 0
    res = json.loads(out.read_text())
    assert res["check"] is True
    table = [r for r in res["rows"] if r["kind"] == "table"]
    assert {(r["proj"], r["T"]) for r in table} == {(p, t) for p, *_ in bg.SIM_MODEL for t in (2, 17)}
    assert all(r["us"] > 0 and "gemm_mma tuned" in r["impls"] for r in table)
    assert res["tuned"] and all(e["geometry"]["k_splits"] >= 1 for e in res["tuned"])
    assert "Best geometry per" in capsys.readouterr().out
    from pegainfer.kernels.linear.geometry import MmaGeometry, WgmmaGeometry, mma_geometry, wgmma_geometry
    from pegainfer.kernels.policy import LaunchPolicy
    policy = LaunchPolicy.from_options(tuning_file=str(tuning))   # the winners, as the engine would read them
    entries = json.loads(tuning.read_text())
    assert {(e["n_cols"], e["k"], e["gated"]) for e in entries} == {(n, k, g) for _, n, k, g in bg.SIM_MODEL}
    for e in entries:
        pick = (wgmma_geometry if e["kind"] == "wgmma" else mma_geometry)(e["n_cols"], e["k"], e["tokens"],
                                                                           e["gated"], policy)
        assert pick == (WgmmaGeometry if e["kind"] == "wgmma" else MmaGeometry)(**e["geometry"])


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_hot_times_each_cell_with_its_weight_in_l2(bg, tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert bg.main(["--hot", "--tokens", "17", "--json", str(out)]) == 0
    table = [r for r in json.loads(out.read_text())["rows"] if r["kind"] == "table"]
    assert len(table) == len(bg.SIM_MODEL) and all(r["hot_us"] > 0 for r in table)
    assert all(not any("hot" in k for k in r["impls"]) for r in table)   # never a candidate for "ours"
    assert capsys.readouterr().out.count("weight hot in L2") == 2 * len(bg.SIM_MODEL)   # as measured, then the table
