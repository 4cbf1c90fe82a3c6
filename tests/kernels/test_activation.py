"""SwiGLU (silu_mul): the tuned kernel against the reference kernel (bit for bit), the reference against a float64
NumPy SwiGLU that rounds to bf16 where HF's bf16 forward does."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.activation import reference_silu_mul, silu_mul
from pegainfer.kernels.primitives import to_bf16_bits


def numpy_silu_mul(gu):
    """float64 SwiGLU of ``gu [T, 2I]`` (values of bf16s) rounding as HF: silu(gate) rounded, the product rounded."""
    inter = gu.shape[1] // 2
    gate, up = gu[:, :inter], gu[:, inter:]
    return bf16_round(bf16_round(gate / (1.0 + np.exp(-gate))) * up)


def both_kernels(gate_up):
    """(tuned, reference) outputs for ``gate_up`` bf16 bits ``[T, 2I]``, as bf16 bits."""
    outs = []
    for fn in (silu_mul, reference_silu_mul):
        out = cuda.to_device(np.full((gate_up.shape[0], gate_up.shape[1] // 2), 0x7FC1, np.uint16))
        fn(cuda.to_device(gate_up), out)
        outs.append(out.copy_to_host())
    return outs


def test_silu_mul_matches_reference_and_hf_rounding(rng):
    tokens, inter = 3, 80
    gate_up, gu = bf16_randn((tokens, 2 * inter), rng, scale=3.0)
    tuned, ref = both_kernels(gate_up)
    np.testing.assert_array_equal(tuned, ref)

    got = from_bf16_bits(ref).astype(np.float64)
    expected = numpy_silu_mul(gu)
    assert rel_l2(got, expected) < 1e-2
    # f32 vs f64 evaluation of silu may flip a rounding now and then; almost every value must be bit-exact
    assert np.mean(got == expected) > 0.98, np.mean(got == expected)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator: exp(100) -> f32 inf
def test_silu_mul_extreme_gates():
    """Large |gate|: silu(-100) underflows to -0 (not NaN), silu(+100) = 100; both kernels agree."""
    gate = np.array([[-100.0, 100.0, 0.0, -20.0]])
    up = np.array([[2.0, 0.5, 3.0, 1.0]])
    gate_up = to_bf16_bits(np.concatenate([gate, up], axis=1).astype(np.float32))
    tuned, ref = both_kernels(gate_up)
    np.testing.assert_array_equal(tuned, ref)
    got = from_bf16_bits(ref).astype(np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_silu_mul(from_bf16_bits(gate_up).astype(np.float64)), rtol=1e-2, atol=1e-6)
