"""The gated delta rule for prompts, in chunks of C tokens (the "WY / UT-transform" form of flash-linear-attention).

It gives the result of the token-by-token rule (``reference.py``) with the work of a chunk done all at once.  Inside
a chunk, with ``G_i`` the cumulative log decay from the chunk start, ``S`` the state before the chunk and ``k̂, q̂``
the l2-normalised keys and queries::

    L[i,m]     = beta_i · exp(G_i − G_m) · (k̂_i·k̂_m)      m < i      (strictly lower triangular)
    Tinv       = (I + L)⁻¹                                            (unit lower triangular)
    intra[i,m] = exp(G_i − G_m) · (q̂_i·k̂_m)               m ≤ i
    R_i        = beta_i · (v_i − exp(G_i) · Sᵀ k̂_i)                   delta-rule targets against the old state
    U          = Tinv · R                                             the deltas actually written, all at once
    o_i        = exp(G_i) · Sᵀ q̂_i + Σ_m intra[i,m] · U_m
    S_next     = exp(G_C) · S + Σ_i exp(G_C − G_i) · k̂_i ⊗ U_i

(Unrolling the recurrence inside a chunk gives ``U_i = R_i − Σ_{m<i} L[i,m] U_m``, i.e. ``(I + L) U = R``.)  The
parts that do not depend on the state (``Tinv``, ``intra``, ``G``, ``beta``, norms) are computed for every chunk in
parallel by one kernel (``_chunk_prepare_kernel``); a second (``_chunk_scan_kernel``) walks the chunks of each
sequence in order, carrying ``S``.  The f32 sums run in another order than the reference's: outputs agree to bf16
rounding, states to ~1e-5 relative.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from pegainfer.kernels.gated_delta.common import (COL_TILE, MAX_CHUNK, MAX_KEY_DIM, bounded_kernel, check_rule_args,
                                                  inverse_l2_norm, log_decay, num_k_heads_of, write_strength,
                                                  zero_rows_from)
from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, bf16_to_f32, bf16x2_hi, bf16x2_lo, bits_f32, cp_async_16,
                                          cp_async_commit, cp_async_wait_group, cuda, device_fn, f32_bits,
                                          f32_to_bf16, float32, grid, kernel, math, pdl_prologue, threads, uint32)

K_ROW_WORDS = MAX_KEY_DIM // 2 + 1  # a staged k row: Dk/2 packed bf16 pairs + one spare word (bank offset)
STAGE_WORDS = MAX_CHUNK * max(MAX_KEY_DIM // 2, MAX_CHUNK)  # the scan's staged rows: q/k rows (pairs) or (I+L)⁻¹
SCAN_THREADS = 512  # threads per block of the scan on the GPU (faster than 256 on the H200: docs/perf/gated_delta.md)


@dataclass
class ChunkScratch:
    """Per-token intermediates of the chunked form (device arrays, f32), sized for ``max_tokens`` tokens.

    tinv, intra ``[tokens, Hv, C]``: row ``i`` of the token's chunk matrices ``(I+L)⁻¹`` and ``intra``;
    gcum, beta ``[tokens, Hv]``: cumulative log decay from the chunk start, write strength;
    qk_inv ``[tokens, Hk, 2]``: l2norm factors of q (times 1/sqrt(Dk)) and k.
    """
    tinv: object
    intra: object
    gcum: object
    beta: object
    qk_inv: object
    chunk_size: int

    @property
    def max_tokens(self) -> int:
        return self.tinv.shape[0]

    @staticmethod
    def bytes_per_token(num_k_heads: int, num_v_heads: int, chunk_size: int) -> int:
        """Device bytes a token of ``allocate_chunk_scratch`` takes."""
        return 4 * (2 * num_v_heads * chunk_size + 2 * num_v_heads + 2 * num_k_heads)


def allocate_chunk_scratch(max_tokens: int, num_k_heads: int, num_v_heads: int,
                           chunk_size: int = MAX_CHUNK) -> ChunkScratch:
    """Device scratch for ``gated_delta_chunked`` over at most ``max_tokens`` tokens per call (allocate once)."""
    assert 1 <= chunk_size <= MAX_CHUNK, chunk_size
    n = max(1, max_tokens)
    f32 = np.float32
    return ChunkScratch(tinv=cuda.device_array((n, num_v_heads, chunk_size), f32),
                        intra=cuda.device_array((n, num_v_heads, chunk_size), f32),
                        gcum=cuda.device_array((n, num_v_heads), f32),
                        beta=cuda.device_array((n, num_v_heads), f32),
                        qk_inv=cuda.device_array((n, num_k_heads, 2), f32),
                        chunk_size=chunk_size)


@device_fn
def _stage_rows(qkv, t0, n, col, rows_s, words):
    """``rows_s[i, w]`` ← the bf16 pair ``qkv[t0 + i, col + 2w : col + 2w + 2]`` (low half first) for the chunk's
    ``n`` tokens, ``words`` pairs per token; every thread of the block takes part (the caller syncs)."""
    for idx in range(cuda.threadIdx.x, n * words, cuda.blockDim.x):
        i = idx // words
        w = idx - i * words
        rows_s[i, w] = (uint32(qkv[t0 + i, col + 2 * w + 1]) << uint32(16)) | uint32(qkv[t0 + i, col + 2 * w])


@functools.cache
def _chunk_prepare_kernel(key_dim: int):
    """Build the state-independent kernel for key heads of ``key_dim`` dims (a compile-time constant, so the dot
    products over the key dims are unrolled and their loads issued together)."""
    KD = key_dim
    KW = key_dim // 2

    @kernel
    def gated_delta_chunk_prepare_kernel(qkv, a, b, a_log, dt_bias, slot_ids, token_offsets, chunk_size, max_chunks,
                                         tinv, intra, gcum, beta, qk_inv):
        """The state-independent half of the chunked form, for every chunk of every sequence in parallel.

        Inputs as in ``reference.gated_delta_recurrent_kernel`` (``Hv`` from ``a.shape[1]``, ``Hk`` from
        ``qk_inv``).  For chunk ``[t0, t0+n)`` (``n ≤ chunk_size``) of a sequence and value head ``h`` it writes,
        for ``i, m < n`` (module docstring)::

            qk_inv[t0+i, hk] = (1/sqrt(Σq²+eps) / sqrt(Dk),  1/sqrt(Σk²+eps))
            beta[t0+i, h]    = bf16(sigmoid(b));     gcum[t0+i, h] = G_i = Σ_{s≤i} g_s
            tinv[t0+i, h, m] = ((I + L)⁻¹)[i, m]     (0 above the diagonal)
            intra[t0+i, h, m] = exp(G_i − G_m)·(q_i·k_m) for m ≤ i, else 0

        A padding sequence (slot -1, ``state.sequence_table``) is skipped like an empty one.

        Geometry: one block per (sequence, chunk, value head), grid-strided; ``max_chunks`` bounds chunks per
        sequence.  The chunk's k rows are staged in shared memory; threads stride over tokens for the per-token
        scalars, over (i, m) pairs for the dot products, and over columns ``m`` of ``(I+L)⁻¹`` for the triangular
        solve (column ``m`` solves ``(I+L) x = e_m`` by forward substitution alone, in the k rows' shared memory,
        which the dot products are done with; the block then writes the matrix out row by row); the cumulative sum
        of g is one thread's loop.
        """
        pdl_prologue()
        num_v_heads = a.shape[1]
        num_k_heads = qk_inv.shape[1]
        k_base = num_k_heads * KD
        heads_per_key = num_v_heads // num_k_heads
        q_scale = float32(1.0) / float32(math.sqrt(float32(KD)))

        g_s = cuda.shared.array(MAX_CHUNK, float32)
        beta_s = cuda.shared.array(MAX_CHUNK, float32)
        qinv_s = cuda.shared.array(MAX_CHUNK, float32)
        kinv_s = cuda.shared.array(MAX_CHUNK, float32)
        l_s = cuda.shared.array((MAX_CHUNK, MAX_CHUNK), float32)
        # the chunk's k rows as packed bf16 pairs (one spare word per row keeps lanes reading different rows on
        # different banks); later the columns of (I+L)⁻¹ as f32 bits
        k_s = cuda.shared.array((MAX_CHUNK, K_ROW_WORDS), uint32)

        tid = cuda.threadIdx.x
        for item in range(cuda.blockIdx.x, (token_offsets.shape[0] - 1) * max_chunks * num_v_heads, cuda.gridDim.x):
            h = item % num_v_heads
            chunk = (item // num_v_heads) % max_chunks
            seq = item // (num_v_heads * max_chunks)
            t0 = token_offsets[seq] + chunk * chunk_size
            n = min(chunk_size, token_offsets[seq + 1] - t0)
            if n <= 0 or slot_ids[seq] < 0:
                continue  # uniform across the block: the whole block skips
            hk = h // heads_per_key
            q_col = hk * KD
            k_col = k_base + q_col
            _stage_rows(qkv, t0, n, k_col, k_s, KW)
            cuda.syncthreads()

            # per-token scalars
            for i in range(tid, n, cuda.blockDim.x):
                t = t0 + i
                ssq = float32(0.0)
                ssk = float32(0.0)
                for w in range(KW):
                    q0 = bf16_to_f32(qkv[t, q_col + 2 * w])
                    q1 = bf16_to_f32(qkv[t, q_col + 2 * w + 1])
                    k0 = bf16x2_lo(k_s[i, w])
                    k1 = bf16x2_hi(k_s[i, w])
                    ssq += q0 * q0 + q1 * q1
                    ssk += k0 * k0 + k1 * k1
                qinv_s[i] = inverse_l2_norm(ssq) * q_scale
                kinv_s[i] = inverse_l2_norm(ssk)
                g_s[i] = log_decay(a[t, h], a_log[h], dt_bias[h])
                beta_s[i] = write_strength(b[t, h])
                beta[t, h] = beta_s[i]
                if h % heads_per_key == 0:  # one of the value heads sharing this key head writes its norms
                    qk_inv[t, hk, 0] = qinv_s[i]
                    qk_inv[t, hk, 1] = kinv_s[i]
            cuda.syncthreads()
            if tid == 0:
                run = float32(0.0)
                for i in range(n):
                    run += g_s[i]
                    g_s[i] = run
                    gcum[t0 + i, h] = run
            cuda.syncthreads()

            # L (strictly lower, into shared) and intra (lower with diagonal, to global).  Consecutive threads take
            # consecutive m for one i: k_m from shared memory (conflict-free), q_i and k_i broadcast.
            for p in range(tid, n * n, cuda.blockDim.x):
                i = p // n
                m = p % n
                kk = float32(0.0)
                qk = float32(0.0)
                if m <= i:
                    for w in range(KW):
                        km, ki = k_s[m, w], k_s[i, w]
                        km0 = bf16x2_lo(km)
                        km1 = bf16x2_hi(km)
                        kk += bf16x2_lo(ki) * km0 + bf16x2_hi(ki) * km1
                        qi0 = bf16_to_f32(qkv[t0 + i, q_col + 2 * w])
                        qi1 = bf16_to_f32(qkv[t0 + i, q_col + 2 * w + 1])
                        qk += qi0 * km0 + qi1 * km1
                pair_decay = float32(math.exp(g_s[i] - g_s[m])) if m <= i else float32(0.0)
                l_s[i, m] = beta_s[i] * pair_decay * (kk * kinv_s[i] * kinv_s[m]) if m < i else float32(0.0)
                intra[t0 + i, h, m] = pair_decay * (qk * qinv_s[i] * kinv_s[m])
            cuda.syncthreads()   # the k rows are no longer needed: k_s now holds (I+L)⁻¹

            # (I + L)⁻¹ column by column: x_m = 1, x_i = −Σ_{m≤p<i} L[i,p]·x_p (a thread reads back only its own
            # column; lanes take consecutive columns: conflict-free)
            for m in range(tid, n, cuda.blockDim.x):
                for i in range(n):
                    if i < m:
                        x = float32(0.0)
                    elif i == m:
                        x = float32(1.0)
                    else:
                        x = float32(0.0)
                        for p in range(m, i):
                            x -= l_s[i, p] * bits_f32(k_s[p, m])
                    k_s[i, m] = f32_bits(x)
            cuda.syncthreads()
            for p in range(tid, n * n, cuda.blockDim.x):
                i = p // n
                m = p - i * n
                tinv[t0 + i, h, m] = bits_f32(k_s[i, m])
            cuda.syncthreads()  # l_s, k_s and the scalars are reused by the block's next item

    return gated_delta_chunk_prepare_kernel


@device_fn
def _stage_words(src32, first, stride, n, row_words, dst, copy_async):
    """Start copying ``n`` rows of ``row_words`` words, ``src32[first + i·stride : +row_words]``, to
    ``dst[i·row_words : +row_words]`` (shared memory); every thread of the block takes its share.  ``copy_async``
    (a compile-time constant): 16-byte ``cp.async`` copies, one group per thread (``row_words``, ``first`` and
    ``stride`` multiples of 4, the array 16-byte aligned), else word by word.  The caller then waits
    (``_wait_copies()``) and syncs the block."""
    if copy_async:
        slices = row_words >> 2
        for idx in range(cuda.threadIdx.x, n * slices, cuda.blockDim.x):
            i = idx // slices
            w = 4 * (idx - i * slices)
            cp_async_16(dst, i * row_words + w, src32, first + i * stride + w, 16)
        cp_async_commit()
    else:
        for idx in range(cuda.threadIdx.x, n * row_words, cuda.blockDim.x):
            i = idx // row_words
            w = idx - i * row_words
            dst[idx] = src32[first + i * stride + w]


_wait_copies = cp_async_wait_group(0)


@device_fn
def _state_dot(rows_s, row, s_tile, lane, words):
    """``Sᵀx`` for column ``lane`` of the state tile: ``Σ_w`` of the staged bf16 pair ``rows_s[row + w]`` (key dims
    ``2w, 2w+1`` of a q or k row) times ``s_tile[2w, lane], s_tile[2w+1, lane]``, in that order.  Indices are
    unsigned (``primitives``: no wraparound code per load)."""
    acc = float32(0.0)
    for w in range(words):
        pair = rows_s[row + uint32(w)]
        acc += bf16x2_lo(pair) * s_tile[uint32(2 * w), lane]
        acc += bf16x2_hi(pair) * s_tile[uint32(2 * w + 1), lane]
    return acc


@device_fn
def _staged_row_times(acc, rows_s, row, count, cols_s, lane):
    """``acc + Σ_{m<count} rows_s[row + m] · cols_s[m, lane]``, in order: a staged f32 row of ``(I+L)⁻¹`` or
    ``intra`` (as bits) times column ``lane`` of R or U (unsigned indices)."""
    for m in range(count):
        acc += bits_f32(rows_s[row + m]) * cols_s[m, lane]
    return acc


@functools.cache
def _chunk_scan_kernel(key_dim: int, copy_async: bool):
    """Build the state-carrying kernel for key heads of ``key_dim`` dims (a compile-time constant: its dot products
    over the key dims are unrolled); ``copy_async``: stage rows with ``cp.async`` (``_stage_words``)."""
    KD = key_dim
    KW = key_dim // 2

    @bounded_kernel(SCAN_THREADS)
    def gated_delta_chunk_scan_kernel(qkv, qkv32, ssm_state, slot_ids, token_offsets, chunk_size, tinv32, intra32,
                                      gcum, beta, qk_inv, out):
        """The state-carrying half of the chunked form: walks each sequence's chunks in order.

        qkv ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (``qkv32``: the same bytes as flat uint32), ssm_state ``[slots, Hv,
        Dk, Dv]`` f32 (updated in place), the ``ChunkScratch`` arrays written by
        ``_chunk_prepare_kernel`` (``tinv32`` / ``intra32``: ``tinv`` / ``intra`` as flat uint32), out
        ``[tokens, Hv·Dv]`` bf16.  Per chunk ``[t0, t0+n)``, with ``S`` this block's ``[Dk, 32]`` column tile of
        the state (module docstring)::

            R_i   = beta_i · (v_i − exp(G_i)·Sᵀk_i)            step 1
            U     = (I+L)⁻¹ · R                                 step 2
            out_i = bf16(exp(G_i)·Sᵀq_i + Σ_{m≤i} intra[i,m]·U_m)      step 3 (3a: the first term, 3b: the sum)
            S     = exp(G_{n−1})·S + Σ_i exp(G_{n−1} − G_i)·k_i ⊗ U_i   step 4

        Rows of ``out`` of padding tokens -- after the last sequence (``token_offsets[B] :``) and those of a padding
        sequence (slot -1, ``state.sequence_table``) -- are set to zero; no state is read or written for them.

        Geometry: one block per (sequence, value head, tile of 32 value columns), grid-strided; the tile of S lives
        in shared memory for the whole sequence.  Lane ``l`` owns column ``l`` of the tile; warps stride over tokens
        (steps 1-3) or pairs of key rows (step 4); a barrier separates the steps.  Whatever a step reads row by row
        -- the chunk's k rows (steps 1, 4), ``(I+L)⁻¹`` (2), q rows (3a), ``intra`` (3b) -- is first copied into
        one shared buffer (``_stage_words``, all its 16-byte pieces in flight at once), so the inner loops read
        shared memory, the same word for every lane, instead of waiting on a global load per term.  Shared memory
        at Dk = 128: S 16 KB, R and U 8 KB each, the buffer 16 KB.  R holds 3a's first terms once step 2 is done
        with it, then step 4's weights ``exp(G_{n−1} − G_i)·|k_i|⁻¹`` in its column 0.
        """
        pdl_prologue()
        num_v_heads = ssm_state.shape[1]
        value_dim = ssm_state.shape[3]
        num_k_heads = qk_inv.shape[1]
        heads_per_key = num_v_heads // num_k_heads
        k_base = num_k_heads * KD
        v_base = 2 * k_base
        token_words = qkv.shape[1] // 2          # qkv32 words per token
        chunk_words = num_v_heads * chunk_size   # tinv32 / intra32 words per token
        tiles = (value_dim + COL_TILE - 1) // COL_TILE

        s_tile = cuda.shared.array((KD, COL_TILE), float32)
        r_s = cuda.shared.array((MAX_CHUNK, COL_TILE), float32)
        u_s = cuda.shared.array((MAX_CHUNK, COL_TILE), float32)
        rows_s = cuda.shared.array(STAGE_WORDS, uint32, alignment=16)   # staged rows, row i at i·(row words)

        zero_rows_from(out, token_offsets[slot_ids.shape[0]])  # padding rows
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        num_warps = cuda.blockDim.x // WARP
        # shared-memory indices in the inner loops are unsigned: numba then skips its negative-index wraparound
        # (a compare and select per access, which made the ALU this kernel's busiest pipe)
        ulane = uint32(lane)
        for item in range(cuda.blockIdx.x, slot_ids.shape[0] * num_v_heads * tiles, cuda.gridDim.x):
            tile = item % tiles
            h = (item // tiles) % num_v_heads
            seq = item // (tiles * num_v_heads)
            hk = h // heads_per_key
            seq_start = token_offsets[seq]
            seq_len = token_offsets[seq + 1] - seq_start
            if seq_len <= 0:
                continue  # an empty sequence leaves its slot alone (uniform across the block)
            slot = slot_ids[seq]
            j = tile * COL_TILE + lane
            has_col = j < value_dim
            if slot < 0:  # a padding sequence: its rows of this head's tile are zeros (uniform across the block)
                if has_col:
                    for i in range(warp, seq_len, num_warps):
                        out[seq_start + i, h * value_dim + j] = 0
                continue
            q_word = hk * KW                  # this key head's q, then k, in a token's qkv32 row
            k_word = (k_base + hk * KD) // 2
            for d in range(warp, KD, num_warps):
                s_tile[d, lane] = ssm_state[slot, h, d, j] if has_col else float32(0.0)
            for t0 in range(seq_start, seq_start + seq_len, chunk_size):
                n = min(chunk_size, seq_start + seq_len - t0)
                g_last = gcum[t0 + n - 1, h]
                _stage_words(qkv32, t0 * token_words + k_word, token_words, n, KW, rows_s, copy_async)
                _wait_copies()
                cuda.syncthreads()   # k rows staged; S loaded (first chunk) or carried (step 4 of the last)
                # step 1: targets against the state before the chunk
                for i in range(warp, n, num_warps):
                    t = t0 + i
                    v = bf16_to_f32(qkv[t, v_base + h * value_dim + j]) if has_col else float32(0.0)
                    decay = float32(math.exp(gcum[t, h]))
                    strength = beta[t, h]
                    k_inv = qk_inv[t, hk, 1]
                    sk = _state_dot(rows_s, uint32(i * KW), s_tile, ulane, KW)
                    r_s[i, lane] = strength * (v - decay * (sk * k_inv))
                cuda.syncthreads()
                # step 2: the deltas actually written, U = (I+L)⁻¹ R
                _stage_words(tinv32, (t0 * num_v_heads + h) * chunk_size, chunk_words, n, chunk_size, rows_s,
                             copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    u_s[i, lane] = _staged_row_times(float32(0.0), rows_s, uint32(i * chunk_size), uint32(i + 1), r_s,
                                                     ulane)
                cuda.syncthreads()
                # step 3a: what the old state returns for q_i, into R
                _stage_words(qkv32, t0 * token_words + q_word, token_words, n, KW, rows_s, copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    t = t0 + i
                    decay = float32(math.exp(gcum[t, h]))
                    q_inv = qk_inv[t, hk, 0]
                    sq = _state_dot(rows_s, uint32(i * KW), s_tile, ulane, KW)
                    r_s[i, lane] = decay * (sq * q_inv)
                cuda.syncthreads()
                # step 3b: plus attention inside the chunk
                _stage_words(intra32, (t0 * num_v_heads + h) * chunk_size, chunk_words, n, chunk_size, rows_s,
                             copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    o = _staged_row_times(r_s[i, lane], rows_s, uint32(i * chunk_size), uint32(i + 1), u_s, ulane)
                    if has_col:
                        out[t0 + i, h * value_dim + j] = f32_to_bf16(o)
                cuda.syncthreads()
                # step 4: carry the state to the end of the chunk (k rows again; the weights into R's column 0)
                _stage_words(qkv32, t0 * token_words + k_word, token_words, n, KW, rows_s, copy_async)
                for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                    r_s[i, 0] = float32(math.exp(g_last - gcum[t0 + i, h])) * qk_inv[t0 + i, hk, 1]
                _wait_copies()
                cuda.syncthreads()
                chunk_decay = float32(math.exp(g_last))
                for w in range(warp, KW, num_warps):   # key rows 2w and 2w + 1: one staged word holds both
                    acc_lo = float32(0.0)
                    acc_hi = float32(0.0)
                    for i in range(uint32(n)):
                        pair = rows_s[i * uint32(KW) + uint32(w)]
                        weight = r_s[i, 0]
                        delta = u_s[i, ulane]
                        acc_lo += bf16x2_lo(pair) * weight * delta
                        acc_hi += bf16x2_hi(pair) * weight * delta
                    s_tile[2 * w, lane] = s_tile[2 * w, lane] * chunk_decay + acc_lo
                    s_tile[2 * w + 1, lane] = s_tile[2 * w + 1, lane] * chunk_decay + acc_hi
                cuda.syncthreads()  # s_tile, r_s, u_s and rows_s are rewritten by the next chunk
            if has_col:
                for d in range(warp, KD, num_warps):
                    ssm_state[slot, h, d, j] = s_tile[d, lane]
            cuda.syncthreads()  # s_tile is reloaded by the block's next item

    return gated_delta_chunk_scan_kernel


def _aligned_16(a) -> bool:
    """Whether the array's first byte sits on a 16-byte boundary (``cp.async``'s 16-byte copies need it)."""
    cai = getattr(a, "__cuda_array_interface__", None)
    addr = cai["data"][0] if cai is not None else a.__array_interface__["data"][0]
    return addr % 16 == 0


def gated_delta_chunked(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out, scratch: ChunkScratch,
                        max_seq_tokens: int | None = None, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Gated delta rule for prompts, chunk by chunk (the result of ``reference_gated_delta``).  Shapes as in
    ``reference_gated_delta`` (``qkv`` contiguous); ``scratch`` from ``allocate_chunk_scratch`` (its chunk size is
    used); ``max_seq_tokens`` bounds any sequence's length (grid sizing only; defaults to T)."""
    check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    num_tokens = qkv.shape[0]
    if num_tokens == 0 or slot_ids.shape[0] == 0:
        return
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    assert scratch.max_tokens >= num_tokens, (scratch.max_tokens, num_tokens)
    assert scratch.tinv.shape[1] == num_v_heads and scratch.qk_inv.shape[1] == num_k_heads_of(qkv, ssm_state)
    chunk = scratch.chunk_size
    max_tokens = num_tokens if max_seq_tokens is None else max_seq_tokens
    max_chunks = max(1, -(-max_tokens // chunk))
    s = scratch
    launch(_chunk_prepare_kernel(key_dim), grid(slot_ids.shape[0] * max_chunks * num_v_heads, sim_cap=16),
           threads(gpu=128, sim=32), qkv, a, b, a_log, dt_bias, slot_ids, token_offsets, np.int32(chunk),
           np.int32(max_chunks), s.tinv, s.intra, s.gcum, s.beta, s.qk_inv, policy=policy)
    copy_async = (key_dim % 8 == 0 and qkv.shape[1] % 8 == 0 and chunk % 4 == 0 and _aligned_16(qkv)
                  and _aligned_16(s.tinv) and _aligned_16(s.intra))
    items = slot_ids.shape[0] * num_v_heads * (-(-value_dim // COL_TILE))
    launch(_chunk_scan_kernel(key_dim, copy_async), grid(items, sim_cap=8), threads(gpu=SCAN_THREADS, sim=32),
           qkv, as_words(qkv), ssm_state, slot_ids, token_offsets, np.int32(chunk), as_words(s.tinv), as_words(s.intra),
           s.gcum, s.beta, s.qk_inv, out, policy=policy)


