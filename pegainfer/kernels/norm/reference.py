"""The reference RMSNorm (plain, and fused with the residual add): one thread per token row, the math line by line.

For a row of ``H`` values, in both roundings of ``row_kernel.py`` (Qwen3: ``weight_offset=0``,
``round_before_weight=True``; Qwen3.5: ``weight_offset=1``, ``round_before_weight=False``)::

    s[i]    = bf16(residual_in[i] + delta[i])        (s = residual_in without a delta)
    ss      = f32(Σ_i s[i]²)                         (summed in float64, rounded once to f32)
    inv_rms = 1 / sqrt(ss / H + eps)                 (f32)
    n[i]    = s[i] · inv_rms                         (f32; bf16(n[i]) when round_before_weight)
    out[i]  = bf16(n[i] · (w[i] + weight_offset))    (f32 product, rounded)

residual_in, delta, residual_out, out ``[tokens, H]`` and w ``[H]``: uint16 bf16 bits; ``residual_out = s`` when
given.  The tuned kernel rounds at the same points; only its f32 sum of squares (in its own order) differs from
``ss`` here, by at most ``H · 2⁻²⁴`` relative, so an output differs by at most one bf16 ulp, and rarely.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, math, threads


@kernel
def reference_add_rms_norm_kernel(residual_in, delta, has_delta, weight, residual_out, write_residual, out, eps,
                                  weight_offset, round_before_weight):
    """The module docstring's lines for each token row ``t`` (a thread per row, grid-stride).  ``delta`` is read only
    when ``has_delta``, ``residual_out`` written only when ``write_residual``; all ``[tokens, H]`` uint16 but weight
    ``[H]``."""
    tokens, hidden = residual_in.shape
    eps = float32(eps)
    weight_offset = float32(weight_offset)
    for t in range(cuda.grid(1), tokens, cuda.gridsize(1)):
        ss = 0.0                                                       # float64
        for i in range(hidden):
            s = bf16_to_f32(residual_in[t, i])
            if has_delta:
                s = bf16_to_f32(f32_to_bf16(s + bf16_to_f32(delta[t, i])))
            ss += float(s) * float(s)
        inv_rms = float32(1.0) / float32(math.sqrt(float32(ss) / float32(hidden) + eps))
        for i in range(hidden):
            s_bits = residual_in[t, i]
            if has_delta:
                s_bits = f32_to_bf16(bf16_to_f32(s_bits) + bf16_to_f32(delta[t, i]))
            if write_residual:
                residual_out[t, i] = s_bits
            n = bf16_to_f32(s_bits) * inv_rms
            if round_before_weight:
                n = bf16_to_f32(f32_to_bf16(n))
            out[t, i] = f32_to_bf16(n * (bf16_to_f32(weight[i]) + weight_offset))


def reference_add_rms_norm(residual_in, delta, weight, residual_out, out, eps: float, weight_offset: float = 0.0,
                           round_before_weight: bool = True) -> None:
    """``s = bf16(residual_in + delta)`` (``delta=None``: ``s = residual_in``), ``residual_out = s`` (unless None;
    may be ``residual_in`` itself), ``out = RMSNorm(s) · (weight_offset + weight)``; device arrays of bf16 bits,
    ``[T, H]`` but weight ``[H]``."""
    assert residual_in.ndim == 2 and residual_in.dtype == np.uint16, (residual_in.shape, residual_in.dtype)
    assert out.shape == residual_in.shape and weight.shape == (residual_in.shape[1],), (out.shape, weight.shape)
    if residual_in.shape[0] == 0:
        return
    block = threads(gpu=128, sim=32)
    launch(reference_add_rms_norm_kernel, grid(residual_in.shape[0], per_block=block, sim_cap=4), block,
           residual_in, residual_in if delta is None else delta, delta is not None, weight,
           residual_in if residual_out is None else residual_out, residual_out is not None, out, np.float32(eps),
           np.float32(weight_offset), bool(round_before_weight))


def reference_rms_norm(x, weight, out, eps: float, weight_offset: float = 0.0,
                       round_before_weight: bool = True) -> None:
    """``out = RMSNorm(x) · (weight_offset + weight)`` per token row (``reference_add_rms_norm`` without a delta)."""
    reference_add_rms_norm(x, None, weight, None, out, eps, weight_offset, round_before_weight)
