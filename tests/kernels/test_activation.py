"""SwiGLU (silu_mul) against a float64 reference that rounds to bf16 where HF's bf16 forward does."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.activation import silu_mul
from pegainfer.kernels.primitives import to_bf16_bits


def test_silu_mul_matches_hf_rounding(rng):
    tokens, inter = 3, 80
    gate_up, gu = bf16_randn((tokens, 2 * inter), rng, scale=3.0)
    gate, up = gu[:, :inter], gu[:, inter:]
    expected = bf16_round(bf16_round(gate / (1.0 + np.exp(-gate))) * up)

    out = cuda.to_device(np.zeros((tokens, inter), np.uint16))
    silu_mul(cuda.to_device(gate_up), out)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)

    assert rel_l2(got, expected) < 1e-2
    # f32 vs f64 evaluation of silu may flip a rounding now and then; almost every value must be bit-exact
    assert np.mean(got == expected) > 0.98, np.mean(got == expected)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator: exp(100) -> f32 inf
def test_silu_mul_extreme_gates():
    """Large |gate|: silu(-100) underflows to -0 (not NaN), silu(+100) = 100."""
    gate = np.array([[-100.0, 100.0, 0.0, -20.0]])
    up = np.array([[2.0, 0.5, 3.0, 1.0]])
    gate_up = to_bf16_bits(np.concatenate([gate, up], axis=1).astype(np.float32))
    out = cuda.to_device(np.zeros((1, 4), np.uint16))
    silu_mul(cuda.to_device(gate_up), out)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    g = from_bf16_bits(gate_up[:, :4]).astype(np.float64)
    expected = bf16_round(bf16_round(g / (1.0 + np.exp(-g))) * up)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-6)
