"""Attention over the paged KV cache: one kernel family for prefill and decode (a vLLM-style flat token batch).

The step has ``T`` query tokens.  Token ``t`` belongs to the sequence in slot ``token_slots[t]`` and sits at position
``positions[t]``; it attends to every key of its slot at positions ``0 .. positions[t]`` inclusive (causality falls
out of the positions).  The K/V of all ``T`` tokens are already in the cache when attention runs.

KV cache layout (per layer)::

    k_cache, v_cache : [num_pages, page_size, num_kv_heads, head_dim]  uint16 (bf16 bits)
    block_tables     : [num_slots, max_pages_per_seq] int32  (logical page of a slot -> physical page)
    key of position p of slot s, kv head g:  k_cache[block_tables[s, p // page_size], p % page_size, g, :]

Math, for query head ``h`` of token ``t`` (GQA: ``h`` reads kv head ``h // (nq // nkv)``), in f32::

    out[t, h, :] = bf16( softmax_p( scale * q[t, h, :] . K[p, :] ) @ V )      p = 0 .. positions[t]

computed with the *online softmax*: a running max ``m``, a running sum ``l = sum exp(s - m)`` and an unnormalised
accumulator ``acc = sum exp(s - m) V[p]``; when a larger score arrives, ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``.  Two partial results ``(m1, l1, acc1)`` and ``(m2, l2, acc2)`` over disjoint key sets merge
exactly: ``M = max(m1, m2)``, ``l = l1 e^(m1-M) + l2 e^(m2-M)``, ``acc = acc1 e^(m1-M) + acc2 e^(m2-M)``.

Two paths:

* **Split-K ("flash-decoding")**: ``paged_attention_split_kernel``, on tensor cores.  One block per (token, kv
  head, split); the block serves all ``G = nq // nkv`` query heads of its kv head (the rows of an ``m16n8k16`` tile,
  so each K/V row is read from memory once for ``G`` heads), and each warp computes ``S = Q K^T`` and ``O += P V``
  for 16 keys per step with K/V fragments loaded straight from the cache into registers (no shared-memory
  staging).  The launch provides ``num_splits`` splits per (token, kv head), chosen from shapes known before
  capture (``T``, ``nq``, the block table's capacity); how many of them do work is computed *on the device* from
  ``positions[t]`` (splits of a multiple of ``_min_chunk`` keys), so a short context uses few blocks and a
  long one fills the GPU, and the launch is identical for every step (CUDA graphs).  One split with work writes the
  output directly; otherwise every split writes a partial ``(m, l, acc)`` to the workspace and the *last* block of
  the (token, kv head) to finish -- an atomic counter in the workspace, reset to 0 by that block -- merges them.
  One launch, no combine kernel.  This path serves every ``T`` (decode batches, short chunks).
* **Tiled prefill**: ``paged_attention_prefill_kernel`` (FlashAttention-2 style, on tensor cores): one block per
  (tile of ``BQ`` consecutive query tokens, kv head); the tile's ``BQ * G`` query rows share every K/V tile staged in
  shared memory, ``S = Q K^T`` and ``O += P V`` are ``mma.sync.m16n8k16`` (bf16 in, f32 accumulate) and the
  softmax lives in the accumulator registers.  ``method="auto"`` takes it from ``PREFILL_MIN_TOKENS`` tokens up.
  In the simulator the warp-wide mma is emulated (``primitives.mma_bf16_m16n8k16``), so the same kernel is tested
  there.

Public API: ``paged_attention`` (``DecodeRope`` for its fused decode form), ``attention_workspace_size``,
``attention_num_splits``.
Nothing allocates per call (the split-K partials and counters live in the caller's ``workspace``), and every
per-step value comes from device arrays, so both paths can be captured in a CUDA graph.  A token with
``token_slots[t] < 0`` (padding of a fixed-size batch) reads nothing and gets zeros, on both paths.
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from dataclasses import dataclass

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.gating import gated_value, sigmoid_gate_mul
from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import normalize_element
from pegainfer.kernels.rope import head_geometry, head_inverse_rms, norm_rope_pair
from pegainfer.kernels.primitives import (
    bf16_to_f32,
    device_fn,
    f32_to_bf16,
    float32,
    grid,
    kernel,
    lane_group_max,
    lane_group_sum,
    load_u32x4,
    pdl_prologue,
    grid_dependency_wait,
    launch_dependents,
    mma_bf16_m16n8k16,
    pack_bf16x2,
    threads,
    int32,
    uint16,
    uint32,
    warp_sum,
    global_timer,
)
from pegainfer.kernels import timeline

NEG_INF = float32(-math.inf)
uint64 = np.uint64

# Split-K policy (see ``attention_num_splits``).
SPLIT_TARGET_ROWS = 2048   # aim for ~this many (token, q head, split) rows per launch: ~512 blocks at G = 4
MIN_SPLIT_TOKENS = 256     # split lengths are multiples of this many keys (two passes of 8 warps × 16 keys)
MIN_SPLIT_TOKENS_WIDE = 64  # ... for heads wider than 128 dims (one pass of the dim-split kernel's 4 warp pairs)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
PREFILL_MIN_TOKENS = 128   # "auto" takes the tiled prefill kernel from this many query tokens up


@device_fn
def rescale_factor2(m_part, m_total):
    """``2^(m_part - m_total)`` (scores kept in log2 units), and 0 for an empty partial."""
    if m_part == NEG_INF:
        return float32(0.0)
    return float32(math.exp2(m_part - m_total))


# ------------------------------------------------------------------------------------------------ split-K kernel
@device_fn
def _smem_word(arr16, i):
    """The uint32 word of the bf16 pair ``arr16[i], arr16[i + 1]`` (``i`` even): low half first, as in memory."""
    return uint32(arr16[i]) | (uint32(arr16[i + 1]) << uint32(16))


MAX_SPLITS = 256
DECODE_STEP_KEYS = 16   # keys one warp handles per step (two n8 tiles of S, one k16 step of P V)


@device_fn
def _load_words(src, base, n, dst, dst_off, ok):
    """``dst[dst_off : dst_off + n] = src[base : base + n]`` (uint32 words; 16-byte loads when ``n % 4 == 0``, in
    which case ``base`` must be a multiple of 4), or zeros when ``not ok``."""
    if ok:
        if n % 4 == 0:
            for c in range(n // 4):
                (dst[dst_off + 4 * c], dst[dst_off + 4 * c + 1],
                 dst[dst_off + 4 * c + 2], dst[dst_off + 4 * c + 3]) = load_u32x4(src, base + 4 * c)
        else:
            for i in range(n):
                dst[dst_off + i] = src[base + i]
    else:
        for i in range(n):
            dst[dst_off + i] = uint32(0)


@device_fn
def _kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, row_words):
    """Word offset of the K/V row of ``key`` (a position of ``slot``), kv head ``kvh``, in the flat cache."""
    page = block_tables[uint64(slot), uint64(key >> page_shift)]   # unsigned: no negative-index wraparound code
    return (((page << page_shift) + (key & ((1 << page_shift) - 1))) * num_kv_heads + kvh) * row_words


@device_fn
def _step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh, row_words):
    """``_kv_row`` of ``key``, a key of the 16-key step that starts at ``k0``; 0 for a key past ``k_hi`` (not
    loaded).  ``row0`` is the step's first row when all its keys share a page (``_step_first_row``): then it is
    one multiply-add, no block-table load."""
    if key >= k_hi:
        return 0
    if row0 >= 0:
        return row0 + (key - k0) * num_kv_heads * row_words
    return _kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, row_words)


@device_fn
def _step_first_row(block_tables, slot, k0, k_hi, page_shift, num_kv_heads, kvh, row_words):
    """Row of key ``k0`` when the step's ``DECODE_STEP_KEYS`` keys from ``k0`` lie in one page (pages of at least
    that many keys and ``k0`` a multiple of it: every split at the default split lengths, ``_min_chunk``), else -1.  One
    block-table load per step and warp instead of one per key a lane loads (six)."""
    if page_shift >= 4 and (k0 & (DECODE_STEP_KEYS - 1)) == 0 and k0 < k_hi:
        return _kv_row(block_tables, slot, k0, page_shift, num_kv_heads, kvh, row_words)
    return -1


@device_fn
def _split_range(n_keys, split, num_splits, min_chunk):
    """(first key, end key, number of splits with work) of ``split`` for a token with ``n_keys`` keys: splits of
    ``chunk = ceil(n_keys / num_splits)`` keys rounded up to a multiple of ``min_chunk``; splits past the end are
    empty.  All four are non-negative and < 2^31: the divisions are unsigned 32-bit ones (a 64-bit signed division
    by a runtime value is ~3x the instructions)."""
    n, s, m = uint32(n_keys), uint32(num_splits), uint32(min_chunk)
    chunk = uint32(uint32(n + s - uint32(1)) // s)
    chunk = uint32(uint32(chunk + m - uint32(1)) // m) * m
    k_lo = int32(uint32(split) * chunk)
    return k_lo, min(k_lo + int32(chunk), int32(n_keys)), int32(uint32(n + chunk - uint32(1)) // chunk)


@functools.lru_cache(maxsize=None)
def _split_kernel(head_dim: int, group: int, warps: int, late_v: bool = False, min_blocks: int = 0,
                  decode: bool = False, gated: bool = False, rope_rotary_dim: int = 0, dim_split: bool = False,
                  gate_early: bool = False, release: str = "last_load", stamps: bool = False,
                  rope_release_late: bool = False):
    """Build the split-K kernel for one shape (closure constants size the register fragments).  ``late_v``: load V
    after computing S (K's registers are then free: fewer registers, one more memory round trip per step);
    ``min_blocks``: launch bounds asking for that many resident blocks per SM (0: none); ``decode``: every token is
    its sequence's newest, so only its own key and q come from the kernel before (the early loads below);
    ``gated``: the output is scaled by Qwen3.5's sigmoid gate (``gating.gated_value``) as it is written;
    ``rope_rotary_dim`` > 0 (with ``decode``): the kernel also does ``rope.qk_norm_rope_store``'s work for its
    heads, from the raw projection (the rotary dims of a head are a compile-time constant of the register layout);
    ``dim_split``: the warps work in pairs, each warp of a pair on one half of the head dims of the same 16 keys
    (its S is the sum of the pair's two partial products, exchanged through shared memory), so a warp's registers
    and dependent chain are those of a head half as wide (Qwen3.5's D = 256); ``gate_early`` (with ``gated``): each
    thread loads the gate values of the output elements it will write right after the PDL wait, into registers,
    rather than as a dependent load after the merge (``GATE_EARLY``); ``release`` (with ``decode``): where a block
    lets the next kernel launch (``DECODE_RELEASES``); ``stamps``: each block appends its ``timeline`` record (the
    wait stamp of a decode launch: its first work item's); ``rope_release_late`` (fused path, ``release`` after the
    wait): the next kernel is released once the norm / RoPE phase is done rather than right after the wait
    (``FUSED_DECODE_ROPE_RELEASE``)."""
    assert release in DECODE_RELEASES, release
    STAMPS = stamps
    D, G, W, LATE_V, DECODE, GATED = head_dim, group, warps, late_v, decode, gated
    RELEASE_START = DECODE and release == "start"
    RELEASE_AFTER_WAIT = DECODE and release == "after_wait"
    RELEASE_LAST_LOAD = DECODE and release == "last_load"
    GATE_EARLY_ = gated and gate_early
    ROPE = rope_rotary_dim > 0
    ROPE_RELEASE_LATE = ROPE and rope_release_late
    assert not ROPE or DECODE
    DS = 2 if dim_split else 1               # warps per 16-key step
    assert not (dim_split and ROPE), "the dim-split kernel has no fused qk-norm / RoPE path"
    assert W % DS == 0 and (D // DS) % 16 == 0, (W, D, DS)
    DH = D // DS                             # head dims one warp handles
    SW = W // DS                             # 16-key steps per round (warps, or warp pairs)
    HALF_WORDS = DH // 2                     # word offset of the second half's dims within a row
    SM_S = 2 * W * 128 if dim_split else 1   # the pairs' partial S, double-buffered by round [2, W, 32 lanes, 4]
    ROT = max(rope_rotary_dim, 2)
    HALF = ROT // 2
    J, SHIFT = head_geometry(D, ROT)         # a warp holds one head: lane l dims l + 32 j
    HJ = -(-HALF // 32)                      # registers of a lane holding rotary pairs (dims l + 32 j < HALF)
    ROLES = G + 2                            # fused roles: the G q heads, then the k head, then the v head
    ROLE_ROUNDS = -(-ROLES // W)
    NT = 32 * W
    ROW_WORDS = D // 2
    KW = DH // 8         # words of a q / K row per lane: lane t (= lane & 3) holds dims [t DH/4, (t+1) DH/4)
    VW = DH // 16        # words of a V row per lane: lane g (= lane >> 2) holds dims [g DH/8, (g+1) DH/8)
    QK_STEPS = DH // 16  # k16 steps of S = Q K^T
    O_TILES = DH // 8    # n8 tiles of O = P V
    ROWS = G * D
    assert G <= 8 and D % 16 == 0
    KW2, VW4, O_REGS, SM_W, SM_ROWS = 2 * KW, 4 * VW, 2 * O_TILES, G * MAX_SPLITS, SW * 8
    ROW_ROUNDS = -(-ROWS // NT)              # the merge's elements per thread
    ALL_ROUNDS = ROWS % NT == 0
    SM_Q, SM_KV = (G * D, 2 * D) if ROPE else (1, 1)
    # sm_o's padded layout (o_index): a row [sw, head] of D floats in chunks of CH dims, each chunk CH + 1 words,
    # the row RS words with RS = 8 (mod 32) for D >= 128
    CH = min(32, D)
    NCH = D // CH
    RS = NCH * (CH + 1) + ((8 - NCH) % 32 if CH == 32 else 0)
    SM_O = SW * G * RS

    if SIMULATOR or not min_blocks:
        jit = kernel
    else:
        jit = cuda.jit(cache=True, launch_bounds=(NT, min_blocks))

    @device_fn
    def o_index(row, d):
        """Word of ``sm_o`` holding dim ``d`` of row ``row = sw·G + head``: rows of ``RS`` words, chunks of ``CH``
        dims padded to ``CH + 1``.  The merge stores one O register per instruction from the lanes ``(g, t)`` of a
        warp, i.e. dims ``32t + c`` of head ``g`` (D = 128).  Unpadded ([SW, G, D]) those are all one bank, a 16-way
        conflict: 32 stores × 16 cycles per warp.  Padded, lane ``(g, t)`` is at bank ``8g + t + c``: 16 banks.  A warp
        reading 32 consecutive dims reads 32 banks.  (For a lane's dims ``d0 + c``, ``c`` a compile-time constant,
        the offset from ``o_index(row, d0)`` is a constant too: ``d0`` is a multiple of the lane's dim span, which
        divides ``CH`` or is a multiple of it.)

        Found with the step timeline (session 21, Qwen3-4B, context 80): 3.3 µs from a working block's last P V
        product to its end; padded, decode attention's wall per layer went 5.15 → 3.33 µs.  End to end (decode
        graphs, ``graph_sweep.py``): Qwen3.5-4B −0.15 %, Qwen3-4B −0.3 to +0.1 % -- the preloaded o's weight
        copies, not attention, bound that stretch of the step: o now waits ~3.2 µs after attention ends for its
        rows to land."""
        return row * uint32(RS) + (d // uint32(CH)) * uint32(CH + 1) + (d & uint32(CH - 1))

    @device_fn
    def role_constants(role, pos, q_norm_w, k_norm_w, cos, sin, hw, hc, hs):
        """Fused path: the norm weights and cos/sin of this lane's dims for ``role`` (a q head < G, the k head =
        G; the v head needs none)."""
        lane = cuda.threadIdx.x % 32
        for j in range(J):
            i = lane + 32 * j
            if i < D and role <= G:
                hw[j] = q_norm_w[i] if role < G else k_norm_w[i]
        for j in range(HJ):
            i = lane + 32 * j
            if i < HALF and role <= G:
                hc[j] = cos[pos, i]
                hs[j] = sin[pos, i]

    @device_fn
    def fused_heads(qkv, q_norm_w, k_norm_w, cos, sin, k16, v16, block_tables, t, slot, pos, has_newest, head0, kvh,
                    num_kv_heads, page_shift, q_head_stride, eps, weight_offset, round_before_weight, sm_q, sm_kv,
                    hx, hw, hc, hs):
        """Fused path, after the block's early K/V loads: ``qk_norm_rope_store``'s work for this block's heads.
        Role ``r`` (warp ``r mod W``, rounds of W): q head ``head0 + r`` for ``r < G`` -> ``sm_q``; with
        ``has_newest``, the k head (``r = G``) and the v head (``r = G + 1``) -> ``sm_kv`` and the cache at
        ``pos``.  When every warp has at most one role (``G + 2 <= W``: Qwen3's 4 q heads on 8 warps) its norm
        weights and cos/sin, which no kernel of the step writes, are loaded *before* the PDL wait (as
        ``qk_norm_rope_store`` does; after the wait they are HBM misses behind the o projection's copies);
        otherwise after it, with the head values.  Then waits for the projection, lets the next kernel launch
        (``RELEASE_AFTER_WAIT``, unless ``ROPE_RELEASE_LATE``), and returns the wait's ``timeline`` stamp (0 without stamps).  Ends in a
        barrier."""
        lane = cuda.threadIdx.x % 32
        warp = cuda.threadIdx.x // 32
        nq = num_kv_heads * G
        k_col0 = nq * q_head_stride
        v_col0 = k_col0 + num_kv_heads * D
        page = block_tables[slot, pos >> page_shift]
        row16 = (((page << page_shift) + (pos & ((1 << page_shift) - 1))) * num_kv_heads + kvh) * D
        if ROLE_ROUNDS == 1:
            role_constants(warp, pos, q_norm_w, k_norm_w, cos, sin, hw, hc, hs)
        grid_dependency_wait()
        t_wait = uint64(0)
        if STAMPS:
            t_wait = global_timer()
        if RELEASE_AFTER_WAIT and not ROPE_RELEASE_LATE:
            launch_dependents()
        for rr in range(ROLE_ROUNDS):                 # same trip count in every warp (simulator shuffles)
            role = rr * W + warp
            if ROLE_ROUNDS > 1:
                role_constants(role, pos, q_norm_w, k_norm_w, cos, sin, hw, hc, hs)
            is_q = role < G
            is_k = role == G and has_newest
            is_v = role == G + 1 and has_newest
            src = (head0 + role) * q_head_stride if is_q else (k_col0 if is_k else v_col0) + kvh * D
            for j in range(J):
                i = lane + 32 * j
                if (is_q or is_k or is_v) and i < D:
                    hx[j] = qkv[t, src + i]
            ss = float32(0.0)
            if is_q or is_k:
                for j in range(J):
                    if lane + 32 * j < D:
                        v = bf16_to_f32(hx[j])
                        ss += v * v
            ss = warp_sum(ss)
            if is_v:
                for j in range(J):
                    i = lane + 32 * j
                    if i < D:
                        sm_kv[D + i] = hx[j]
                        v16[row16 + i] = hx[j]
            elif is_q or is_k:
                inv_rms = head_inverse_rms(ss, D, eps)
                dst = role * D if is_q else 0
                for j in range(J):
                    p = lane + 32 * j
                    if p < HALF:
                        if SHIFT >= 0:                    # the partner dim p + half is in this lane's registers
                            hi_x = hx[min(j + SHIFT, J - 1)]
                            hi_w = hw[min(j + SHIFT, J - 1)]
                        else:
                            hi_x = qkv[t, src + p + HALF]
                            hi_w = q_norm_w[p + HALF] if is_q else k_norm_w[p + HALF]
                        out_lo, out_hi = norm_rope_pair(hx[j], hi_x, hw[j], hi_w, inv_rms, weight_offset,
                                                        round_before_weight, hc[min(j, HJ - 1)], hs[min(j, HJ - 1)])
                        if is_q:
                            sm_q[dst + p] = out_lo
                            sm_q[dst + p + HALF] = out_hi
                        else:
                            sm_kv[p] = out_lo
                            sm_kv[p + HALF] = out_hi
                            k16[row16 + p] = out_lo
                            k16[row16 + p + HALF] = out_hi
                for j in range(J):
                    i = lane + 32 * j
                    if i >= ROT and i < D:
                        n = normalize_element(bf16_to_f32(hx[j]), inv_rms, hw[j], weight_offset, round_before_weight)
                        if is_q:
                            sm_q[dst + i] = n
                        else:
                            sm_kv[i] = n
                            k16[row16 + i] = n
        cuda.syncthreads()
        return t_wait

    @device_fn
    def load_gates(gate, t, head0, utid, gv):
        """``gate_early``: gv[r] = the gate of output element ``i = tid + r·NT`` of the block's G heads (head
        ``h = i / D``: column ``(head0 + h)·2D + D + i % D`` of row t, which is ``head0·2D + D + h·D + i``)."""
        for r in range(ROW_ROUNDS):
            i = utid + uint32(r * NT)
            if ALL_ROUNDS or i < uint32(ROWS):
                h = i // uint32(D)
                gv[r] = gate[uint64(t), uint64(head0 * 2 * D + D) + h * uint32(D) + i]

    @jit
    def paged_attention_split_kernel(q32, k32, v32, block_tables, token_slots, positions, out, ws_acc, ws_m, ws_l,
                                     counters, scale_log2, num_kv_heads, page_shift, num_splits, min_chunk, gate,
                                     qkv, q_norm_w, k_norm_w, cos, sin, k16, v16, q_head_stride, eps, weight_offset,
                                     round_before_weight, stamp_buf):
        """Attention of one (token, kv head, split) per block for the ``G`` q heads of that kv head, on tensor
        cores; the last block of a (token, kv head) to finish merges the splits (no second launch).

        q32 ``[T * nq * D/2]`` uint32 (bf16 pairs of q ``[T, nq, D]``); k32, v32 the caches as flat uint32; out
        ``[T * nq * D]`` uint16; ws_acc ``[T * nq * num_splits * D]``, ws_m, ws_l ``[T * nq * num_splits]`` f32;
        counters int32, zero at rest (entry ``-1 - (t * nkv + kvh)``, counted from the end); ``scale_log2`` =
        scale * log2(e) (scores are kept in base-2 units); ``page_shift = log2(page_size)``; gate ``[T, row]`` bf16
        (``gated``: q head ``h``'s gate at columns ``h·2D + D ..``, Qwen3.5's q_proj output; else unused).

        Fused qk-norm / RoPE / KV store (``rope_rotary_dim`` > 0, decode only): q32 is not read.  ``qkv [T, row]``
        is the raw projection (q head ``h`` at column ``h·q_head_stride``, then the k heads, then the v heads, as
        ``rope.qk_norm_rope_store`` reads it), with its norm weights, cos/sin tables, ``eps``, ``weight_offset``,
        ``round_before_weight``; k16 / v16 are the caches as flat uint16.  After the PDL wait, warp w of a block
        normalises and rotates q head ``head0 + w`` into shared memory (``rope.norm_rope_pair``, the very math of
        ``qk_norm_rope_store``); in the block whose split holds the token's own key, warp G does the same for the
        k head and warp G+1 copies the v head, both into shared memory and into the cache.  The q fragments and
        the newest key's K/V then come from shared memory (never read back from the cache this kernel wrote).

        Geometry: grid-stride over ``num_splits * T * nkv`` work items (split slowest, so the splits that have work
        come first), ``32 * W`` threads.  Split ``s`` covers keys ``[s * chunk, (s+1) * chunk)`` of the token's
        ``n = positions[t] + 1`` (``_split_range``: only as many splits as the length needs do work, decided on
        the device).  Within a split, warp ``w`` takes 16-key steps ``w, w + W, ...``; one step is
        ``S[16 x 16] = Q K^T`` as two ``m16n8k16`` tiles (rows = the G q heads, zero-padded to 16; keys as columns;
        the K row a lane loads is its B fragment directly: lane (g, t) owns dims ``[t D/4, (t+1) D/4)`` of key g
        and q uses the same dim order, so no data movement), an online-softmax update, and ``O += bf16(P) V`` as
        ``D/8`` ``m16n8k16`` tiles (rows = heads, columns = head dims; lane (g, t) loads dims ``[g D/8, (g+1) D/8)``
        of keys ``2t, 2t+1, 2t+8, 2t+9`` and pairs them up into B fragments).  The block then merges its warps in
        shared memory.  If one split covers the whole token the block writes the bf16 output; otherwise it writes
        its partial ``(acc, m, l)``, and the last block to bump the (token, kv head) counter merges all partials
        into the output and resets the counter to 0 (so the launch can be replayed from a CUDA graph).
        A token with ``token_slots[t] < 0`` (padding) reads nothing and gets zeros.

        PDL (``launch``): without ``DECODE`` the kernel lets the next one launch and waits for the previous one at
        its start.  With ``DECODE`` (every token is its sequence's newest, so the previous kernel wrote only q and
        the key / value at ``positions[t]``) the block first reads what no kernel of the step writes -- slot,
        position, block table and the first pass's K/V rows of the older keys -- then waits, then reads q and the
        newest key's rows; it lets the next kernel (a weight-streaming GEMV) launch where ``release`` says: by
        default right after that wait, so the GEMV's weight copies overlap this kernel's post-wait chain.
        """
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        if not DECODE:
            pdl_prologue()
        if RELEASE_START:
            launch_dependents()
        sm_m = cuda.shared.array(SM_ROWS, float32)    # per warp and head row: running max
        sm_l = cuda.shared.array(SM_ROWS, float32)    # ... and sum
        sm_o = cuda.shared.array(SM_O, float32)      # ... and accumulator [SW, G, D] (padded: o_index)
        sm_s = cuda.shared.array(SM_S, float32)      # dim split: the pairs' partial S [2 rounds, W, 32, 4]
        sm_w = cuda.shared.array(SM_W, float32)      # merge weights [G, warps or splits]
        sm_tot = cuda.shared.array(8, float32)       # merged sum per head
        sm_last = cuda.shared.array(1, int32)
        sm_q = cuda.shared.array(SM_Q, uint16)       # fused: the G normalised + rotated q heads [G, D]
        sm_kv = cuda.shared.array(SM_KV, uint16)     # fused: the newest key's k (rotated) then v [2, D]
        hx = cuda.local.array(J, uint16)             # fused: this lane's dims of its head
        hw = cuda.local.array(J, uint16)             # ... their norm weights
        hc = cuda.local.array(HJ, uint16)            # ... cos / sin of its rotary pairs
        hs = cuda.local.array(HJ, uint16)
        qa = cuda.local.array(KW, uint32)            # q fragments (rows g < G)
        kw = cuda.local.array(KW2, uint32)           # K words of keys k0 + g, k0 + 8 + g
        vw = cuda.local.array(VW4, uint32)           # V words of keys k0 + 2t, 2t + 1, 2t + 8, 2t + 9
        of = cuda.local.array(O_REGS, float32)       # O[head g, dims 2t D/8 + jd, (2t+1) D/8 + jd]
        gv = cuda.local.array(ROW_ROUNDS, uint16)    # gate_early: the gates of the output elements this thread writes
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        half = warp % DS                  # dim split: this warp's half of the head dims (else 0)
        sw = warp // DS                   # its step warp: the warp, or the pair
        dim0 = half * HALF_WORDS          # word offset of this warp's dims within a q / K / V row
        g = lane >> 2
        tq = lane & 3
        utid, usw, ug, utq = uint32(tid), uint32(sw), uint32(g), uint32(tq)
        nq = num_kv_heads * G
        n_tokens = positions.shape[0]
        zero = uint32(0)
        fzero = float32(0.0)

        per_split = uint32(n_tokens * num_kv_heads)
        for work in range(cuda.blockIdx.x, num_splits * n_tokens * num_kv_heads, cuda.gridDim.x):
            tk = int32(uint32(work) % per_split)            # unsigned 32-bit divisions (see _split_range)
            split = int32(uint32(work) // per_split)
            t = int32(uint32(tk) // uint32(num_kv_heads))
            kvh = int32(uint32(tk) % uint32(num_kv_heads))
            head0 = kvh * G
            out0 = (t * nq + head0) * D
            slot = token_slots[t]
            if slot < 0:                                  # padding token
                grid_dependency_wait()
                if split == 0:
                    for i in range(tid, ROWS, NT):
                        out[out0 + i] = uint16(0)
                continue
            k_lo, k_hi, n_active = _split_range(positions[t] + 1, split, num_splits, min_chunk)
            if split >= n_active:
                continue

            newest = positions[t]                         # DECODE: the only key the previous kernel wrote
            if not DECODE:
                _load_words(q32, (t * nq + head0 + g) * ROW_WORDS + dim0 + tq * KW, KW, qa, 0, g < G)
                if GATE_EARLY_:
                    load_gates(gate, t, head0, utid, gv)
            for i in range(O_REGS):
                of[i] = fzero
            m = NEG_INF
            l = fzero                                     # this lane's share of its row's sum
            n_steps = (k_hi - k_lo + DECODE_STEP_KEYS - 1) // DECODE_STEP_KEYS
            for st0 in range(0, n_steps, SW):             # same trip count in every warp (barriers, simulator)
                k0 = k_lo + (st0 + sw) * DECODE_STEP_KEYS
                early = DECODE and st0 == 0                 # before the wait: not the newest key's rows
                row0 = _step_first_row(block_tables, slot, k0, k_hi, page_shift, num_kv_heads, kvh, ROW_WORDS)
                for j in range(2):
                    key = k0 + 8 * j + g
                    row = _step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh, ROW_WORDS)
                    _load_words(k32, row + dim0 + tq * KW, KW, kw, j * KW,
                                key < k_hi and not (early and key == newest))
                if not LATE_V:
                    for j in range(4):
                        key = k0 + 2 * tq + (j & 1) + 8 * (j >> 1)
                        row = _step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh,
                                        ROW_WORDS)
                        _load_words(v32, row + dim0 + g * VW, VW, vw, j * VW,
                                    key < k_hi and not (early and key == newest))
                if early and ROPE:
                    tw = fused_heads(qkv, q_norm_w, k_norm_w, cos, sin, k16, v16, block_tables, t, slot, newest,
                                k_hi > newest, head0, kvh, num_kv_heads, page_shift, q_head_stride, eps,
                                weight_offset, round_before_weight, sm_q, sm_kv, hx, hw, hc, hs)
                    if STAMPS and t_wait == uint64(0):
                        t_wait = tw
                    for i in range(KW):                   # q fragments (rows g < G) from shared memory
                        qa[i] = _smem_word(sm_q, g * D + 2 * (tq * KW + i)) if g < G else uint32(0)
                elif early:
                    grid_dependency_wait()
                    if STAMPS and t_wait == uint64(0):
                        t_wait = global_timer()
                    _load_words(q32, (t * nq + head0 + g) * ROW_WORDS + dim0 + tq * KW, KW, qa, 0, g < G)
                if early and GATE_EARLY_:                 # written by the projection before qk-norm: visible now
                    load_gates(gate, t, head0, utid, gv)
                if early and RELEASE_AFTER_WAIT and (not ROPE or ROPE_RELEASE_LATE):   # (else in fused_heads)
                    launch_dependents()
                if early or (ROPE and k0 <= newest and newest < k0 + DECODE_STEP_KEYS):
                    for j in range(2):
                        key = k0 + 8 * j + g
                        if key == newest and key < k_hi:
                            if ROPE:
                                for i in range(KW):
                                    kw[j * KW + i] = _smem_word(sm_kv, 2 * (tq * KW + i))
                            else:
                                row = _kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, ROW_WORDS)
                                _load_words(k32, row + dim0 + tq * KW, KW, kw, j * KW, True)
                    if not LATE_V:
                        for j in range(4):
                            key = k0 + 2 * tq + (j & 1) + 8 * (j >> 1)
                            if key == newest and key < k_hi:
                                if ROPE:
                                    for i in range(VW):
                                        vw[j * VW + i] = _smem_word(sm_kv, D + 2 * (g * VW + i))
                                else:
                                    row = _kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, ROW_WORDS)
                                    _load_words(v32, row + dim0 + g * VW, VW, vw, j * VW, True)

                # S = Q K^T (head g, keys k0 + 8j + 2t, +1), base-2 units, masked past k_hi
                s0 = s1 = s2 = s3 = fzero
                for ks in range(QK_STEPS):
                    s0, s1, _, _ = mma_bf16_m16n8k16(qa[2 * ks], zero, qa[2 * ks + 1], zero,
                                                     kw[2 * ks], kw[2 * ks + 1], s0, s1, fzero, fzero)
                    s2, s3, _, _ = mma_bf16_m16n8k16(qa[2 * ks], zero, qa[2 * ks + 1], zero,
                                                     kw[KW + 2 * ks], kw[KW + 2 * ks + 1], s2, s3, fzero, fzero)
                if DS == 2:         # S = the pair's two partial products, summed in the same order by both warps
                    buf = uint32((st0 // SW) % 2) * uint32(W * 128)
                    own = buf + uint32(warp * 128) + uint32(lane * 4)
                    sm_s[own] = s0
                    sm_s[own + uint32(1)] = s1
                    sm_s[own + uint32(2)] = s2
                    sm_s[own + uint32(3)] = s3
                    cuda.syncthreads()
                    lo = buf + uint32(2 * sw * 128) + uint32(lane * 4)
                    hi = lo + uint32(128)
                    s0 = sm_s[lo] + sm_s[hi]
                    s1 = sm_s[lo + uint32(1)] + sm_s[hi + uint32(1)]
                    s2 = sm_s[lo + uint32(2)] + sm_s[hi + uint32(2)]
                    s3 = sm_s[lo + uint32(3)] + sm_s[hi + uint32(3)]
                key = k0 + 2 * tq
                s0 = s0 * scale_log2 if key < k_hi else NEG_INF
                s1 = s1 * scale_log2 if key + 1 < k_hi else NEG_INF
                s2 = s2 * scale_log2 if key + 8 < k_hi else NEG_INF
                s3 = s3 * scale_log2 if key + 9 < k_hi else NEG_INF

                if LATE_V:          # K's registers are free again: fewer live registers, one more memory round trip
                    for j in range(4):
                        key = k0 + 2 * tq + (j & 1) + 8 * (j >> 1)
                        row = _step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh,
                                        ROW_WORDS)
                        if ROPE and key == newest:        # this kernel's own newest value: from shared memory
                            for i in range(VW):
                                vw[j * VW + i] = _smem_word(sm_kv, D + 2 * (g * VW + i))
                        else:
                            _load_words(v32, row + dim0 + g * VW, VW, vw, j * VW, key < k_hi)

                # online softmax over the row (the 4 lanes of a row hold its 16 keys)
                mx = max(m, lane_group_max(max(max(s0, s1), max(s2, s3)), 4))
                alpha = rescale_factor2(m, mx)
                m = mx
                base = m if m != NEG_INF else fzero
                p0 = math.exp2(s0 - base)
                p1 = math.exp2(s1 - base)
                p2 = math.exp2(s2 - base)
                p3 = math.exp2(s3 - base)
                l = l * alpha + ((p0 + p1) + (p2 + p3))
                a0 = pack_bf16x2(p0, p1)                  # P[g, keys 2t, 2t+1]: the A fragment of the P V step
                a2 = pack_bf16x2(p2, p3)                  # P[g, keys 2t+8, 2t+9]

                # O += P V: B[k = key, n = dim] with key pairs packed into one word
                for jd in range(O_TILES):
                    w = jd // 2
                    x0, x1, y0, y1 = vw[w], vw[VW + w], vw[2 * VW + w], vw[3 * VW + w]
                    if jd % 2 == 0:
                        b0 = (x0 & uint32(0xFFFF)) | (x1 << uint32(16))
                        b1 = (y0 & uint32(0xFFFF)) | (y1 << uint32(16))
                    else:
                        b0 = (x0 >> uint32(16)) | (x1 & uint32(0xFFFF0000))
                        b1 = (y0 >> uint32(16)) | (y1 & uint32(0xFFFF0000))
                    of[2 * jd], of[2 * jd + 1], _, _ = mma_bf16_m16n8k16(
                        a0, zero, a2, zero, b0, b1, of[2 * jd] * alpha, of[2 * jd + 1] * alpha, fzero, fzero)

            if RELEASE_LAST_LOAD:
                launch_dependents()                       # every K/V load of this block is done
            if STAMPS and t_ready == uint64(0) and of[0] != float32(-1.25e-38):   # (after the last P V product)
                t_ready = global_timer()
            # ---- merge the SW step warps of the block (a pair's halves hold disjoint dims of one partial)
            # (shared-memory indices are unsigned from here on: no negative-index wraparound code in the chain)
            l = lane_group_sum(l, 4)
            if g < G:
                if tq == 0 and half == 0:
                    sm_m[usw * uint32(8) + ug] = m
                    sm_l[usw * uint32(8) + ug] = l
                ob = o_index(usw * uint32(G) + ug, uint32(half * DH) + uint32(2 * O_TILES) * utq)  # this lane's dim 0
                for jd in range(O_TILES):
                    sm_o[ob + uint32((jd // CH) * (CH + 1) + jd % CH)] = of[2 * jd]
                    c = O_TILES + jd
                    sm_o[ob + uint32((c // CH) * (CH + 1) + c % CH)] = of[2 * jd + 1]
            cuda.syncthreads()
            if tid < G:
                m_blk = NEG_INF
                for w in range(SW):
                    m_blk = max(m_blk, sm_m[uint32(w * 8) + utid])
                l_blk = fzero
                for w in range(SW):
                    f = rescale_factor2(sm_m[uint32(w * 8) + utid], m_blk)
                    sm_w[utid * uint32(SW) + uint32(w)] = f
                    l_blk += f * sm_l[uint32(w * 8) + utid]
                sm_tot[utid] = l_blk
                if n_active > 1:
                    ws_m[uint64((t * nq + head0 + tid) * num_splits + split)] = m_blk
                    ws_l[uint64((t * nq + head0 + tid) * num_splits + split)] = l_blk
            cuda.syncthreads()
            for r in range(ROW_ROUNDS):             # element i of the G heads' rows: head h = i / D, dim i % D
                i = utid + uint32(r * NT)
                if ALL_ROUNDS or i < uint32(ROWS):
                    h = i // uint32(D)
                    total = fzero
                    at = o_index(h, i & uint32(D - 1))             # sm_o[w, h, i % D] at at + w·G·RS
                    for w in range(SW):
                        total += sm_w[h * uint32(SW) + uint32(w)] * sm_o[uint32(w * G * RS) + at]
                    if n_active == 1:
                        lt = sm_tot[h]
                        o = f32_to_bf16(total / lt if lt > fzero else fzero)
                        if GATE_EARLY_:
                            o = gated_value(o, gv[r])
                        elif GATED:             # q head h's gate: column (head0 + h)·2D + D + i % D
                            o = gated_value(o, gate[uint64(t), uint64(head0 * 2 * D + D) + h * uint32(D) + i])
                        out[uint64(out0) + uint64(i)] = o
                    else:
                        ws_acc[(uint64(t * nq + head0) + uint64(h)) * uint64(num_splits * D) + uint64(split * D)
                               + (i & uint32(D - 1))] = total

            # ---- several splits: the last block of this (token, kv head) merges them
            if n_active > 1:
                cuda.threadfence()                        # publish this block's partial before counting it
                cuda.syncthreads()
                if tid == 0:
                    c = counters.shape[0] - 1 - tk
                    done = cuda.atomic.add(counters, c, 1)
                    sm_last[0] = 1 if done == n_active - 1 else 0
                    if done == n_active - 1:
                        counters[c] = 0                   # reset for the next launch
                cuda.syncthreads()
                if sm_last[0] == 1:
                    cuda.threadfence()
                    for h0 in range(0, G, W):             # one warp per head
                        h = h0 + warp
                        hrow = uint64((t * nq + head0 + min(h, G - 1)) * num_splits)
                        mm = NEG_INF
                        for sp in range(lane, n_active, 32):
                            mm = max(mm, ws_m[hrow + uint64(sp)])
                        mm = lane_group_max(mm, 32)
                        ll = fzero
                        for sp in range(lane, n_active, 32):
                            f = rescale_factor2(ws_m[hrow + uint64(sp)], mm)
                            if h < G:
                                sm_w[uint32(h * MAX_SPLITS + sp)] = f
                            ll += f * ws_l[hrow + uint64(sp)]
                        ll = lane_group_sum(ll, 32)
                        if lane == 0 and h < G:
                            sm_tot[uint32(h)] = ll
                    cuda.syncthreads()
                    for r in range(ROW_ROUNDS):
                        i = utid + uint32(r * NT)
                        if ALL_ROUNDS or i < uint32(ROWS):
                            h = i // uint32(D)
                            src = (uint64(t * nq + head0) + uint64(h)) * uint64(num_splits * D) + (i & uint32(D - 1))
                            total = fzero
                            for sp in range(n_active):
                                total += sm_w[h * uint32(MAX_SPLITS) + uint32(sp)] * ws_acc[src + uint64(sp * D)]
                            o = f32_to_bf16(total / sm_tot[h])
                            if GATE_EARLY_:
                                o = gated_value(o, gv[r])
                            elif GATED:
                                o = gated_value(o, gate[uint64(t), uint64(head0 * 2 * D + D) + h * uint32(D) + i])
                            out[uint64(out0) + uint64(i)] = o
            cuda.syncthreads()                            # shared scratch is reused by the next work item
        if STAMPS and cuda.threadIdx.x == 0:
            timeline.record(stamp_buf, 5, t_entry, t_wait, t_ready if t_ready != uint64(0) else t_wait, 0)

    return paged_attention_split_kernel

# ------------------------------------------------------------------------------------------------ tiled prefill kernel
LOG2E = 1.4426950408889634


@device_fn
def _q_fragment(q32, qrow_lo, qrow_hi, word, lo_ok, hi_ok):
    """The mma A fragment (a0, a1, a2, a3) of one k16 step of Q: rows lo / hi of this lane, zeros past T."""
    zero = uint32(0)
    return (q32[qrow_lo + word] if lo_ok else zero, q32[qrow_hi + word] if hi_ok else zero,
            q32[qrow_lo + word + 4] if lo_ok else zero, q32[qrow_hi + word + 4] if hi_ok else zero)


@functools.lru_cache(maxsize=None)
def _prefill_kernel(head_dim: int, group: int, warps: int, block_keys: int, q_in_regs: bool):
    """Build the tiled (FlashAttention-2 style) kernel for one shape: ``warps`` warps of 16 query rows each, K/V
    tiles of ``block_keys`` keys, the Q fragments held in registers or re-read from global memory (L1) per tile.
    Closure constants size the register fragments and shared tiles."""
    D, G, BK, Q_IN_REGS = head_dim, group, block_keys, q_in_regs
    ROWS = 16 * warps               # query rows of a block: BQ tokens x G heads, row r = (token r // G, head r % G)
    BQ = ROWS // G
    NTHREADS = 32 * warps
    ROW_WORDS = D // 2
    CHUNKS = D // 8                 # 16-byte chunks of a K/V row
    S_TILES = BK // 8               # n8 tiles of S = Q K^T (keys)
    O_TILES = D // 8                # n8 tiles of O (head dims)
    QK_STEPS = D // 16              # k16 steps of Q K^T (head dims)
    PV_STEPS = BK // 16             # k16 steps of P V (keys)
    K_STRIDE = ROW_WORDS + 4        # words per key row of the K tile (+4: fragment loads hit 32 distinct banks)
    V_STRIDE = BK // 2 + 4          # words per head-dim row of the transposed V tile
    K_TILE_WORDS, V_TILE_WORDS = BK * K_STRIDE, D * V_STRIDE
    K_ITEMS, V_ITEMS = BK * CHUNKS, (BK // 2) * CHUNKS
    Q_REGS, S_REGS, O_REGS = 4 * QK_STEPS, 4 * S_TILES, 4 * O_TILES
    assert ROWS % G == 0 and BK % 16 == 0 and D % 16 == 0

    @kernel
    def paged_attention_prefill_kernel(q32, k32, v32, block_tables, token_slots, positions, out32, scale_log2,
                                       num_kv_heads, page_shift):
        """Causal attention of a tile of ``BQ`` consecutive query tokens x the ``G`` q heads of one kv head, on
        tensor cores (``mma.sync.m16n8k16``, bf16 in, f32 accumulate).

        q32 ``[T * nq * D/2]``, out32 ``[T * nq * D/2]`` (bf16 pairs of ``[T, nq, D]``), k32 / v32 the caches as flat
        uint32.  Geometry: grid-stride over ``ceil(T / BQ) * nkv`` work items (token tile, kv head), ``32 * warps``
        threads; warp ``w`` owns query rows ``16w .. 16w+15`` (row r = token ``t0 + r // G``, q head
        ``kvh * G + r % G``) and keeps its Q fragments, the running max / sum of its rows and the O accumulator
        ``[16, D]`` in registers.  Per K/V tile of ``BK`` keys: the block stages K ``[BK, D]`` and V transposed
        ``[D, BK]`` in shared memory (bf16 pairs, rows padded), each warp computes ``S = Q K^T * scale * log2 e``,
        masks keys past each row's position, updates the online softmax (base 2), and accumulates
        ``O += bf16(P) V``.  Tokens of different slots in one tile are handled run by run (a run = consecutive
        tokens of one slot); rows outside the current run see only masked keys.
        """
        pdl_prologue()
        k_s = cuda.shared.array(K_TILE_WORDS, uint32)
        vt_s = cuda.shared.array(V_TILE_WORDS, uint32)
        qf = cuda.local.array(Q_REGS, uint32)
        sf = cuda.local.array(S_REGS, float32)
        of = cuda.local.array(O_REGS, float32)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane >> 2
        tq = lane & 3
        nq = num_kv_heads * G
        n_tokens = positions.shape[0]
        page_mask = (1 << page_shift) - 1
        row_lo = warp * 16 + g          # this lane's two rows: row_lo and row_lo + 8
        # shared-memory indices are unsigned so that numba emits no negative-index wraparound: the fragment loads
        # then become one base register + constant offsets
        k_lane = uint64(g * K_STRIDE + tq)
        v_lane = uint64(g * V_STRIDE + tq)
        n_work = (n_tokens + BQ - 1) // BQ * num_kv_heads

        for work in range(cuda.blockIdx.x, n_work, cuda.gridDim.x):
            kvh = work % num_kv_heads
            t0 = (work // num_kv_heads) * BQ
            t_end = min(t0 + BQ, n_tokens)
            tok_lo = t0 + row_lo // G
            tok_hi = t0 + (row_lo + 8) // G
            qrow_lo = (tok_lo * nq + kvh * G + row_lo % G) * ROW_WORDS
            qrow_hi = (tok_hi * nq + kvh * G + (row_lo + 8) % G) * ROW_WORDS
            q_lo_ok = tok_lo < n_tokens
            q_hi_ok = tok_hi < n_tokens
            if Q_IN_REGS:
                for ks in range(QK_STEPS):
                    qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3] = _q_fragment(
                        q32, qrow_lo, qrow_hi, ks * 8 + tq, q_lo_ok, q_hi_ok)
            for i in range(O_REGS):
                of[i] = float32(0.0)
            m_lo = NEG_INF
            m_hi = NEG_INF
            l_lo = float32(0.0)      # this lane's share of the row sums (summed over the 4 lanes at the end)
            l_hi = float32(0.0)

            run_start = t0
            while run_start < t_end:
                slot = token_slots[run_start]
                max_pos = positions[run_start]
                min_pos = max_pos
                run_end = run_start + 1
                while run_end < t_end and token_slots[run_end] == slot:
                    max_pos = max(max_pos, positions[run_end])
                    min_pos = min(min_pos, positions[run_end])
                    run_end += 1
                pos_lo = positions[tok_lo] if run_start <= tok_lo and tok_lo < run_end else -1
                pos_hi = positions[tok_hi] if run_start <= tok_hi and tok_hi < run_end else -1
                whole_tile = run_start == t0 and run_end == t0 + BQ   # every row of the block is in this run

                n_key_tiles = (max_pos + BK) // BK if slot >= 0 else 0     # padding tokens (slot < 0) read nothing
                for kt in range(n_key_tiles):
                    k0 = kt * BK
                    cuda.syncthreads()       # the previous tile's readers are done with k_s / vt_s
                    for it in range(tid, K_ITEMS, NTHREADS):
                        key = it // CHUNKS
                        c = it % CHUNKS
                        kp = k0 + key
                        w0 = w1 = w2 = w3 = uint32(0)
                        if kp <= max_pos:
                            page = block_tables[slot, kp >> page_shift]
                            src = (((page << page_shift) + (kp & page_mask)) * num_kv_heads + kvh) * ROW_WORDS
                            w0, w1, w2, w3 = load_u32x4(k32, src + c * 4)
                        dst = uint64(key * K_STRIDE + c * 4)
                        k_s[dst] = w0
                        k_s[dst + uint64(1)] = w1
                        k_s[dst + uint64(2)] = w2
                        k_s[dst + uint64(3)] = w3
                    for it in range(tid, V_ITEMS, NTHREADS):
                        pair = it % (BK // 2)    # keys k0 + 2 pair, k0 + 2 pair + 1 share one word of a V^T row
                        c = it // (BK // 2)
                        kp = k0 + 2 * pair
                        x0 = x1 = x2 = x3 = uint32(0)
                        y0 = y1 = y2 = y3 = uint32(0)
                        if kp <= max_pos:
                            page = block_tables[slot, kp >> page_shift]
                            src = (((page << page_shift) + (kp & page_mask)) * num_kv_heads + kvh) * ROW_WORDS
                            x0, x1, x2, x3 = load_u32x4(v32, src + c * 4)
                        if kp + 1 <= max_pos:
                            page = block_tables[slot, (kp + 1) >> page_shift]
                            src = (((page << page_shift) + ((kp + 1) & page_mask)) * num_kv_heads + kvh) * ROW_WORDS
                            y0, y1, y2, y3 = load_u32x4(v32, src + c * 4)
                        d0 = uint64(8 * c * V_STRIDE + pair)     # V^T row of head dim 8c, then 8c+1, ...
                        vt_s[d0] = (x0 & uint32(0xFFFF)) | (y0 << uint32(16))
                        vt_s[d0 + uint64(1 * V_STRIDE)] = (x0 >> uint32(16)) | (y0 & uint32(0xFFFF0000))
                        vt_s[d0 + uint64(2 * V_STRIDE)] = (x1 & uint32(0xFFFF)) | (y1 << uint32(16))
                        vt_s[d0 + uint64(3 * V_STRIDE)] = (x1 >> uint32(16)) | (y1 & uint32(0xFFFF0000))
                        vt_s[d0 + uint64(4 * V_STRIDE)] = (x2 & uint32(0xFFFF)) | (y2 << uint32(16))
                        vt_s[d0 + uint64(5 * V_STRIDE)] = (x2 >> uint32(16)) | (y2 & uint32(0xFFFF0000))
                        vt_s[d0 + uint64(6 * V_STRIDE)] = (x3 & uint32(0xFFFF)) | (y3 << uint32(16))
                        vt_s[d0 + uint64(7 * V_STRIDE)] = (x3 >> uint32(16)) | (y3 & uint32(0xFFFF0000))
                    cuda.syncthreads()

                    # S = Q K^T, in log2 units
                    for j in range(S_TILES):
                        s0 = s1 = s2 = s3 = float32(0.0)
                        for ks in range(QK_STEPS):
                            if Q_IN_REGS:
                                a0, a1, a2, a3 = qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3]
                            else:
                                a0, a1, a2, a3 = _q_fragment(q32, qrow_lo, qrow_hi, ks * 8 + tq, q_lo_ok, q_hi_ok)
                            kb = k_lane + uint64(j * 8 * K_STRIDE + ks * 8)
                            s0, s1, s2, s3 = mma_bf16_m16n8k16(a0, a1, a2, a3, k_s[kb], k_s[kb + uint64(4)],
                                                               s0, s1, s2, s3)
                        sf[4 * j] = s0 * scale_log2
                        sf[4 * j + 1] = s1 * scale_log2
                        sf[4 * j + 2] = s2 * scale_log2
                        sf[4 * j + 3] = s3 * scale_log2
                    if not (whole_tile and k0 + BK - 1 <= min_pos):    # causal / run mask needed in this tile
                        for j in range(S_TILES):
                            key = k0 + j * 8 + 2 * tq
                            if key > pos_lo:
                                sf[4 * j] = NEG_INF
                            if key + 1 > pos_lo:
                                sf[4 * j + 1] = NEG_INF
                            if key > pos_hi:
                                sf[4 * j + 2] = NEG_INF
                            if key + 1 > pos_hi:
                                sf[4 * j + 3] = NEG_INF

                    # online softmax: new row max (over the 4 lanes of a row), rescale, probabilities
                    mx_lo = NEG_INF
                    mx_hi = NEG_INF
                    for j in range(S_TILES):
                        mx_lo = max(mx_lo, max(sf[4 * j], sf[4 * j + 1]))
                        mx_hi = max(mx_hi, max(sf[4 * j + 2], sf[4 * j + 3]))
                    mx_lo = max(m_lo, lane_group_max(mx_lo, 4))
                    mx_hi = max(m_hi, lane_group_max(mx_hi, 4))
                    alpha_lo = rescale_factor2(m_lo, mx_lo)
                    alpha_hi = rescale_factor2(m_hi, mx_hi)
                    m_lo = mx_lo
                    m_hi = mx_hi
                    l_lo *= alpha_lo
                    l_hi *= alpha_hi
                    for jd in range(O_TILES):
                        of[4 * jd] *= alpha_lo
                        of[4 * jd + 1] *= alpha_lo
                        of[4 * jd + 2] *= alpha_hi
                        of[4 * jd + 3] *= alpha_hi
                    base_lo = m_lo if m_lo != NEG_INF else float32(0.0)    # a finite base: masked scores -> 2^-inf = 0
                    base_hi = m_hi if m_hi != NEG_INF else float32(0.0)
                    for j in range(S_TILES):
                        sf[4 * j] = math.exp2(sf[4 * j] - base_lo)
                        sf[4 * j + 1] = math.exp2(sf[4 * j + 1] - base_lo)
                        sf[4 * j + 2] = math.exp2(sf[4 * j + 2] - base_hi)
                        sf[4 * j + 3] = math.exp2(sf[4 * j + 3] - base_hi)
                        l_lo += sf[4 * j] + sf[4 * j + 1]
                        l_hi += sf[4 * j + 2] + sf[4 * j + 3]

                    # O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk
                    for kk in range(PV_STEPS):
                        a0 = pack_bf16x2(sf[8 * kk], sf[8 * kk + 1])
                        a1 = pack_bf16x2(sf[8 * kk + 2], sf[8 * kk + 3])
                        a2 = pack_bf16x2(sf[8 * kk + 4], sf[8 * kk + 5])
                        a3 = pack_bf16x2(sf[8 * kk + 6], sf[8 * kk + 7])
                        for jd in range(O_TILES):
                            vb = v_lane + uint64(jd * 8 * V_STRIDE + kk * 8)
                            o0, o1, o2, o3 = mma_bf16_m16n8k16(a0, a1, a2, a3, vt_s[vb], vt_s[vb + uint64(4)],
                                                               of[4 * jd], of[4 * jd + 1], of[4 * jd + 2],
                                                               of[4 * jd + 3])
                            of[4 * jd] = o0
                            of[4 * jd + 1] = o1
                            of[4 * jd + 2] = o2
                            of[4 * jd + 3] = o3
                run_start = run_end

            l_lo = lane_group_sum(l_lo, 4)
            l_hi = lane_group_sum(l_hi, 4)
            inv_lo = float32(1.0) / l_lo if l_lo > float32(0.0) else float32(0.0)
            inv_hi = float32(1.0) / l_hi if l_hi > float32(0.0) else float32(0.0)
            for jd in range(O_TILES):
                word = jd * 4 + tq
                if tok_lo < n_tokens:
                    out32[qrow_lo + word] = pack_bf16x2(of[4 * jd] * inv_lo, of[4 * jd + 1] * inv_lo)
                if tok_hi < n_tokens:
                    out32[qrow_hi + word] = pack_bf16x2(of[4 * jd + 2] * inv_hi, of[4 * jd + 3] * inv_hi)

    return paged_attention_prefill_kernel


# ------------------------------------------------------------------------------------------------ host side
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _min_chunk(min_split_tokens: int | None = None, head_dim: int = 128) -> int:
    """Fewest keys a split covers: the forced value, else ``MIN_SPLIT_TOKENS`` (``MIN_SPLIT_TOKENS_WIDE`` for heads
    wider than 128 dims); at least one key.

    Why two values (H200, decode attention alone, Qwen3.5's 16 q / 4 kv heads of 256 dims, dim-split kernel,
    ``benchmarks/RESULTS.md`` session 14): a (token, kv head) of a 256-dim head is only 4 blocks per token, and one
    block covers 64 keys per round, so long contexts want more blocks: 18.7 µs at 512 keys with 256-key splits,
    12.3 with 64-key ones (11.8 / 11.4 at 144 keys, 6.7 / 6.7 at 16; 32-key splits: 13.6 at 512).  End to end at
    contexts 16-80 the two were equal (2.563 / 2.566 ms).  For 128-dim heads 256 was measured best (session 5).
    Session 19 (Qwen3.5-4B decode graph, ``benchmarks/graph_sweep.py``): 128-key splits −0.18 % at context 80 (one
    split of two rounds instead of two merged) but +1.49 % at 144; 12-warp pairs with 96-key splits +0.07 % / +1.12 %;
    a merge loading every partial at once (one L2 round trip instead of three; ptxas: 255 registers and spills)
    +0.6 % at both.  The step costs the same at contexts 80 and 144 (2.4844 / 2.4843 ms)."""
    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_TOKENS_WIDE if head_dim > 128 else MIN_SPLIT_TOKENS
    return max(1, min_split_tokens)


def attention_num_splits(num_tokens: int, nq: int, max_model_len: int, page_size: int = 16,
                         head_dim: int = 128) -> int:
    """Splits per (token, kv head) the split-K launch provides: enough (token, head, split) rows to fill the GPU
    (``SPLIT_TARGET_ROWS``), but no more than one ``_min_chunk(head_dim=)``-key split per ``max_model_len``.  Depends
    only on shapes fixed before CUDA-graph capture; how many of them do work is decided on the device from each
    token's length (``_split_range``), so short contexts use few blocks.  (``page_size`` is accepted for
    compatibility.)"""
    max_splits = max(1, _ceil_div(max_model_len, _min_chunk(head_dim=head_dim)))
    want = _ceil_div(SPLIT_TARGET_ROWS, max(1, num_tokens * nq))
    return max(1, min(want, max_splits, MAX_SPLITS))


def _workspace_parts(num_tokens: int, nq: int, head_dim: int, num_splits: int) -> tuple[int, int]:
    """(acc elements, m elements) of the workspace for one launch; l follows m."""
    if num_splits <= 1:
        return 0, 0
    rows = num_tokens * nq * num_splits
    return rows * head_dim, rows


def attention_workspace_size(max_tokens: int, nq: int, head_dim: int, max_model_len: int, page_size: int,
                             num_splits: int | None = None) -> int:
    """f32 elements of the workspace ``paged_attention`` needs for any ``T <= max_tokens`` (``num_splits``: the
    forced value if the caller forces one): the split partials at the front, and at the very end ``max_tokens * nq``
    int32 counters (zeroed by ``paged_attention`` the first time it sees the workspace, then kept at zero by the
    kernel)."""
    need = 0
    for t in range(1, max_tokens + 1):
        s = num_splits if num_splits is not None else attention_num_splits(t, nq, max_model_len, page_size, head_dim)
        a, mm = _workspace_parts(t, nq, head_dim, s)
        need = max(need, a + 2 * mm)
    return need + max_tokens * nq


@kernel
def _fill_i32_kernel(a, value):
    """``a[:] = value`` (int32), grid-stride."""
    pdl_prologue()
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        a[i] = value


_zeroed_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _split_counters(workspace, count: int):
    """The int32 view of ``workspace`` whose last ``count`` entries are the split-merge counters; zeroes them the
    first time this workspace object is seen (or when a call needs more of them).  The kernel leaves them at zero,
    so afterwards nothing is launched here (and nothing is captured into a CUDA graph)."""
    ws32 = _flat(workspace).view(np.int32)
    try:
        done = _zeroed_counters.get(workspace, 0)
    except TypeError:   # not weak-referenceable: zero every time (correct, one extra launch)
        done = 0
    if done < count:
        tail = ws32[ws32.shape[0] - count:]
        launch(_fill_i32_kernel, grid(count, 256, sim_cap=4), threads(gpu=256, sim=32), tail, np.int32(0),
               name="attention_zero_counters", pdl=True)
        try:
            _zeroed_counters[workspace] = count
        except TypeError:
            pass
    return ws32


def _flat_u32(a):
    return a.view(np.uint32).reshape(-1)


def _flat(a):
    return a.reshape(-1)


FUSED_DECODE_ROPE = os.environ.get("PEGAINFER_DECODE_ROPE", "separate") == "fused"
"""Decode steps of the Qwen3 models: qk-norm + RoPE + KV store as ``rope.qk_norm_rope_store`` before attention
(the default) or inside the attention launch (``PEGAINFER_DECODE_ROPE=fused``, ``paged_attention(rope=)``).
Measured on the H200 (session 5): fused Qwen3-4B 2.835 / 2.837 ms vs separate 2.804 ms TPOT, Qwen3-8B 4.664 vs
4.680 ms; the fused kernel's wall time per layer (12.9 µs) exceeds the two launches' (4.8 + 6.8 µs): at D = 128
it needs 255 registers and spills 80 bytes (sm_90), and its norm phase sits on the post-wait critical path.
Session 21 (decode graph, ``graph_sweep.py``, Qwen3-4B, context 80), with the norm weights and cos/sin read before
the wait and o released right after it (250 registers, no spills): +5.6 / +5.7 %.  The step timeline shows why: the
fused kernel releases o at its wait, so o's 21 MB of copies stream while its norm phase does its dependent loads
(wait to the first block's last P V product 3.3 µs, against 0.8 µs for the separate attention after qk-norm)."""


FUSED_DECODE_ROPE_RELEASE = "after_wait"
"""Where the fused qk-norm/RoPE + attention launch (``FUSED_DECODE_ROPE``) lets o launch: right ``after_wait`` (as the
separate attention does), or ``after_norm``, once its norm / RoPE phase -- the dependent loads of the raw
projection -- is done.  Session 21's timeline showed the fused kernel's norm phase slowed by o's 21 MB of copies
streaming beside it (wait to the first P V products 3.3 µs, 0.8 µs in the separate attention): ``after_norm`` keeps
them apart as the separate kernels do, while saving qk-norm's launch and its q / K / V round trip through L2.
Measured in session 22 (decode graph, Qwen3-4B, context 80): the fused launch with ``after_norm`` +2.67 % against
the separate kernels (``after_wait`` was +5.6 % in session 21, on another machine).  (A static audit of the sm_90
build, session 21, also found the fused path's q-fragment reads from ``sm_q`` 8-way bank-conflicted -- word
``64g + 16t + i`` over a warp's 16 lanes, ~0.9 µs a block -- padding its rows in chunks of ``KW + 1`` words fixed
that but cost 4 registers and 32 bytes of spills at 254: not applied.)"""


@dataclass(frozen=True)
class DecodeRope:
    """What ``paged_attention(..., decode=True, rope=)`` needs to do ``rope.qk_norm_rope_store``'s work itself: the
    raw projection ``qkv [T, row]``, the q/k norm weights ``[D]``, the cos/sin tables, and the same knobs as
    ``qk_norm_rope_store`` (Qwen3: defaults; Qwen3.5: ``q_head_stride=2·D``, ``weight_offset=1``,
    ``round_before_weight=False``)."""
    qkv: object
    q_norm_w: object
    k_norm_w: object
    cos: object
    sin: object
    eps: float
    rotary_dim: int
    q_head_stride: int
    weight_offset: float = 0.0
    round_before_weight: bool = True


def paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace, *,
                    num_splits: int | None = None, min_split_tokens: int | None = None,
                    method: str = "auto", decode: bool = False, gate=None, rope: DecodeRope | None = None, policy=None) -> None:
    """``out[t, h] = bf16(softmax(scale * q[t, h] . K_slot^T) V_slot)`` over keys ``0 .. positions[t]`` of slot
    ``token_slots[t]`` (see the module docstring).

    q, out ``[T, nq, D]`` uint16; k_cache, v_cache ``[num_pages, page_size, nkv, D]`` uint16; block_tables
    ``[num_slots, max_pages]``, token_slots ``[T]``, positions ``[T]`` int32; workspace: f32 device array of at least
    ``attention_workspace_size(...)`` elements (may be None when the split-K path uses one split).
    ``num_splits`` / ``min_split_tokens`` force the split-K policy (tests); ``method``: "auto", "split" or "prefill".
    ``decode``: every token is its sequence's newest (a decode step), so of the cache only the key / value at
    ``positions[t]`` was written by the kernel before; the split-K kernel then reads the older ones before its PDL
    wait (``_split_kernel``).  Wrong when a token's earlier positions were stored in the same step (a prompt chunk).
    ``gate``: Qwen3.5's q_proj output ``[T, row]`` (``row ≥ 2·nq·D``): the output is then
    ``gating.sigmoid_gate_mul``'s ``bf16(attn · bf16(sigmoid(gate)))``, applied by the split-K kernel as it writes
    (the tiled prefill kernel is followed by ``sigmoid_gate_mul``).
    ``rope`` (``decode`` only): q, k, v come raw from ``rope.qkv``; the kernel normalises and rotates them and
    stores the new key / value in the cache itself (``qk_norm_rope_store`` is then not launched; ``q`` only gives
    the shapes).
    """
    T, nq, D = q.shape
    num_pages, page_size, nkv, Dk = k_cache.shape
    if q.dtype != np.uint16 or out.dtype != np.uint16 or k_cache.dtype != np.uint16 or v_cache.dtype != np.uint16:
        raise TypeError("q, out, k_cache and v_cache must be uint16 (bf16 bits)")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or Dk != D or tuple(out.shape) != (T, nq, D):
        raise ValueError(f"shape mismatch: q {q.shape}, out {out.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two")
    if nq % nkv:
        raise ValueError(f"nq={nq} is not a multiple of nkv={nkv}")
    for name, a, n in (("token_slots", token_slots, T), ("positions", positions, T)):
        if a.dtype != np.int32 or a.shape != (n,):
            raise ValueError(f"{name} must be int32 [{n}], got {a.dtype} {a.shape}")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2:
        raise ValueError("block_tables must be int32 [num_slots, max_pages]")
    if method not in ("auto", "split", "prefill"):
        raise ValueError(f"unknown method {method!r}")
    for name, a in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not a.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous")
    group = nq // nkv
    if method == "auto":
        method = "prefill" if T >= PREFILL_MIN_TOKENS and _prefill_supported(group) else "split"
    if gate is not None and (gate.dtype != np.uint16 or gate.ndim != 2 or gate.shape[0] != T
                             or gate.shape[1] < 2 * nq * D):
        raise ValueError(f"gate must be uint16 [{T}, >= {2 * nq * D}], got {gate.dtype} {gate.shape}")
    if rope is not None:
        if not decode or method == "prefill":
            raise ValueError("rope= is for decode steps on the split-K path (decode=True)")
        _check_rope(rope, T, nq, nkv, D)
    if method == "prefill":
        _paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale,
                                 T, nkv, D, group, page_size)
        if gate is not None:
            sigmoid_gate_mul(out, gate, out)
    else:
        _paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace,
                               T, nq, nkv, D, group, page_size, num_splits, min_split_tokens, decode=decode,
                               gate=gate, rope=rope)


