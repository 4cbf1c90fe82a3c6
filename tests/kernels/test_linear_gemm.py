"""The tiled GEMMs: ``gemm_mma`` (tensor cores; in the simulator ``mma.sync`` is emulated from the PTX fragment
layout, on a GPU this runs the real instruction) and ``gemm_fma`` (FMA tiles), against the reference kernel."""
import pytest

from tests.kernels.linear_util import (assert_same_bits, exact_inputs, reference_bits, run, run_bits,
                                       silu_mul_reference)
from tests.util import bf16_randn, rel_l2

from pegainfer.kernels.linear import gemm_fma, gemm_mma


@pytest.mark.parametrize("T,N,K,tile,gated", [
    (20, 40, 72, (2, 2, 1, 1), False),   # two warp rows; T, N and K (3 stages of 32, the last partial) all ragged
    (3, 24, 40, (1, 1, 2, 2), False),    # several m16 / n8 tiles per warp
    (5, 40, 64, (1, 2, 1, 2), True),     # SwiGLU epilogue from the accumulator fragment's column pairs
    (20, 40, 232, (2, 2, 1, 1), False),  # 8 K tiles through a ring of 4 stages: every stage reused, K ragged
    (9, 48, 160, (1, 2, 1, 2), True),    # 5 K tiles, gated
])
def test_gemm_mma_matches_reference(T, N, K, tile, gated, rng):
    """The cp.async stage ring, the swizzled fragment indexing and the epilogue."""
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(gemm_mma, xb, wb, N // 2 if gated else N, gated=gated, tile=tile)
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("T,N,K", [(17, 50, 72), (33, 70, 40)])
def test_gemm_fma_matches_reference(T, N, K, gated, rng):
    """Two token tiles, column and K tails (16 × 32 block tiles, 32-wide K steps in the simulator)."""
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(gemm_fma, xb, wb, N // 2 if gated else N, gated=gated)
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("gemm", [gemm_mma, gemm_fma], ids=["mma", "fma"])
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_gemm_matches_numpy(gemm, gated, rng):
    T, N, K = 20, 40, 96
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = run(gemm, xb, wb, N // 2 if gated else N, gated=gated)
    assert rel_l2(got, silu_mul_reference(x, w) if gated else x @ w.T) < 1e-2
