"""RMSNorm, plain and fused with the residual add, in the two bf16 roundings the served models use.

For a row ``x`` of ``hidden`` values, with ``r = 1 / sqrt(mean(x²) + eps)`` computed in f32:

* **Qwen3** (``round_before_weight=True``, ``weight_offset=0``) — HF ``Qwen3RMSNorm`` rounds twice:
  ``n = bf16(x · r)``, ``out = bf16(n · w)``.
* **Qwen3.5** (``round_before_weight=False``, ``weight_offset=1``) — HF ``Qwen3_5RMSNorm`` stores ``w`` as an offset
  from one and rounds once: ``out = bf16((x · r) · (1 + w))``, all in f32.

Both forms are one kernel: the two flags are kernel arguments (constant per model, so safe to bake into a CUDA
graph).  ``add_rms_norm`` is vLLM's ``fused_add_rms_norm``: the decoder layer's residual add and the next norm in one
pass, ``residual = bf16(residual + delta)`` in place, then the norm of the *rounded* sum (as HF computes it).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import (bf16_to_f32, block_sum, cuda, device_fn, f32_to_bf16, float32, grid,
                                          kernel, math, threads)


@device_fn
def normalize_element(x, inv_rms, w_bits, weight_offset, round_before_weight):
    """One normalized output (bf16 bits) from the f32 input ``x``, the row's ``inv_rms`` and the weight's bf16 bits,
    rounded the way the model's HF norm rounds (see the module docstring)."""
    n = float32(x) * inv_rms
    if round_before_weight:
        n = bf16_to_f32(f32_to_bf16(n))
    return f32_to_bf16(n * (bf16_to_f32(w_bits) + weight_offset))


@device_fn
def inverse_rms(sum_squares, count, eps):
    """``1 / sqrt(sum_squares / count + eps)`` in f32."""
    return float32(1.0) / math.sqrt(float32(sum_squares) / float32(count) + eps)


@device_fn
def write_normalized_row(x, row, weight, out, inv_rms, weight_offset, round_before_weight):
    """``out[row, :] = norm(x[row, :])`` with this thread's block-stride share of the columns."""
    for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[row, i] = normalize_element(bf16_to_f32(x[row, i]), inv_rms, weight[i], weight_offset,
                                        round_before_weight)


@kernel
def rms_norm_kernel(x, weight, out, eps, weight_offset, round_before_weight):
    """RMSNorm of each token row.

    x ``[tokens, hidden]``, weight ``[hidden]``, out ``[tokens, hidden]`` — uint16 bf16 bits; eps and weight_offset
    f32; round_before_weight bool (module docstring gives both roundings).

    Geometry: one block per token row (grid-stride over rows); threads stride over ``hidden``, square-sum with
    ``block_sum`` (every thread of the block takes part: the row loop's trip count is uniform across the block).
    """
    eps = float32(eps)
    weight_offset = float32(weight_offset)
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        ss = float32(0.0)
        for i in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            v = bf16_to_f32(x[row, i])
            ss += v * v
        inv_rms = inverse_rms(block_sum(ss), x.shape[1], eps)
        write_normalized_row(x, row, weight, out, inv_rms, weight_offset, round_before_weight)


@kernel
def add_rms_norm_kernel(residual, delta, weight, out, eps, weight_offset, round_before_weight):
    """Residual add fused with RMSNorm: ``residual = bf16(residual + delta)`` (in place), ``out = norm(residual)``.

    residual, delta, out ``[tokens, hidden]``, weight ``[hidden]`` — uint16 bf16 bits; the norm squares the rounded
    sum, as HF's bf16 forward does.

    Geometry: one block per token row (grid-stride over rows); threads stride over ``hidden``.  Each thread reads
    back only the columns it wrote itself, so no barrier is needed between the add and the normalize pass.
    """
    eps = float32(eps)
    weight_offset = float32(weight_offset)
    for row in range(cuda.blockIdx.x, residual.shape[0], cuda.gridDim.x):
        ss = float32(0.0)
        for i in range(cuda.threadIdx.x, residual.shape[1], cuda.blockDim.x):
            s_bits = f32_to_bf16(bf16_to_f32(residual[row, i]) + bf16_to_f32(delta[row, i]))
            residual[row, i] = s_bits
            v = bf16_to_f32(s_bits)
            ss += v * v
        inv_rms = inverse_rms(block_sum(ss), residual.shape[1], eps)
        write_normalized_row(residual, row, weight, out, inv_rms, weight_offset, round_before_weight)


def _check(x, weight, out):
    assert x.ndim == 2 and x.dtype == np.uint16, (x.shape, x.dtype)
    assert weight.ndim == 1 and weight.dtype == np.uint16 and weight.shape[0] == x.shape[1], (weight.shape, x.shape)
    assert out.shape == x.shape and out.dtype == np.uint16, (out.shape, out.dtype, x.shape)


def _geometry(num_tokens):
    return grid(num_tokens, sim_cap=4), threads(gpu=256, sim=32)


def rms_norm(x, weight, out, eps: float, weight_offset: float = 0.0, round_before_weight: bool = True) -> None:
    """``out = RMSNorm(x) * (weight_offset + weight)`` per token row; x, out ``[T, H]``, weight ``[H]`` bf16 bits.
    Qwen3: defaults; Qwen3.5: ``weight_offset=1.0, round_before_weight=False``."""
    _check(x, weight, out)
    if x.shape[0] == 0:
        return
    launch(rms_norm_kernel, *_geometry(x.shape[0]), x, weight, out, np.float32(eps), np.float32(weight_offset),
           bool(round_before_weight))


def add_rms_norm(residual, delta, weight, out, eps: float, weight_offset: float = 0.0,
                 round_before_weight: bool = True) -> None:
    """``residual = bf16(residual + delta)`` in place, then ``out = rms_norm(residual)`` (same flags as
    ``rms_norm``); residual, delta, out ``[T, H]``, weight ``[H]`` bf16 bits."""
    _check(residual, weight, out)
    assert delta.shape == residual.shape and delta.dtype == np.uint16, (delta.shape, delta.dtype)
    if residual.shape[0] == 0:
        return
    launch(add_rms_norm_kernel, *_geometry(residual.shape[0]), residual, delta, weight, out, np.float32(eps),
           np.float32(weight_offset), bool(round_before_weight))