def _check_rope(rope: DecodeRope, T: int, nq: int, nkv: int, D: int) -> None:
    for name in ("qkv", "q_norm_w", "k_norm_w", "cos", "sin"):
        if getattr(rope, name).dtype != np.uint16:
            raise TypeError(f"rope.{name} must be uint16 (bf16 bits)")
    if rope.qkv.ndim != 2 or rope.qkv.shape[0] != T or rope.q_head_stride < D or \
            rope.qkv.shape[1] != nq * rope.q_head_stride + 2 * nkv * D:
        raise ValueError(f"rope.qkv {rope.qkv.shape} is not [{T}, {nq}·{rope.q_head_stride} + 2·{nkv}·{D}]")
    if rope.q_norm_w.shape != (D,) or rope.k_norm_w.shape != (D,):
        raise ValueError(f"rope norm weights must be [{D}]")
    if not (0 < rope.rotary_dim <= D and rope.rotary_dim % 2 == 0) or rope.cos.ndim != 2 or \
            rope.cos.shape[1] != rope.rotary_dim // 2 or rope.sin.shape != rope.cos.shape:
        raise ValueError(f"rotary_dim {rope.rotary_dim} / cos {rope.cos.shape} / sin {rope.sin.shape} do not fit")


def _prefill_geometry(head_dim: int) -> tuple[int, int, bool]:
    """(warps, keys per K/V tile, Q fragments in registers) of the tiled prefill kernel: 64 query rows and 64-key
    tiles (32 for D = 256, to stay within 48 KB of static shared memory); for D = 256 the O accumulator alone takes
    128 registers per lane, so Q is re-read from global memory (L1) instead of held.  One warp and 16-key tiles in
    the simulator."""
    q_in_regs = head_dim <= 128
    if SIMULATOR:
        return 1, 16, q_in_regs
    return 4, (64 if head_dim <= 128 else 32), q_in_regs


