"""Reference qk-norm + RoPE + paged KV store: the formulas written out plainly, one thread per (token, head).

For token ``t`` at position ``pos = positions[t]`` of slot ``s = token_slots[t]``, and each head of its ``qkv`` row
(q heads at columns ``h·q_head_stride``, then ``nkv`` k heads, then ``nkv`` v heads, ``D`` dims each), in f32::

    x[d]   = the head's values (bf16 -> f32)
    v head:      v_cache[page, off, kvh, :] = x                       (copied bits)
    q or k head: r    = 1 / sqrt(Σ_d x[d]² / D + eps)
                 n[d] = normalize_element(x[d], r, w[d])              (bf16: norm.py's rounding, w = q_norm / k_norm)
                 c, s = cos[pos, d mod half], sin[pos, d mod half]    (bf16, half = rotary_dim / 2)
                 out[d] = bf16(bf16(n[d]·c) + bf16(−n[d + half]·s))   d < half
                 out[d] = bf16(bf16(n[d]·c) + bf16(n[d − half]·s))    half <= d < rotary_dim
                 out[d] = n[d]                                        d >= rotary_dim
    q head:      q_out[t, h, :] = out
    k head:      k_cache[page, off, kvh, :] = out

where ``page = block_tables[s, pos // page_size]``, ``off = pos % page_size``.  A padding token (``s < 0``) still
gets its q; its k / v are not stored.  The tuned kernel (``store.py``) rounds at the same points; it sums ``x²`` in
another order, so its ``r`` may differ in the last f32 bit (rarely one bf16 step in an output: the tests' bound).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import normalize_element
from pegainfer.kernels.primitives import bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, math, threads
from pegainfer.kernels.rope.store import check_store_args


@kernel
def reference_qk_norm_rope_kernel(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables,
                                  k_cache, v_cache, q_out, q_head_stride, rotary_dim, eps, weight_offset,
                                  round_before_weight):
    """One (token, head) per thread, grid-stride (module docstring); bf16 arrays as uint16 bits in their natural
    shapes (qkv ``[T, row]``, caches ``[pages, page_size, nkv, D]``, q_out ``[T, nq, D]``)."""
    n_tokens, nq, D = q_out.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    heads = nq + 2 * nkv
    half = rotary_dim // 2
    for item in range(cuda.grid(1), n_tokens * heads, cuda.gridsize(1)):
        t = item // heads
        h = item % heads
        pos = positions[t]
        slot = token_slots[t]
        is_q = h < nq
        is_k = not is_q and h < nq + nkv
        kvh = h - nq if is_k else h - nq - nkv
        col = h * q_head_stride if is_q else nq * q_head_stride + (h - nq) * D
        if not is_q and slot < 0:                     # a padding token stores no k / v
            continue
        page = block_tables[slot, pos // page_size] if slot >= 0 else 0
        off = pos % page_size
        if not is_q and not is_k:                     # v head: copied
            for d in range(D):
                v_cache[page, off, kvh, d] = qkv[t, col + d]
            continue

        ss = float32(0.0)
        for d in range(D):
            x = bf16_to_f32(qkv[t, col + d])
            ss += x * x
        r = float32(1.0) / float32(math.sqrt(ss / float32(D) + eps))
        for d in range(D):
            w = q_norm_w[d] if is_q else k_norm_w[d]
            n = normalize_element(bf16_to_f32(qkv[t, col + d]), r, w, weight_offset, round_before_weight)
            o = n
            if d < rotary_dim:
                partner = d + half if d < half else d - half
                wp = q_norm_w[partner] if is_q else k_norm_w[partner]
                n_partner = normalize_element(bf16_to_f32(qkv[t, col + partner]), r, wp, weight_offset,
                                              round_before_weight)
                c = bf16_to_f32(cos[pos, d % half])
                s = bf16_to_f32(sin[pos, d % half])
                rotated = -bf16_to_f32(n_partner) if d < half else bf16_to_f32(n_partner)
                o = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(n) * c))
                                + bf16_to_f32(f32_to_bf16(rotated * s)))
            if is_q:
                q_out[t, h, d] = o
            else:
                k_cache[page, off, kvh, d] = o


def reference_qk_norm_rope_store(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache,
                                 v_cache, q_out, eps: float, rotary_dim: int, q_head_stride: int | None = None,
                                 weight_offset: float = 0.0, round_before_weight: bool = True) -> None:
    """What ``qk_norm_rope_store`` computes (module docstring), with its arguments; slow (a thread per (token,
    head)): a correctness oracle, not a serving path."""
    T, nq, D = q_out.shape
    q_head_stride = D if q_head_stride is None else q_head_stride
    check_store_args(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache, v_cache,
                     q_out, rotary_dim, q_head_stride)
    if T == 0:
        return
    block = threads(gpu=128, sim=32)
    launch(reference_qk_norm_rope_kernel, grid(T * (nq + 2 * k_cache.shape[2]), per_block=block, sim_cap=4), block,
           qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache, v_cache, q_out,
           np.int32(q_head_stride), np.int32(rotary_dim), np.float32(eps), np.float32(weight_offset),
           bool(round_before_weight), name="reference_qk_norm_rope")
