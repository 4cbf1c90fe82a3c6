"""The skinny tensor-core kernel (``linear_skinny``: weights straight into mma B fragments, permuted K, split-K
through shared memory, fused SwiGLU) with the simulator's emulated ``mma.sync``."""
import numpy as np
import pytest

from tests.kernels.linear_util import (assert_same_bits, exact_inputs, reference_bits, run, run_bits,
                                       silu_mul_reference)
from tests.util import bf16_randn, bf16_round, rel_l2

from pegainfer.kernels.linear import SKINNY_MAX_TOKENS, SkinnyGeometry, linear_skinny


@pytest.mark.parametrize("T,N,K,geometry,gated", [
    (1, 24, 64, SkinnyGeometry(n_tiles=1, unroll=1, warps=1, k_split=1), False),   # decode, several tiles
    (5, 41, 72, SkinnyGeometry(n_tiles=2, unroll=2, warps=2, k_split=2), False),   # ragged N and K, split-K
    (11, 20, 96, SkinnyGeometry(n_tiles=1, unroll=1, warps=2, k_split=1), True),   # tokens g+8, SwiGLU pairs
    (16, 17, 40, SkinnyGeometry(n_tiles=1, unroll=2, warps=2, k_split=2), False),  # a full m16 token tile
    # register rings: 2 and 3 iterations, K runs shorter, equal to and longer than the ring
    (16, 24, 200, SkinnyGeometry(n_tiles=2, unroll=1, warps=2, k_split=2, stages=2), True),
    (9, 20, 136, SkinnyGeometry(n_tiles=1, unroll=2, warps=1, k_split=1, stages=3), False),
    (3, 12, 32, SkinnyGeometry(n_tiles=1, unroll=1, warps=2, k_split=2, stages=3), False),
])
def test_linear_skinny_matches_reference(T, N, K, geometry, gated, rng):
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(linear_skinny, xb, wb, N // 2 if gated else N, gated=gated, geometry=geometry)
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_linear_skinny_matches_numpy(gated, rng):
    """The default geometry on arbitrary bf16 data."""
    T, N, K = 5, 40, 128
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = run(linear_skinny, xb, wb, N // 2 if gated else N, gated=gated)
    assert rel_l2(got, silu_mul_reference(x, w) if gated else x @ w.T) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"


def test_linear_skinny_rejects_too_many_tokens():
    T = SKINNY_MAX_TOKENS + 1
    with pytest.raises(ValueError, match="at most"):
        linear_skinny(np.zeros((T, 16), np.uint16), np.zeros((8, 16), np.uint16), np.zeros((T, 8), np.uint16))