def _prefill_supported(group: int) -> bool:
    warps, _, _ = _prefill_geometry(128)
    return (16 * warps) % group == 0


def _paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale,
                             T, nkv, D, group, page_size, geometry=None):
    warps, block_keys, q_in_regs = geometry or _prefill_geometry(D)
    if (16 * warps) % group:
        raise ValueError(f"the tiled prefill kernel needs nq/nkv = {group} to divide {16 * warps}")
    rows_tokens = 16 * warps // group
    kern = _prefill_kernel(D, group, warps, block_keys, q_in_regs)
    launch(kern, grid(_ceil_div(T, rows_tokens) * nkv, sim_cap=64), 32 * warps,
           _flat_u32(q), _flat_u32(k_cache), _flat_u32(v_cache), block_tables, token_slots, positions,
           _flat_u32(out), np.float32(scale * LOG2E), np.int32(nkv), np.int32(page_size.bit_length() - 1),
           name="paged_attention_prefill", pdl=True)


DIM_SPLIT_WIDE_HEADS = True
"""Heads wider than 128 dims (Qwen3.5's 256) take the dim-split kernel on the GPU (``_split_kernel(dim_split=)``):
warp pairs, each warp holding half of every q / K / V row, so a warp's registers and chains are those of a 128-dim
head (no spills, V loaded with K), at the price of one exchange of partial S per 16-key step.  Measured on the H200
(session 14, Qwen3.5-4B, ``benchmarks/ab_bench.py`` alternating in one call): TPOT 2.548 ms with the pairs against
2.577 with one warp per 16-key step (−1.1 %)."""
DIM_SPLIT_WARPS = 8
"""Warps per block of the dim-split kernel (4 pairs: 64 keys per round).  12 (6 pairs, 96 keys per round) is
compiled with launch bounds for one block per SM (at most 170 registers).  4 warps (2 pairs) measured +0.95 %
Qwen3.5-4B TPOT on the H200 at contexts 16-80 (session 16, two alternating rounds)."""


