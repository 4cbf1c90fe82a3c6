"""What the tests of ``pegainfer.kernels.linear`` share: data, launches, float64 and reference-kernel oracles.

``exact_bf16`` data (small integers times a power of two) makes every sum of products exact in f32, whatever its
order: every path -- the GEMVs, the tensor-core kernels, the FMA tiles, the reference kernel -- then computes the same
f32 sums and rounds them at the same points, so the tests compare them bit for bit.  Random ``bf16_randn`` data
checks the rounding against float64 NumPy (the f32 sums then differ from float64 in the last bits only).
"""
import numpy as np

from tests.util import bf16_round, from_bf16_bits, to_bf16_bits
from numba import cuda

from pegainfer.kernels.linear import reference_linear, reference_linear_silu_mul


def exact_bf16(shape, rng, step: float):
    """bf16 values ``step · i`` with integers ``|i| <= 8``: (uint16 bits, float64 values).  With x on steps of
    1/8 and w on steps of 1/16, a product is a multiple of 2^-7 below 2^-1, so a sum over K <= 2^16 terms is a
    multiple of 2^-7 below 2^15: exact in f32 (24 bits)."""
    values = rng.integers(-8, 9, shape).astype(np.float64) * step
    return to_bf16_bits(values.astype(np.float32)), values


def exact_inputs(T, N, K, rng):
    """``x [T, K]`` and ``w [N, K]`` of ``exact_bf16`` data: ((x bits, x), (w bits, w))."""
    return exact_bf16((T, K), rng, 1 / 8), exact_bf16((N, K), rng, 1 / 16)


def silu_mul_reference(x, w_gate_up):
    """HF's bf16 MLP activation in float64: g, u rounded, silu(g) rounded, the product rounded."""
    inter = w_gate_up.shape[0] // 2
    g = bf16_round(x @ w_gate_up[:inter].T)
    u = bf16_round(x @ w_gate_up[inter:].T)
    return bf16_round(bf16_round(g / (1.0 + np.exp(-g))) * u)


def run_bits(fn, xb, wb, n_out, **kw):
    """``fn(x, w, out, **kw)`` on fresh device copies; the output bits ``[T, n_out]``."""
    out = cuda.to_device(np.zeros((xb.shape[0], n_out), np.uint16))
    fn(cuda.to_device(xb), cuda.to_device(wb), out, **kw)
    return out.copy_to_host()


def run(fn, xb, wb, n_out, **kw):
    """``run_bits`` as float64 values."""
    return from_bf16_bits(run_bits(fn, xb, wb, n_out, **kw)).astype(np.float64)


def reference_bits(xb, wb, gated: bool = False):
    """The reference kernel's output bits for ``x``, ``w`` (gated: ``w_gate_up``)."""
    if gated:
        return run_bits(reference_linear_silu_mul, xb, wb, wb.shape[0] // 2)
    return run_bits(reference_linear, xb, wb, wb.shape[0])


def assert_same_bits(got, expected, what: str = "the tuned kernel"):
    mismatches = int(np.sum(got != expected))
    assert mismatches == 0, f"{what}: {mismatches} of {got.size} outputs differ from the reference kernel's bits"
