"""The tiled GEMMs: ``gemm_mma`` (tensor cores: the ``cp.async`` ring, ``ldmatrix`` fragments, split-K with the
last block summing the partials; in the simulator ``mma.sync`` and ``ldmatrix`` are emulated from the PTX fragment
layouts, on a GPU this runs the real instructions) and ``gemm_fma`` (FMA tiles), against the reference kernel and
float64 NumPy."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.linear_util import (assert_same_bits, exact_inputs, reference_bits, run, run_bits,
                                       silu_mul_reference)
from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2

from pegainfer.kernels.linear import MmaGeometry, gemm_fma, gemm_mma, linear, linear_workspace_size, mma_geometry
from pegainfer.kernels.linear.geometry import best_k_splits, mma_token_tile
from pegainfer.kernels.linear.splitk import HANDOFF_WORDS, workspace_need


def G(warps_m, warps_n, mt, nt, stages=3, k_splits=1):
    return MmaGeometry(warps_m=warps_m, warps_n=warps_n, mt=mt, nt=nt, stages=stages, k_splits=k_splits)


def workspace(n=1 << 14):
    """A workspace filled with NaN (counters included: the kernel must zero them before it counts)."""
    return cuda.to_device(np.full(n, np.nan, np.float32))


@pytest.mark.parametrize("T,N,K,geo,gated", [
    (2, 24, 64, G(1, 1, 1, 2), False),                 # decode batch of 2: token rows 2..15 zero-filled
    (5, 40, 64, G(1, 2, 1, 2, k_splits=2), True),      # split-K, SwiGLU epilogue from the column pairs
    (16, 41, 96, G(1, 1, 1, 2, k_splits=3), False),    # 3 splits of one K tile each; N with a tail
    (17, 20, 72, G(1, 1, 2, 1, stages=2), True),       # two m16 tiles, K ragged (a partial last K tile)
    (20, 40, 72, G(2, 2, 1, 1), False),                # two warp rows; T, N and K all ragged
    (33, 24, 232, G(1, 1, 4, 2, stages=4, k_splits=2), False),  # 64-token tile, 8 K tiles through a ring of 4
    (64, 16, 160, G(1, 2, 2, 1, stages=4, k_splits=2), True),   # two token tiles sharing each weight tile
    (70, 24, 64, G(2, 1, 2, 3), False),                # more tokens than one block tile holds: T tiles of 64
])
def test_gemm_mma_matches_reference(T, N, K, geo, gated, rng):
    """Bit for bit on data whose sums are exact in f32: the ring, the swizzled ``ldmatrix`` fragments, the split
    partials and their sum, the epilogue."""
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(gemm_mma, xb, wb, N // 2 if gated else N, gated=gated, geometry=geo, workspace=workspace())
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("k_splits", [1, 2, 4], ids=["unsplit", "split2", "split4"])
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_gemm_mma_matches_numpy_within_the_sum_bound(k_splits, gated, rng):
    """Arbitrary bf16 data: every output is within the bound of ``splitk``'s docstring of the float64 result (half
    a bf16 ulp of rounding plus (K/16 + k_splits) f32 roundings of Σ|x·w|), and within one bf16 ulp of the
    reference kernel (whose f32 sum runs in another order)."""
    T, N, K = 9, 40, 256
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    geo = G(1, 1, 1, 2, stages=3, k_splits=k_splits)
    got = run(gemm_mma, xb, wb, N // 2 if gated else N, gated=gated, geometry=geo, workspace=workspace())
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"
    ref = from_bf16_bits(reference_bits(xb, wb, gated)).astype(np.float64)
    if gated:
        assert rel_l2(got, silu_mul_reference(x, w)) < 1e-2
        assert np.mean(got == ref) > 0.9
    else:
        exact = x @ w.T
        bound = 2.0 ** -8 * np.abs(exact) + 2 * (K / 16 + k_splits) * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T)
        assert np.all(np.abs(got - exact) <= bound)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
        assert np.all(np.abs(got - ref) <= ulp)


def test_split_counts_give_the_same_bits_and_leave_the_counters_at_zero(rng):
    """Exact data: 1, 2 and 5 splits agree bit for bit, run after run (the sum order is fixed), and every launch
    leaves its counters at zero (so a captured graph replays without a reset)."""
    T, N, K = 3, 32, 320                                # two column tiles of 16: two counters
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    ws = workspace()
    results = [run_bits(gemm_mma, xb, wb, N, geometry=G(1, 1, 1, 2, k_splits=s), workspace=ws) for s in (1, 2, 5, 5)]
    for got in results[1:]:
        assert np.array_equal(got, results[0])
    assert workspace_need(G(1, 1, 1, 2, k_splits=5), T, N)[1] == 2
    counters = ws.copy_to_host().view(np.int32)[-(2 + HANDOFF_WORDS):]    # the split counters, then the handoff's
    assert np.all(counters == 0), counters


def test_gemm_mma_workspace_rules(rng):
    """A geometry that splits K needs a workspace of ``linear_workspace_size``; the picked geometry without one runs
    unsplit (same bits on exact data)."""
    T, N, K = 4, 24, 256
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    geo = G(1, 1, 1, 2, k_splits=2)
    with pytest.raises(ValueError, match="linear_workspace_size"):
        run_bits(gemm_mma, xb, wb, N, geometry=geo)
    with pytest.raises(ValueError, match="linear_workspace_size"):
        run_bits(gemm_mma, xb, wb, N, geometry=geo, workspace=cuda.to_device(np.zeros(8, np.float32)))
    assert mma_geometry(N, K, T).k_splits == 2, "the simulator's default geometry splits K of 8 tiles"
    expected = reference_bits(xb, wb)
    assert_same_bits(run_bits(gemm_mma, xb, wb, N), expected, "unsplit, no workspace")
    size = linear_workspace_size(T, [(N, K, False)])
    ws = cuda.to_device(np.full(size, np.nan, np.float32))
    assert_same_bits(run_bits(linear, xb, wb, N, impl="gemm_mma", workspace=ws), expected, "linear with workspace")


def test_linear_workspace_size_covers_every_launch():
    """The size is the largest need over T = 1 .. max_tokens and the given weights (gated ones by their own
    geometries), counters included, with the add + RMSNorm prologue's two handoff counters after them; weights
    whose K is too short to split need those two alone."""
    shapes = [(24, 256, False), (40, 512, True)]
    size = linear_workspace_size(20, shapes)
    for rows, k, gated in shapes:
        for t in range(1, 21):
            part, counters = workspace_need(mma_geometry(rows, k, t, gated), t, rows)
            assert part + counters + HANDOFF_WORDS <= size
    assert linear_workspace_size(20, [(24, 64, False)]) == HANDOFF_WORDS == 2


def test_geometry_helpers():
    """Token tiles are powers of two from 16; splits: about two units a SM while the weight streams (the
    simulator's stand-in GPU has 4 SMs), one balanced wave above 128 tokens, every split at least 4 K tiles."""
    assert [mma_token_tile(t) for t in (1, 2, 16, 17, 64, 65, 256, 300)] == [16, 16, 16, 32, 64, 128, 256, 512]
    assert best_k_splits(1, 4096, 16) == 8                          # 2 · 4 SMs / 1 tile
    assert best_k_splits(1, 128, 16) == 1                           # 4 K tiles: no room to split
    assert best_k_splits(100, 4096, 16) == 1                        # tiles enough
    assert best_k_splits(2, 4096, 256) == 2                         # one wave of 4 SMs
    assert best_k_splits(1, 4096, 16, max_splits=3) == 3


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("T,N,K", [(17, 50, 72), (33, 70, 40)])
def test_gemm_fma_matches_reference(T, N, K, gated, rng):
    """Two token tiles, column and K tails (16 × 32 block tiles, 32-wide K steps in the simulator)."""
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(gemm_fma, xb, wb, N // 2 if gated else N, gated=gated)
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_gemm_fma_matches_numpy(gated, rng):
    T, N, K = 20, 40, 96
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = run(gemm_fma, xb, wb, N // 2 if gated else N, gated=gated)
    assert rel_l2(got, silu_mul_reference(x, w) if gated else x @ w.T) < 1e-2
