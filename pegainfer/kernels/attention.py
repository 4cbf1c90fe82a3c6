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

* **Split-K ("flash-decoding")**: ``paged_attention_split_kernel``.  One block per (token, kv head, split); the block
  serves all ``G = nq // nkv`` query heads of its kv head, so each K/V row is read from memory once for ``G`` heads.
  A token's keys are cut into ``num_splits`` page-aligned ranges; block ``split`` covers one of them and writes a
  partial ``(m, l, acc)`` into the workspace, then ``paged_attention_combine_kernel`` merges the splits.  With
  ``num_splits == 1`` the split kernel writes the normalised output itself and no combine runs.  ``num_splits`` is
  chosen from shapes known before capture (``T``, ``nq``, the block table's capacity), never from the runtime
  lengths: the range a split covers is computed *on the device* from ``positions[t]``, so the launch is identical for
  every step and can live in a CUDA graph.  This path serves every ``T`` (decode batches, short chunks).
* **Tiled prefill**: ``paged_attention_prefill_kernel`` (FlashAttention-2 style, on tensor cores): one block per
  (tile of ``BQ`` consecutive query tokens, kv head); the tile's ``BQ * G`` query rows share every K/V tile staged in
  shared memory, ``S = Q K^T`` and ``O += P V`` are ``mma.sync.m16n8k16`` (bf16 in, f32 accumulate) and the
  softmax lives in the accumulator registers.  ``method="auto"`` takes it from ``PREFILL_MIN_TOKENS`` tokens up.
  In the simulator the warp-wide mma is emulated (``mma_bf16_m16n8k16`` below), so the same kernel is tested there.

Public API: ``paged_attention``, ``attention_workspace_size``, ``attention_num_splits``.
Nothing allocates per call (the split-K partials live in the caller's ``workspace``), and every per-step value comes
from device arrays, so both paths can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import (
    FULL_MASK,
    bf16x2_hi,
    bits_f32,
    block_max,
    block_sum,
    bf16x2_lo,
    device_fn,
    f32_to_bf16,
    float32,
    grid,
    kernel,
    load_u32x4,
    threads,
    uint32,
)

NEG_INF = float32(-math.inf)
uint64 = np.uint64

# Split-K policy (see ``attention_num_splits``).
SPLIT_TARGET_ROWS = 2048   # aim for ~this many (token, q head, split) rows per launch: ~512 blocks at G = 4
MIN_SPLIT_TOKENS = 64      # a split covers at least this many keys (rounded up to whole pages)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
PREFILL_MIN_TOKENS = 128   # "auto" takes the tiled prefill kernel from this many query tokens up


# ------------------------------------------------------------------------- lane-group reductions, tensor-core helpers
if SIMULATOR:
    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32); every lane of the group gets
        it.  Simulator emulation through block-shared scratch: every thread of the block must call it equally often.
        """
        buf = cuda.shared.array(1024, np.float64)
        t = int(cuda.threadIdx.x)
        lo = t - t % int(width)
        buf[t] = v
        cuda.syncthreads()
        s = np.float32(np.sum(buf[lo:lo + int(width)].astype(np.float32), dtype=np.float32))
        cuda.syncthreads()
        return s

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes (simulator emulation, same rule as the sum)."""
        buf = cuda.shared.array(1024, np.float64)
        t = int(cuda.threadIdx.x)
        lo = t - t % int(width)
        buf[t] = v
        cuda.syncthreads()
        s = np.float32(buf[lo:lo + int(width)].max())
        cuda.syncthreads()
        return s

    # Where each element of the m16n8k16 operands lives: A[r, k] in lane (r % 8) * 4 + (k % 8) // 2, register
    # a0..a3 = (k >= 8) * 2 + (r >= 8), half k % 2; B[k, n] in lane n * 4 + (k % 8) // 2, register b0/b1 = k >= 8.
    _R, _K = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    _A_LANE, _A_REG = (_R % 8) * 4 + (_K % 8) // 2, (_K >= 8) * 2 + (_R >= 8)
    _A_SHIFT = (16 * (_K % 2)).astype(np.uint32)
    _KB, _N = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    _B_LANE, _B_REG, _B_SHIFT = _N * 4 + (_KB % 8) // 2, 4 + (_KB >= 8), (16 * (_KB % 2)).astype(np.uint32)

    def _bf16_halves(words, shift):
        return ((((words >> shift) & np.uint32(0xFFFF)) << np.uint32(16)).astype(np.uint32)
                .view(np.float32).astype(np.float64))

    @device_fn
    def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator emulation of the warp-wide ``mma.sync.m16n8k16`` (see the GPU version for the layout): the
        warp's fragments meet in block-shared scratch; every thread of the block must call it equally often."""
        regs = cuda.shared.array((1024, 6), np.uint32)
        t = int(cuda.threadIdx.x)
        for i, r in enumerate((a0, a1, a2, a3, b0, b1)):
            regs[t, i] = r
        cuda.syncthreads()
        w = regs[t - t % 32:t - t % 32 + 32].copy()
        cuda.syncthreads()
        a = _bf16_halves(w[_A_LANE, _A_REG], _A_SHIFT)
        b = _bf16_halves(w[_B_LANE, _B_REG], _B_SHIFT)
        d = a @ b
        g, q = (t % 32) >> 2, t & 3
        return (np.float32(c0 + d[g, 2 * q]), np.float32(c1 + d[g, 2 * q + 1]),
                np.float32(c2 + d[g + 8, 2 * q]), np.float32(c3 + d[g + 8, 2 * q + 1]))

    @device_fn
    def pack_bf16x2(lo, hi):
        """Two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32): an xor butterfly that stays
        inside the group; every lane of the group gets the sum."""
        off = width >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        return v

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes."""
        off = width >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        return v

    @intrinsic
    def mma_bf16_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: one warp computes D[16x8] = A[16x16] B[16x8] + C
        in f32.  Per lane (g = lane >> 2, t = lane & 3), each uint32 holding two bf16, lower index in the low half:
        a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10];
        b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]; c/d0,1 = C[g, 2t:2t+2], c/d2,3 = C[g+8, 2t:2t+2].
        Returns (d0, d1, d2, d3).  (The same intrinsic as ``linear.py``'s; candidates for ``primitives``.)"""
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            ins = [context.cast(builder, v, ty, types.uint32) for v, ty in zip(args[:6], sig.args[:6])]
            ins += [context.cast(builder, v, ty, types.float32) for v, ty in zip(args[6:], sig.args[6:])]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty,
                               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, ins)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        """``cvt.rn.bf16x2.f32``: two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            vals = [context.cast(builder, v, ty, types.float32) for v, ty in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, vals)

        return sig, codegen


@device_fn
def rescale_factor(m_part, m_total):
    """``exp(m_part - m_total)``, and 0 for an empty partial (``m_part == -inf``)."""
    if m_part == NEG_INF:
        return float32(0.0)
    return float32(math.exp(m_part - m_total))


@device_fn
def rescale_factor2(m_part, m_total):
    """``2^(m_part - m_total)`` (scores kept in log2 units), and 0 for an empty partial."""
    if m_part == NEG_INF:
        return float32(0.0)
    return float32(math.exp2(m_part - m_total))


# ------------------------------------------------------------------------------------------------ split-K kernel
@functools.lru_cache(maxsize=None)
def _split_kernel(head_dim: int, group: int, elems_per_lane: int, block_threads: int, unroll: int, prefetch: bool):
    """Build the split-K kernel for one shape.  The closure constants become compile-time constants, so the
    per-lane arrays below have fixed sizes, their loops unroll and they live in registers."""
    D, G, E, NT, U = head_dim, group, elems_per_lane, block_threads, unroll
    LAG = 1 if prefetch else 0  # steps the loads run ahead of the arithmetic
    L = D // E                # lanes that share one key (each holds E of its D elements)
    CPL = E // 8              # 16-byte chunks per lane: lane owns chunks lane, lane + L, lane + 2L, ...
    NGROUPS = NT // L         # keys in flight per block (one per lane group) per unrolled step
    ROW_WORDS = D // 2        # a K/V row in uint32 words
    assert D % E == 0 and E % 8 == 0 and NT % 32 == 0 and 32 % L == 0
    # array sizes must be plain constants for numba's typing
    HEAD_SLICE, SCORES, RAW_WORDS, GROUP_STATE, GROUP_ROWS = G * E, U * G, U * CPL * 4, NGROUPS * G, NGROUPS * D

    @kernel
    def paged_attention_split_kernel(q32, k32, v32, block_tables, token_slots, positions, out, ws_acc, ws_m, ws_l,
                                     scale, num_kv_heads, page_shift, num_splits, min_chunk):
        """Partial attention of one (token, kv head, split) per block, for all ``G`` q heads of that kv head.

        q32 ``[T * nq * D/2]`` uint32 (bf16 pairs of q ``[T, nq, D]``); k32, v32 the caches as flat uint32
        ``[num_pages * page_size * nkv * D/2]``; out ``[T * nq * D]`` uint16; ws_acc ``[T * nq * num_splits * D]``,
        ws_m, ws_l ``[T * nq * num_splits]`` f32; ``page_shift = log2(page_size)`` (pages are powers of two, so the
        page of a key is a shift, not a division).

        Geometry: grid-stride over ``T * nkv * num_splits`` work items, ``NT`` threads.  Lanes form groups of
        ``L = D / E``; a group owns one key at a time (its lanes hold interleaved 16-byte chunks of the row), keeps
        its own online-softmax state for the ``G`` heads, and walks keys ``k_lo + group, + NGROUPS, ...``
        (``U`` keys per step, all loads issued before use; with ``prefetch`` the next step's loads are issued
        before the current step's arithmetic).  At the end the block merges its groups through
        shared memory.  Split ``s`` covers keys ``[s * chunk, (s+1) * chunk)`` of ``n = positions[t] + 1`` with
        ``chunk = max(min_chunk, ceil(n / num_splits) rounded up to a page)``: a split past the end writes an
        empty partial (m = -inf, l = 0).  With ``num_splits == 1`` the normalised bf16 output is written directly.
        """
        tid = cuda.threadIdx.x
        grp = tid // L
        lane = tid % L
        nq = num_kv_heads * G
        n_tokens = positions.shape[0]
        page_mask = (1 << page_shift) - 1

        qreg = cuda.local.array(HEAD_SLICE, float32)  # this lane's slice of the G (scaled) query rows
        acc = cuda.local.array(HEAD_SLICE, float32)   # this lane's slice of the G accumulators
        m = cuda.local.array(G, float32)
        l = cuda.local.array(G, float32)
        s = cuda.local.array(SCORES, float32)         # scores of the U keys in flight
        kw = cuda.local.array(RAW_WORDS, uint32)   # raw K words of the U keys being computed
        vw = cuda.local.array(RAW_WORDS, uint32)   # raw V words
        kn = cuda.local.array(RAW_WORDS, uint32)   # ... and of the U keys being loaded
        vn = cuda.local.array(RAW_WORDS, uint32)
        vf = cuda.local.array(E, float32)
        sm_m = cuda.shared.array(GROUP_STATE, float32)
        sm_l = cuda.shared.array(GROUP_STATE, float32)
        sm_acc = cuda.shared.array(GROUP_ROWS, float32)

        for work in range(cuda.blockIdx.x, n_tokens * num_kv_heads * num_splits, cuda.gridDim.x):
            split = work % num_splits
            kvh = (work // num_splits) % num_kv_heads
            t = work // (num_splits * num_kv_heads)
            slot = token_slots[t]
            n_keys = positions[t] + 1
            chunk = (n_keys + num_splits - 1) // num_splits
            chunk = max(min_chunk, ((chunk + page_mask) >> page_shift) << page_shift)
            k_lo = split * chunk
            k_hi = min(k_lo + chunk, n_keys)
            head0 = kvh * G

            for h in range(G):
                qbase = (t * nq + head0 + h) * ROW_WORDS
                for j in range(CPL):
                    w0, w1, w2, w3 = load_u32x4(q32, qbase + (lane + L * j) * 4)
                    o = h * E + j * 8
                    qreg[o + 0] = bf16x2_lo(w0) * scale
                    qreg[o + 1] = bf16x2_hi(w0) * scale
                    qreg[o + 2] = bf16x2_lo(w1) * scale
                    qreg[o + 3] = bf16x2_hi(w1) * scale
                    qreg[o + 4] = bf16x2_lo(w2) * scale
                    qreg[o + 5] = bf16x2_hi(w2) * scale
                    qreg[o + 6] = bf16x2_lo(w3) * scale
                    qreg[o + 7] = bf16x2_hi(w3) * scale
                m[h] = NEG_INF
                l[h] = float32(0.0)
                for i in range(E):
                    acc[h * E + i] = float32(0.0)

            step = NGROUPS * U
            n_steps = (max(k_hi - k_lo, 0) + step - 1) // step
            for it in range(n_steps + LAG):
                # issue every load of step `it` (U keys) into kn / vn before any arithmetic: memory-level parallelism
                if it < n_steps:
                    for u in range(U):
                        kp = k_lo + it * step + u * NGROUPS + grp
                        if kp < k_hi:
                            page = block_tables[slot, kp >> page_shift]
                            row = (((page << page_shift) + (kp & page_mask)) * num_kv_heads + kvh) * ROW_WORDS
                            for j in range(CPL):
                                c = row + (lane + L * j) * 4
                                o = (u * CPL + j) * 4
                                kn[o], kn[o + 1], kn[o + 2], kn[o + 3] = load_u32x4(k32, c)
                                vn[o], vn[o + 1], vn[o + 2], vn[o + 3] = load_u32x4(v32, c)
                        else:
                            for i in range(CPL * 4):
                                kn[u * CPL * 4 + i] = uint32(0)
                                vn[u * CPL * 4 + i] = uint32(0)
                if LAG == 0:
                    for i in range(RAW_WORDS):
                        kw[i] = kn[i]
                        vw[i] = vn[i]
                if it >= LAG:
                    cur = it - LAG     # with prefetch, step `it`'s loads are in flight while step it-1 is computed
                    # scores: partial dot over this lane's E elements, then a sum over the L lanes of the group
                    for u in range(U):
                        for h in range(G):
                            part = float32(0.0)
                            for i in range(CPL * 4):
                                word = kw[u * CPL * 4 + i]
                                part += qreg[h * E + 2 * i] * bf16x2_lo(word)
                                part += qreg[h * E + 2 * i + 1] * bf16x2_hi(word)
                            if L > 1:
                                part = lane_group_sum(part, L)
                            s[u * G + h] = part
                    # online softmax update (rescale only when the running max grows)
                    for u in range(U):
                        kp = k_lo + cur * step + u * NGROUPS + grp
                        if kp < k_hi:
                            for i in range(CPL * 4):
                                word = vw[u * CPL * 4 + i]
                                vf[2 * i] = bf16x2_lo(word)
                                vf[2 * i + 1] = bf16x2_hi(word)
                            for h in range(G):
                                sc = s[u * G + h]
                                if sc > m[h]:
                                    alpha = rescale_factor(m[h], sc)
                                    l[h] *= alpha
                                    for i in range(E):
                                        acc[h * E + i] *= alpha
                                    m[h] = sc
                                p = float32(math.exp(sc - m[h]))
                                l[h] += p
                                for i in range(E):
                                    acc[h * E + i] += p * vf[i]
                if LAG == 1:
                    for i in range(RAW_WORDS):
                        kw[i] = kn[i]
                        vw[i] = vn[i]

            # ---- merge the NGROUPS partial states of the block
            if lane == 0:
                for h in range(G):
                    sm_m[grp * G + h] = m[h]
                    sm_l[grp * G + h] = l[h]
            cuda.syncthreads()
            for h in range(G):
                m_blk = NEG_INF
                for g2 in range(NGROUPS):
                    m_blk = max(m_blk, sm_m[g2 * G + h])
                l_blk = float32(0.0)
                for g2 in range(NGROUPS):
                    l_blk += sm_l[g2 * G + h] * rescale_factor(sm_m[g2 * G + h], m_blk)
                mine = rescale_factor(m[h], m_blk)
                for j in range(CPL):
                    for e in range(8):
                        sm_acc[grp * D + (lane + L * j) * 8 + e] = acc[h * E + j * 8 + e] * mine
                cuda.syncthreads()
                row_q = t * nq + head0 + h
                for d in range(tid, D, NT):
                    total = float32(0.0)
                    for g2 in range(NGROUPS):
                        total += sm_acc[g2 * D + d]
                    if num_splits == 1:
                        out[row_q * D + d] = f32_to_bf16(total / l_blk)
                    else:
                        ws_acc[(row_q * num_splits + split) * D + d] = total
                if tid == 0 and num_splits > 1:
                    ws_m[row_q * num_splits + split] = m_blk
                    ws_l[row_q * num_splits + split] = l_blk
                cuda.syncthreads()

    return paged_attention_split_kernel


COMBINE_THREADS = threads(gpu=256, sim=32)
COMBINE_SCRATCH = COMBINE_THREADS * 4
MAX_SPLITS = 256


@kernel
def paged_attention_combine_kernel(ws_acc32, ws_m, ws_l, out, num_splits, head_dim):
    """Merge the ``num_splits`` partial ``(m, l, acc)`` of every (token, q head) row into bf16 output.

    ws_acc32 ``[rows * num_splits * D]`` (f32 bits as uint32, for 16-byte loads), ws_m / ws_l ``[rows * num_splits]``
    f32 (rows = ``T * nq``; an empty split has l = 0, m = -inf); out ``[rows * D]`` uint16::

        out = sum_s w_s acc_s,   w_s = e^(m_s - M) / sum_s' e^(m_s' - M) l_s',   M = max_s m_s

    Geometry: grid-stride over rows, ``COMBINE_THREADS`` threads.  Phase 1 spreads the splits over the threads
    (block max / block sum) and leaves the weights in shared memory; phase 2 gives each thread 4 adjacent columns
    (one 16-byte load per split) and ``COMBINE_THREADS / (D/4)`` splits in parallel, reduced through shared memory.
    """
    sm_w = cuda.shared.array(MAX_SPLITS, float32)
    sm_part = cuda.shared.array(COMBINE_SCRATCH, float32)
    tid = cuda.threadIdx.x
    quads = head_dim // 4                 # threads per split row
    lanes_s = COMBINE_THREADS // quads    # splits reduced in parallel
    col = (tid % quads) * 4
    s_lane = tid // quads
    n_rows = out.shape[0] // head_dim
    for r in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):
        base = r * num_splits
        m_mine = NEG_INF
        for sp in range(tid, num_splits, COMBINE_THREADS):
            m_mine = max(m_mine, ws_m[base + sp])
        m_all = block_max(m_mine)
        l_mine = float32(0.0)
        for sp in range(tid, num_splits, COMBINE_THREADS):
            w = rescale_factor(ws_m[base + sp], m_all)
            sm_w[sp] = w
            l_mine += w * ws_l[base + sp]
        l_all = block_sum(l_mine)        # (its barriers also publish sm_w)
        a0 = float32(0.0)
        a1 = float32(0.0)
        a2 = float32(0.0)
        a3 = float32(0.0)
        for sp in range(s_lane, num_splits, lanes_s):
            w = sm_w[sp]
            if w > float32(0.0):
                x0, x1, x2, x3 = load_u32x4(ws_acc32, (base + sp) * head_dim + col)
                a0 += w * bits_f32(x0)
                a1 += w * bits_f32(x1)
                a2 += w * bits_f32(x2)
                a3 += w * bits_f32(x3)
        sm_part[tid * 4 + 0] = a0
        sm_part[tid * 4 + 1] = a1
        sm_part[tid * 4 + 2] = a2
        sm_part[tid * 4 + 3] = a3
        cuda.syncthreads()
        inv_l = float32(1.0) / l_all
        for c in range(tid, head_dim, COMBINE_THREADS):
            total = float32(0.0)
            for k in range(lanes_s):
                total += sm_part[(k * quads + c // 4) * 4 + c % 4]
            out[r * head_dim + c] = f32_to_bf16(total * inv_l)
        cuda.syncthreads()


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

                for kt in range((max_pos + BK) // BK):
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


def _min_chunk(page_size: int, min_split_tokens: int | None = None) -> int:
    tokens = MIN_SPLIT_TOKENS if min_split_tokens is None else min_split_tokens
    return max(page_size, _ceil_div(tokens, page_size) * page_size)


def attention_num_splits(num_tokens: int, nq: int, max_model_len: int, page_size: int) -> int:
    """Splits per (token, kv head) for the split-K path: enough (token, head, split) rows to fill the GPU
    (``SPLIT_TARGET_ROWS``), but no more than a ``MIN_SPLIT_TOKENS``-key split per ``max_model_len``.  Depends only on
    shapes fixed before CUDA-graph capture."""
    max_splits = max(1, _ceil_div(max_model_len, _min_chunk(page_size)))
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
    forced value if the caller forces one).  At least 1, so it can always be allocated."""
    need = 1
    for t in range(1, max_tokens + 1):
        s = num_splits if num_splits is not None else attention_num_splits(t, nq, max_model_len, page_size)
        a, mm = _workspace_parts(t, nq, head_dim, s)
        need = max(need, a + 2 * mm)
    return need


