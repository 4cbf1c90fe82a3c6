"""Reference paged attention: the family's formula written out plainly, one thread per (token, q head).

For token ``t`` of slot ``s = token_slots[t]``, q head ``h`` (GQA: kv head ``kvh = h // G``, ``G = nq / nkv``), with
every value a bf16 widened to f32 and the arithmetic in f32::

    n        = positions[t] + 1                                        keys 0 .. positions[t]
    K[p], V[p] = k_cache / v_cache[block_tables[s, p // page_size], p % page_size, kvh, :]
    score[p] = (q[t, h, :] . K[p]) · (scale · log2 e)                  base-2 units
    M        = max_p score[p]
    l        = Σ_p 2^(score[p] - M)
    acc[d]   = Σ_p bf16(2^(score[p] - M)) · V[p, d]
    out[t, h, d] = bf16(acc[d] / l)
    gated:   out[t, h, d] = gated_value(out[t, h, d], gate[t, h·2D + D + d])     (gating.py: Qwen3.5's gate)

The rounding points are the tuned kernels' (``decode.py``, ``prefill.py``): the probabilities are the bf16 operand
of their ``P V`` product, the output is rounded once.  What differs is the order of the f32 sums and that the
tuned kernels take each probability relative to a running max (online softmax), so their outputs differ from this
one by about a bf16 rounding of the output (the tests state the bound).  A padding token (``token_slots[t] < 0``)
gets zeros.

Shapes: q, out ``[T, nq, D]``; k_cache, v_cache ``[num_pages, page_size, nkv, D]`` (all uint16 bf16 bits);
block_tables ``[num_slots, max_pages]``, token_slots, positions ``[T]`` int32; gate ``[T, >= 2·nq·D]`` uint16.
"""
from __future__ import annotations

import math

import numpy as np

from pegainfer.kernels.attention.geometry import SUPPORTED_HEAD_DIMS
from pegainfer.kernels.attention.merge import LOG2E
from pegainfer.kernels.gating import gated_value
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, threads, uint16

MAX_HEAD_DIM = max(SUPPORTED_HEAD_DIMS)


@kernel
def reference_attention_kernel(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale_log2, gate,
                               gated):
    """``out[t, h, :]`` for one (token, q head) per thread, grid-stride (module docstring)."""
    n_tokens, nq, D = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nq // nkv
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for item in range(cuda.grid(1), n_tokens * nq, cuda.gridsize(1)):
        t = item // nq
        h = item % nq
        kvh = h // group
        slot = token_slots[t]
        if slot < 0:                                  # padding token
            for d in range(D):
                out[t, h, d] = uint16(0)
            continue
        n = positions[t] + 1

        m = float32(-math.inf)                        # pass 1: the largest score
        for p in range(n):
            page, row = block_tables[slot, p // page_size], p % page_size
            dot = float32(0.0)
            for d in range(D):
                dot += bf16_to_f32(q[t, h, d]) * bf16_to_f32(k_cache[page, row, kvh, d])
            m = max(m, float32(dot * scale_log2))

        l = float32(0.0)                              # pass 2: the sum and the bf16-weighted values
        for d in range(D):
            acc[d] = float32(0.0)
        for p in range(n):
            page, row = block_tables[slot, p // page_size], p % page_size
            dot = float32(0.0)
            for d in range(D):
                dot += bf16_to_f32(q[t, h, d]) * bf16_to_f32(k_cache[page, row, kvh, d])
            prob = float32(math.exp2(float32(dot * scale_log2) - m))
            l += prob
            prob_bf16 = bf16_to_f32(f32_to_bf16(prob))
            for d in range(D):
                acc[d] += prob_bf16 * bf16_to_f32(v_cache[page, row, kvh, d])

        for d in range(D):
            o = f32_to_bf16(acc[d] / l)
            if gated:
                o = gated_value(o, gate[t, h * 2 * D + D + d])
            out[t, h, d] = o


def reference_paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale,
                              gate=None) -> None:
    """``out = attention(q, paged K/V)`` (module docstring), gated by ``gate`` when given.  Shapes as
    ``paged_attention``'s; slow (a thread per (token, head)): a correctness oracle, not a serving path."""
    T, nq, D = q.shape
    assert D <= MAX_HEAD_DIM and k_cache.shape[3] == D and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert nq % k_cache.shape[2] == 0 and out.shape == q.shape, (q.shape, k_cache.shape, out.shape)
    gated = gate is not None
    if gated:
        assert gate.ndim == 2 and gate.shape[0] == T and gate.shape[1] >= 2 * nq * D, (gate.shape, q.shape)
    block = threads(gpu=128, sim=32)
    launch(reference_attention_kernel, grid(T * nq, per_block=block, sim_cap=4), block, q, k_cache, v_cache,
           block_tables, token_slots, positions, out, np.float32(scale * LOG2E), gate if gated else out.reshape(T, -1),
           gated, name="reference_attention")
