"""Sigmoid output gate of Qwen3.5's full-attention layers.

Qwen3.5's ``q_proj`` yields, per head, a query and a gate of the same width, interleaved head by head: row ``t`` of
its output ``qg [tokens, heads·2·D]`` holds ``[q_0 | gate_0 | q_1 | gate_1 | …]`` (HF: ``q_proj(x).view(T, H, 2D)``
then ``chunk(2, dim=-1)``).  After attention, each head's output is scaled element-wise by ``sigmoid(gate)``
(HF ``Qwen3_5Attention.forward``: ``attn_output * torch.sigmoid(gate)``), in bf16::

    out[t, h, d] = bf16( attn[t, h, d] · bf16(sigmoid(qg[t, h·2D + D + d])) )

The gate is rounded to bf16 first, because HF's ``torch.sigmoid`` of a bf16 tensor returns bf16.

One module, no separate reference: ``sigmoid_gate_mul_kernel`` is already the plain form (a thread per element, the
expression above), which the tests check against float64 NumPy and HF.  The split-K attention kernel applies the
same ``gated_value`` as it writes its output; the tiled prefill attention is followed by ``sigmoid_gate_mul``.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (bf16_to_f32, cuda, device_fn, f32_to_bf16, float32, grid, kernel, math,
                                          pdl_prologue, threads)


@device_fn
def gated_value(attn_bits, gate_bits):
    """``bf16(attn · bf16(sigmoid(gate)))`` for one element (bf16 bits in and out): the gate's rounding above.
    Also the output epilogue of the split-K attention kernel (``attention.paged_attention(..., gate=)``)."""
    gate = bf16_to_f32(gate_bits)
    sig = bf16_to_f32(f32_to_bf16(float32(1.0) / (float32(1.0) + float32(math.exp(-gate)))))
    return f32_to_bf16(bf16_to_f32(attn_bits) * sig)


@kernel
def sigmoid_gate_mul_kernel(attn, qg, out):
    """``out = bf16(attn · bf16(sigmoid(gate)))`` with the gate read from the interleaved q_proj output.

    attn, out ``[tokens, heads, D]`` bf16 (out may alias attn); qg ``[tokens, ≥ heads·2·D]`` bf16, head ``h``'s
    gate at columns ``h·2D + D … h·2D + 2D − 1``.

    Geometry: grid-stride over all ``tokens·heads·D`` elements, flattened with ``d`` fastest (coalesced reads of
    attn and of each gate half-row, coalesced writes).
    """
    pdl_prologue()
    heads = attn.shape[1]
    dim = attn.shape[2]
    total = attn.shape[0] * heads * dim
    for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, total, cuda.gridDim.x * cuda.blockDim.x):
        d = idx % dim
        h = (idx // dim) % heads
        t = idx // (dim * heads)
        out[t, h, d] = gated_value(attn[t, h, d], qg[t, h * 2 * dim + dim + d])


def sigmoid_gate_mul(attn, qg, out, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = attn · sigmoid(gate)`` per head (module docstring).  attn ``[T, H, D]`` bf16 bits; qg ``[T, row]``
    with ``row ≥ 2·H·D`` (the q_proj output; gate of head h at column ``h·2D + D``); out ``[T, H, D]`` or
    ``[T, H·D]`` (a contiguous device array, reshaped here), may be attn itself."""
    assert attn.ndim == 3 and attn.dtype == np.uint16, (attn.shape, attn.dtype)
    assert qg.ndim == 2 and qg.dtype == np.uint16, (qg.shape, qg.dtype)
    num_tokens, heads, dim = attn.shape
    assert qg.shape[0] == num_tokens and qg.shape[1] >= 2 * heads * dim, (qg.shape, attn.shape)
    assert out.dtype == np.uint16 and out.size == attn.size and out.shape[0] == num_tokens, (out.shape, attn.shape)
    if out.ndim != 3:
        out = out.reshape(num_tokens, heads, dim)
    total = num_tokens * heads * dim
    if total == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(sigmoid_gate_mul_kernel, grid(total, per_block=block * 4, sim_cap=4), block, attn, qg, out, policy=policy)