def _flat_u32(a):
    return a.view(np.uint32).reshape(-1)


def _flat(a):
    return a.reshape(-1)


def paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace, *,
                    num_splits: int | None = None, min_split_tokens: int | None = None,
                    method: str = "auto") -> None:
    """``out[t, h] = bf16(softmax(scale * q[t, h] . K_slot^T) V_slot)`` over keys ``0 .. positions[t]`` of slot
    ``token_slots[t]`` (see the module docstring).

    q, out ``[T, nq, D]`` uint16; k_cache, v_cache ``[num_pages, page_size, nkv, D]`` uint16; block_tables
    ``[num_slots, max_pages]``, token_slots ``[T]``, positions ``[T]`` int32; workspace: f32 device array of at least
    ``attention_workspace_size(...)`` elements (may be None when the split-K path uses one split).
    ``num_splits`` / ``min_split_tokens`` force the split-K policy (tests); ``method``: "auto", "split" or "prefill".
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
    if method == "prefill":
        _paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale,
                                 T, nkv, D, group, page_size)
    else:
        _paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace,
                               T, nq, nkv, D, group, page_size, num_splits, min_split_tokens)


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
           name="paged_attention_prefill")


def _split_geometry(head_dim: int, group: int) -> tuple[int, int, int, bool]:
    """(elements per lane, threads per block, keys per lane group per step, prefetch) of the split-K kernel.
    8 elements per lane = one 16-byte load of K and one of V per key; 2 keys per step, software-pipelined, keep up to
    8 such loads in flight per lane.  Per lane the kernel holds 2 * G * E floats of q and accumulators plus the
    loaded words: ~200 registers at G = 4 (E = 16 would need ~250).  ``benchmarks/bench_attention.py --sweep``
    times the alternatives."""
    return min(head_dim, 8), threads(gpu=128, sim=32), (2 if group <= 4 else 1), True


def _paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace,
                           T, nq, nkv, D, group, page_size, num_splits, min_split_tokens, geometry=None):
    capacity = block_tables.shape[1] * page_size
    if num_splits is None:
        num_splits = attention_num_splits(T, nq, capacity, page_size)
    min_chunk = _min_chunk(page_size, min_split_tokens)
    n_acc, n_m = _workspace_parts(T, nq, D, num_splits)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} outside 1..{MAX_SPLITS}")
    if num_splits > 1:
        if workspace is None or workspace.dtype != np.float32 or workspace.size < n_acc + 2 * n_m:
            raise ValueError(f"workspace must be f32 with >= {n_acc + 2 * n_m} elements "
                             f"(attention_workspace_size); got {None if workspace is None else workspace.size}")
        ws = _flat(workspace)
        ws_acc, ws_m, ws_l = ws[:n_acc], ws[n_acc:n_acc + n_m], ws[n_acc + n_m:n_acc + 2 * n_m]
    else:  # the kernel never touches the workspace with one split: pass any f32 array
        ws_acc = ws_m = ws_l = _flat(workspace) if workspace is not None else _dummy_f32()
    elems, nthreads, unroll, prefetch = geometry or _split_geometry(D, group)
    kern = _split_kernel(D, group, elems, nthreads, unroll, prefetch)
    out_flat = _flat(out)
    launch(kern, grid(T * nkv * num_splits, sim_cap=64), nthreads,
           _flat_u32(q), _flat_u32(k_cache), _flat_u32(v_cache), block_tables, token_slots, positions,
           out_flat, ws_acc, ws_m, ws_l, np.float32(scale), np.int32(nkv), np.int32(page_size.bit_length() - 1),
           np.int32(num_splits), np.int32(min_chunk), name="paged_attention_split")
    if num_splits > 1:
        launch(paged_attention_combine_kernel, grid(T * nq, sim_cap=64), COMBINE_THREADS,
               ws_acc.view(np.uint32), ws_m, ws_l, out_flat, np.int32(num_splits), np.int32(D),
               name="paged_attention_combine")


@functools.lru_cache(maxsize=None)
def _dummy_f32():
    """A 1-element device array standing in for an absent workspace (allocated once, on the first such call: pass a
    workspace when capturing a CUDA graph)."""
    return cuda.device_array(1, dtype=np.float32)
