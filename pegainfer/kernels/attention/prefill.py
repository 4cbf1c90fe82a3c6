"""Tiled prefill attention (FlashAttention-2 style) on tensor cores: prompt chunks of ``PREFILL_MIN_TOKENS`` tokens
and more.

Math (``__init__``'s docstring): ``out[t, h] = bf16(softmax(scale · q K^T) V)`` over keys ``0 .. positions[t]`` of
the token's slot.  Rounding as the split-K kernel's: scores and sums in f32, the probabilities rounded to bf16 for
``P V``, the output rounded to bf16 once (``acc · (1 / l)``).  Qwen3.5's gate is applied after, by
``gating.sigmoid_gate_mul``.

Work: one block per (tile of ``BQ`` consecutive query tokens, kv head), grid-stride.  The tile's ``BQ·G`` query rows
(G = nq / nkv heads per token) share every K/V tile the block stages in shared memory; warp ``w`` owns rows ``16w ..
16w+15`` and keeps their Q fragments (or re-reads them: ``geometry.prefill_geometry``), running max / sum and the O
accumulator ``[16, D]`` in registers.  Launch: ``ceil(T / BQ) · nkv`` blocks of ``32 · warps`` threads (4 warps,
64 query rows; ``BK`` = 64 keys, 32 for D = 256; one warp and 16-key tiles in the simulator).  Per K/V tile of
``BK`` keys:

1. **stage**: K ``[BK, D]`` and V transposed ``[D, BK]`` into shared memory (bf16 pairs, rows padded so the fragment
   loads hit 32 distinct banks);
2. **scores**: ``S = Q K^T · scale · log2 e`` as ``mma.sync.m16n8k16`` (bf16 in, f32 accumulate), keys past each
   row's position masked;
3. **online softmax** in the accumulator registers (base 2);
4. **P V**: ``O += bf16(P) V`` -- the S accumulators of two n8 tiles are exactly the A fragment of one k16 step.

Tokens of different slots in one tile are handled run by run (a run = consecutive tokens of one slot); rows
outside the current run see only masked keys.  Padding tokens (``token_slots[t] < 0``) read nothing and get zeros.
In the simulator the warp-wide mma is emulated (``primitives.mma_bf16_m16n8k16``), so the same kernel is tested
there.  PDL: the kernel lets the next launch start and waits at its start (``pdl_prologue``).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from pegainfer.kernels.attention.geometry import PrefillGeometry, ceil_div, prefill_geometry
from pegainfer.kernels.attention.merge import LOG2E, NEG_INF, rescale_factor2
from pegainfer.kernels.attention.workspace import flat_u32
from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (cuda, device_fn, float32, grid, kernel, lane_group_max, lane_group_sum,
                                          load_u32x4, mma_bf16_m16n8k16, pack_bf16x2, pdl_prologue, uint32)

uint64 = np.uint64


@device_fn
def q_fragment(q32, qrow_lo, qrow_hi, word, lo_ok, hi_ok):
    """The mma A fragment (a0, a1, a2, a3) of one k16 step of Q: rows lo / hi of this lane, zeros past T."""
    zero = uint32(0)
    return (q32[qrow_lo + word] if lo_ok else zero, q32[qrow_hi + word] if hi_ok else zero,
            q32[qrow_lo + word + 4] if lo_ok else zero, q32[qrow_hi + word + 4] if hi_ok else zero)


@functools.lru_cache(maxsize=None)
def prefill_kernel(head_dim: int, group: int, warps: int, block_keys: int, q_in_regs: bool):
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
                    qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3] = q_fragment(
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
                                a0, a1, a2, a3 = q_fragment(q32, qrow_lo, qrow_hi, ks * 8 + tq, q_lo_ok, q_hi_ok)
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


def paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, *,
                      geometry: PrefillGeometry | None = None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Launch the tiled kernel (``paged_attention``'s arguments, already checked there); ``geometry`` forces the
    tile (tests, ``benchmarks/bench_attention.py``), by default ``prefill_geometry``."""
    T, nq, D = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nq // nkv
    warps, block_keys, q_in_regs = geometry or prefill_geometry(D)
    if (16 * warps) % group:
        raise ValueError(f"the tiled prefill kernel needs nq/nkv = {group} to divide {16 * warps}")
    rows_tokens = 16 * warps // group
    kern = prefill_kernel(D, group, warps, block_keys, q_in_regs)
    launch(kern, grid(ceil_div(T, rows_tokens) * nkv, sim_cap=64), 32 * warps,
           flat_u32(q), flat_u32(k_cache), flat_u32(v_cache), block_tables, token_slots, positions,
           flat_u32(out), np.float32(scale * LOG2E), np.int32(nkv), np.int32(page_size.bit_length() - 1),
           name="paged_attention_prefill", policy=policy)