DECODE_RELEASES = ("start", "after_wait", "last_load")
DECODE_RELEASE = "after_wait"
"""Where a block of the decode attention lets the next kernel (the preloaded o / out_proj GEMV, whose blocks then
issue their weight copies) launch: at its ``start``, right ``after_wait`` (once the kernel before it is done: the
default), or after its ``last_load`` of K / V.  Session 11 measured the start slower (Qwen3-4B 2.725–2.745 vs
2.689–2.711 ms) and after the wait equal to the last load.  Re-measured once qk-norm/RoPE launched early (session 19,
``benchmarks/graph_sweep.py``, decode graphs at context 48, one call): after the wait −0.21 % (Qwen3.5-4B) and
−0.96 % (Qwen3-4B) against the last load; the start +0.24 % / +2.95 %.  Session 22, once the split-K merge was
1.8 µs shorter (context 80): the start +1.57 % (Qwen3-4B), −0.09 % (Qwen3.5-4B); its timeline put attention's end
3.8 µs later (o's copies slowing its loads) and o's end 3.2 µs earlier."""

GATE_EARLY = True
"""Whether the gated (Qwen3.5) split-K kernel loads its output elements' gates right after its PDL wait, into
registers (``_split_kernel(gate_early=)``), rather than each as a dependent load after the merge.  Measured on the
H200 (session 18, ``benchmarks/graph_sweep.py``, Qwen3.5-4B decode graph at context 48): −0.22 %."""


