"""``benchmarks/bench_attention.py`` as a smoke run in the simulator: it finds the attention names it uses and runs
the decode and prefill paths, a forced prefill tile among them (the tiled prefill and split-K outputs agree), and
the batched decode at forced geometries; every forced geometry reaches the kernel launches."""
import json
import os

import pytest

from tests.util import launch_records_during

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def run_recorded(bench_attention, argv):
    """``bench_attention.main(argv)`` (which must return 0) and the ``LaunchRecord`` of every launch it made."""
    codes = []
    launched = launch_records_during(lambda: codes.append(bench_attention.main(argv)))
    assert codes == [0]
    return launched


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_smoke_run(bench_modules, tmp_path):
    """Decode and prefill rows come out timed; the tiled prefill at the default tile and at the forced
    ``--prefill-geometry 2,2,32,3`` (every field unlike the simulator's default 1,1,16,2) agrees with split-K; and
    each tile reaches its launches: the default's, then the forced one's, each the ``prefill_kernel`` built for that
    tile, launched with its warps, its shared memory and its grid (a block per 16 · warps · m_tiles query rows)."""
    import bench_attention
    from pegainfer.kernels.attention import PrefillGeometry, prefill_geometry, prefill_kernel
    out = tmp_path / "att.json"
    launched = run_recorded(bench_attention, ["--json", str(out), "--prefill-geometry", "2,2,32,3"])
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    assert all(r["us"] > 0 for r in rows)
    tiled = [r for r in rows if r["kind"] == "prefill" and r["method"] == "prefill"]
    assert [r["geometry"] for r in tiled if r["forced"]] == [[2, 2, 32, 3]] and len(tiled) == 2
    assert all(r["rel_l2_prefill_vs_split"] < 1e-2 for r in tiled)

    (nq, nkv, D), = bench_attention.MODELS.values()
    T, G = bench_attention.PREFILL_TOKENS[0], nq // nkv
    default, forced = prefill_geometry(D, G), PrefillGeometry(2, 2, 32, 3)
    assert all(a != b for a, b in zip(default, forced)), default
    tiles = [(r.kernel, r.block, r.shared, r.grid) for r in launched if r.name == "paged_attention_prefill"]
    assert list(dict.fromkeys(tiles)) == [(prefill_kernel(D, G, *g), 32 * g.warps, g.shared_bytes(D),
                                           -(-T // (g.rows // G)) * nkv) for g in (default, forced)]


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_batched_decode_smoke_run(bench_modules, tmp_path):
    """``--batch`` times one decode call of B sequences at the default geometry and at forced ones (warps, pairs, a
    walking grid), each forced output near the default's, and each geometry reaches its decode launches: the
    default's one warp a block and then the forced ones, each the ``split_kernel`` built for its warps and pairing,
    launched with its warps a block, a block per (sequence, kv head) item, except the walking grid's ``sm_count()``
    blocks (one an SM) over the 6 items."""
    import bench_attention
    from pegainfer.kernels.attention import split_geometry, split_kernel
    from pegainfer.kernels.primitives import sm_count
    out = tmp_path / "batch.json"
    launched = run_recorded(bench_attention, ["--json", str(out), "--only", "batch", "--batch", "3",
                                              "--decode-geometry", "2,1", "--decode-geometry", "2,0",
                                              "--decode-geometry", "2,0,0,0,1"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["batch"] * 4
    assert [r["geometry"] for r in rows if r["forced"]] == [[2, True, 0], [2, False, 0], [2, False, 1]]
    assert all(r["us"] > 0 and r["batch"] == 3 and r["rel_l2_vs_default"] < 1e-2 for r in rows)

    (nq, nkv, D), = bench_attention.MODELS.values()
    G, items = nq // nkv, 3 * nkv                       # one split a (sequence, kv head) at 9 keys
    assert split_geometry(D, G, items) == (1, False, 0) and items > sm_count()
    blocks = [(r.kernel, r.block, r.grid) for r in launched if r.name == "paged_decode_attention"]
    kernel = lambda warps, pairs: split_kernel(D, G, warps, True, False, pairs, False)  # noqa: E731  (as launched)
    assert list(dict.fromkeys(blocks)) == [(kernel(1, False), 32, items), (kernel(2, True), 64, items),
                                           (kernel(2, False), 64, items), (kernel(2, False), 64, sm_count())]


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_batched_decode_with_forced_splits(bench_modules, tmp_path):
    """``--decode-geometry W,P,S,K`` forces S splits of at least K keys (a batched step at a short context runs one
    split by default): three splits of 16 keys over 40 keys give the default's output, the row says so, and the
    forced launch gets them (``num_splits`` 3 and ``min_chunk`` 16, a block per (sequence, kv head, split)) where
    the default's got one split of ``MIN_SPLIT_TOKENS`` keys a (sequence, kv head)."""
    import bench_attention
    from pegainfer.kernels.attention import MIN_SPLIT_TOKENS
    out = tmp_path / "batch.json"
    launched = run_recorded(bench_attention, ["--json", str(out), "--only", "batch", "--batch", "2",
                                              "--batch-context", "40", "--decode-geometry", "1,0,3,16"])
    default, forced = json.loads(out.read_text())["rows"]
    assert (forced["splits"], forced["min_split_tokens"], forced["geometry"]) == (3, 16, [1, False, 0])
    assert default["splits"] is None and forced["us"] > 0 and forced["rel_l2_vs_default"] < 1e-2
    nkv = next(iter(bench_attention.MODELS.values()))[1]
    splits = [(r.arg("num_splits"), r.arg("min_chunk"), r.grid) for r in launched if r.name == "paged_decode_attention"]
    assert list(dict.fromkeys(splits)) == [(1, MIN_SPLIT_TOKENS, 2 * nkv), (3, 16, 3 * 2 * nkv)]
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
