"""What the tests of ``pegainfer.kernels.linear`` share: data, launches, float64 and reference-kernel oracles.

``exact_bf16`` data (small integers times a power of two) makes every sum of products exact in f32, whatever its
order: every path -- the GEMVs, the tensor-core kernels, the FMA tiles, the reference kernel -- then computes the same
f32 sums and rounds them at the same points, so the tests compare them bit for bit.  Random ``bf16_randn`` data
checks the rounding against float64 NumPy (the f32 sums then differ from float64 in the last bits only).
"""
import numpy as np

from tests.util import bf16_round, from_bf16_bits, to_bf16_bits
from numba import cuda

from pegainfer.kernels import norm
from pegainfer.kernels.linear import (linear, linear_add_rms_norm, linear_silu_mul, reference_linear,
                                      reference_linear_silu_mul)


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


# ------------------------------------------------------------------------------------------------ add + RMSNorm + linear
NORM_FORMS = {"qwen3": {}, "qwen35": {"weight_offset": 1.0, "round_before_weight": False}}


def rms_norm_reference(s, w, eps, weight_offset=0.0, round_before_weight=True):
    """HF's bf16 RMSNorm of the rows of ``s`` in float64 (Qwen3: round, then weight, round; Qwen3.5: one rounding
    of ``n · (1 + w)``)."""
    n = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    if round_before_weight:
        n = bf16_round(n)
    return bf16_round(n * (w + weight_offset))


def separate_ops(rb, db, wnb, wb, gated, form, eps):
    """The unfused ops (``norm.add_rms_norm`` / ``norm.rms_norm`` in place, then ``linear``): (residual, normed,
    out) as uint16 bits."""
    T, H = rb.shape
    residual = cuda.to_device(rb.copy())
    normed = cuda.to_device(np.zeros((T, H), np.uint16))
    if db is None:
        norm.rms_norm(residual, cuda.to_device(wnb), normed, eps, **NORM_FORMS[form])
    else:
        norm.add_rms_norm(residual, cuda.to_device(db), cuda.to_device(wnb), normed, eps, **NORM_FORMS[form])
    out = cuda.to_device(np.zeros((T, wb.shape[0] // 2 if gated else wb.shape[0]), np.uint16))
    (linear_silu_mul if gated else linear)(normed, cuda.to_device(wb), out)
    return residual.copy_to_host(), normed.copy_to_host(), out.copy_to_host()


def fused_op(rb, db, wnb, wb, gated, form, eps, **kw):
    """``linear_add_rms_norm``: (residual_in after the call, residual_out, normed_out, out) as uint16 bits;
    residual_out and normed_out start filled with a sentinel."""
    T, H = rb.shape
    residual_in = cuda.to_device(rb.copy())
    residual_out = cuda.to_device(np.full((T, H), 0x7FC1, np.uint16))
    normed_out = cuda.to_device(np.full((T, H), 0x7FC1, np.uint16))
    out = cuda.to_device(np.zeros((T, wb.shape[0] // 2 if gated else wb.shape[0]), np.uint16))
    linear_add_rms_norm(residual_in, None if db is None else cuda.to_device(db), cuda.to_device(wnb), eps,
                        residual_out, cuda.to_device(wb), out, gated=gated, normed_out=normed_out,
                        **NORM_FORMS[form], **kw)
    return (residual_in.copy_to_host(), residual_out.copy_to_host(), normed_out.copy_to_host(),
            out.copy_to_host())
