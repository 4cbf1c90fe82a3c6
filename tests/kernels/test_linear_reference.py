"""The reference kernels of ``linear`` / ``linear_silu_mul`` against float64 NumPy."""
import numpy as np
import pytest

from tests.kernels.linear_util import exact_inputs, reference_bits, silu_mul_reference
from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2


@pytest.mark.parametrize("T,N,K", [(1, 7, 64), (3, 20, 136)])
def test_reference_linear_is_the_rounded_exact_product(T, N, K, rng):
    """On data whose sums are exact in f32, ``bf16(x @ w.T)`` bit for bit."""
    (xb, x), (wb, w) = exact_inputs(T, N, K, rng)
    got = from_bf16_bits(reference_bits(xb, wb)).astype(np.float64)
    assert np.array_equal(got, bf16_round(x @ w.T))


def test_reference_silu_mul_rounds_as_hf(rng):
    """g and u exact, then HF's three roundings; silu in f32 against float64 moves an output by at most one bf16
    step, and almost never."""
    (xb, x), (wb, w) = exact_inputs(4, 2 * 24, 64, rng)
    got = from_bf16_bits(reference_bits(xb, wb, gated=True)).astype(np.float64)
    expected = silu_mul_reference(x, w)
    assert np.all(np.abs(got - expected) <= np.abs(expected) * 2.0 ** -7 + 1e-30)
    assert np.mean(got == expected) > 0.98, np.mean(got == expected)


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_reference_on_random_data(gated, rng):
    """Arbitrary bf16 data: f32 sums round like the float64 ones but for the last bit of a few outputs."""
    T, N, K = 3, 40, 96
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = from_bf16_bits(reference_bits(xb, wb, gated)).astype(np.float64)
    expected = silu_mul_reference(x, w) if gated else bf16_round(x @ w.T)
    assert rel_l2(got, expected) < 1e-2
    assert np.mean(got == expected) > 0.9, np.mean(got == expected)