def _split_geometry(head_dim: int, group: int) -> tuple[int, bool, int, bool]:
    """(warps per block, load V after S, launch-bounds blocks per SM, dim split) of the split-K kernel: 8 warps
    (one 16-key step each per 128 keys), one in the simulator; for D = 256 the dim-split pairs
    (``DIM_SPLIT_WIDE_HEADS``), or else V loaded after S (K's and V's fragments of a whole 256-dim row together
    would need more than 255 registers).  With ``MIN_SPLIT_TOKENS`` = 256 a decode step of 128-dim heads up to 256
    keys is one split, merged in shared memory only (no partials through the workspace): measured on the H200
    (Qwen3-4B, context 16-144) against 4 warps and 64-key splits, TPOT 3.09 -> 2.94 ms.  Wider heads split every
    ``MIN_SPLIT_TOKENS_WIDE`` keys (``_min_chunk``).  ``benchmarks/bench_attention.py --sweep`` times the
    alternatives."""
    if head_dim > 128 and DIM_SPLIT_WIDE_HEADS and not SIMULATOR:
        return DIM_SPLIT_WARPS, False, 1 if DIM_SPLIT_WARPS > 8 else 0, True
    return threads(gpu=8, sim=1), head_dim > 128, 0, False


def _paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace,
                           T, nq, nkv, D, group, page_size, num_splits, min_split_tokens, geometry=None,
                           decode=False, gate=None, rope=None):
    if group > 8:
        raise ValueError(f"the split-K kernel serves at most 8 q heads per kv head, got {group}")
    capacity = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = attention_num_splits(T, nq, capacity, page_size, D)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} outside 1..{MAX_SPLITS}")
    n_acc, n_m = _workspace_parts(T, nq, D, num_splits)
    if num_splits > 1:
        need = n_acc + 2 * n_m + T * nq
        if workspace is None or workspace.dtype != np.float32 or workspace.size < need:
            raise ValueError(f"workspace must be f32 with >= {need} elements "
                             f"(attention_workspace_size); got {None if workspace is None else workspace.size}")
        ws = _flat(workspace)
        ws_acc, ws_m, ws_l = ws[:n_acc], ws[n_acc:n_acc + n_m], ws[n_acc + n_m:n_acc + 2 * n_m]
        counters = _split_counters(workspace, T * nkv)
    else:  # one split: the kernel never touches the workspace or the counters
        ws_acc = ws_m = ws_l = _flat(workspace) if workspace is not None else _dummy_f32()
        counters = ws_acc.view(np.int32)
    warps, late_v, min_blocks, *dim_split = geometry or _split_geometry(D, group)
    dim_split = bool(dim_split and dim_split[0])
    if dim_split and rope is not None:   # the fused qk-norm / RoPE path exists for whole-row warps only
        warps, late_v, min_blocks, dim_split = threads(gpu=8, sim=1), D > 128, 0, False
    assert FUSED_DECODE_ROPE_RELEASE in ("after_wait", "after_norm"), FUSED_DECODE_ROPE_RELEASE
    kern = _split_kernel(D, group, warps, late_v, min_blocks, decode, gate is not None,
                         rope.rotary_dim if rope is not None else 0, dim_split, GATE_EARLY, DECODE_RELEASE,
                         timeline.ENABLED, rope is not None and FUSED_DECODE_ROPE_RELEASE == "after_norm")
    q2 = q.reshape(T, nq * D)
    r = rope or DecodeRope(q2, out.reshape(-1)[:D], out.reshape(-1)[:D], q2, q2, 0.0, 2, D)   # unused stand-ins
    launch(kern, grid(num_splits * T * nkv, sim_cap=64), 32 * warps,
           _flat_u32(q), _flat_u32(k_cache), _flat_u32(v_cache), block_tables, token_slots, positions,
           _flat(out), ws_acc, ws_m, ws_l, counters, np.float32(scale * LOG2E), np.int32(nkv),
           np.int32(page_size.bit_length() - 1), np.int32(num_splits), np.int32(_min_chunk(min_split_tokens, D)),
           gate if gate is not None else q2, r.qkv, r.q_norm_w, r.k_norm_w, r.cos, r.sin, _flat(k_cache),
           _flat(v_cache), np.int32(r.q_head_stride), np.float32(r.eps), np.float32(r.weight_offset),
           bool(r.round_before_weight), timeline.stamps_arg(),
           name="paged_decode_attention" if decode else "paged_attention_split", pdl=True)


@functools.lru_cache(maxsize=None)
def _dummy_f32():
    """A 1-element device array standing in for an absent workspace (allocated once, on the first such call: pass a
    workspace when capturing a CUDA graph)."""
    return cuda.device_array(1, dtype=np.float32)
