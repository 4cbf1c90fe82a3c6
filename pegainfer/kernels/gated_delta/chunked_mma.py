"""The gated delta rule for prompts in chunks, its products on tensor cores (``mma.sync.m16n8k16``, bf16 in, f32 sums).

The token-by-token rule (``reference.py``) with the work of a chunk done at once: the chunked ("WY / UT-transform")
form of flash-linear-attention.  Per chunk of C tokens and value head, with ``G_i`` the cumulative log decay from the
chunk start (``G_last`` at its last token), ``S [Dk, Dv]`` the state before the chunk, ``q, k, v`` the raw bf16
rows and ``q̂ = q·qinv``, ``k̂ = k·kinv`` their l2-normalised forms (``qinv`` includes ``1/sqrt(Dk)``)::

    L[i,m]     = beta_i · exp(G_i − G_m) · kinv_i·kinv_m · (k_i·k_m)      m < i     (K Kᵀ on tensor cores)
    Tinv       = (I + L)⁻¹                                                          (f32, blocked substitution)
    intra[i,m] = exp(G_i − G_m) · qinv_i·kinv_m · (q_i·k_m)                  m ≤ i     (Q Kᵀ on tensor cores)
    X          = K S                          R_i = beta_i·v_i − beta_i·exp(G_i)·kinv_i · X_i
    U          = Tinv R                       (the deltas written)
    o_i        = exp(G_i)·qinv_i · (Q S)_i + Σ_m intra[i,m] · U_m
    S_next     = exp(G_last) · S + Kᵀ · diag(exp(G_last − G_i)·kinv_i) · U

(Unrolling the recurrence inside a chunk gives ``U_i = R_i − Σ_{m<i} L[i,m] U_m``, i.e. ``(I + L) U = R``: ``R_i`` is
the delta token i would write against the state before the chunk, ``U_i`` the one it writes after the chunk's earlier
tokens.)

**Two kernels.**  ``_prepare_kernel`` does the state-independent part for every chunk in parallel: the Gram
products ``K Kᵀ`` and ``Q Kᵀ`` of a key head once for the value heads that share it, then per value head ``L``,
``Tinv`` and ``intra`` and the per-token factors.  ``_scan_kernel`` walks each sequence's chunks in order carrying
the state: ``X = K S`` and ``Q S``, ``U = Tinv R``, the outputs, the state update -- five products a chunk, all on
tensor cores, the state never leaving registers.

**Precision.**  Hugging Face's ``torch_chunk_gated_delta_rule`` runs all of this in f32 (FLA's Triton kernels round
``Tinv``, the state and ``U`` to bf16 before their products; the state then drifts ~1e-3 from the f32 rule).  Here
an operand that is not a raw bf16 input -- the state, ``R``, ``U``, ``Tinv``, ``intra`` -- goes into the tensor cores
as two bf16 parts, ``x ≈ hi + lo`` (``primitives.split_bf16x2``, 2⁻¹⁶ relative), and a product is the sum of the
part products: ``hi·k + lo·k`` against an exact bf16 ``k`` / ``q`` row, ``hi·hi' + lo·hi' + hi·lo'`` between two split
operands (``lo·lo'`` is below 2⁻¹⁶).  The norms, decays and write strengths scale rows and columns in f32 outside the
products, so ``K Kᵀ``, ``Q Kᵀ``, ``K S``, ``Q S`` and ``Kᵀ U`` multiply the raw bf16 q / k rows.  The result is the
f32 rule's to a few 1e-6 relative (states) and bf16 rounding (outputs):
``tests/kernels/test_gated_delta_chunked_mma.py``.

**The transposed state.**  The scan keeps ``Sᵀ [Dv, Dk]`` as mma accumulators: warp w of a block owns value columns
``16w .. 16w + 15`` of the block's slice -- one m16 tile of ``Sᵀ`` by all Dk, ``Dk / 2`` f32 a lane.  Every product
of the chunk is then computed transposed (``Xᵀ = Sᵀ Kᵀ``, ``Uᵀ = Rᵀ Tinvᵀ``, ``Oᵀ = …``, ``Sᵀ += Yᵀ K``), which lets
each accumulator feed the next product as its A operand straight from registers (the accumulators of n8 tiles
``2s, 2s+1`` are the A fragment of k16 step s, as FlashAttention's P), while the B operands -- rows of k, q,
``Tinv``, ``intra`` -- come from shared memory with ``ldmatrix`` (``.trans`` for ``K`` in the state update).  A
warp's columns never meet another warp's: no reduction across warps.

Shapes: qkv ``[T, 2·Hk·Dk + Hv·Dv]`` bf16 (q | k | v; value head h reads key head ``h // (Hv/Hk)``), a, b ``[T, Hv]``
bf16, a_log, dt_bias ``[Hv]`` f32, ssm_state ``[slots, Hv, Dk, Dv]`` f32 or bf16 bits (in place, rounded once a
launch), slot_ids ``[B]``,
token_offsets ``[B+1]`` int32, out ``[T, Hv·Dv]`` bf16; Dk a multiple of 16 (≤ 128), Dv of 8.  Geometry:
``geometry.ChunkGeometry``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.gated_delta.common import (MAX_CHUNK, check_rule_args, inverse_l2_norm, log_decay,
                                                  num_k_heads_of, state_codec, state_is_bf16, write_strength,
                                                  zero_rows_from)
from pegainfer.kernels.gated_delta.geometry import MMA_TILE, ChunkGeometry, chunk_geometry
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, shared_optin
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, array_address, as_words, bf16x2_hi, bf16x2_lo, bits_f32, cp_async_16,
                                          cp_async_commit, cp_async_wait_group, cuda, device_fn, float32, grid, kernel,
                                          ldmatrix_x4, ldmatrix_x4_trans, math, mma_bf16_m16n8k16, pack_bf16x2,
                                          pdl_prologue, split_bf16x2, uint32)

SCALES = 4
"""Per-token factors the prepare kernel leaves for the scan (``ChunkScratch.scales``): ``beta_i``, the write factor
``beta_i·exp(G_i)·kinv_i``, the read factor ``exp(G_i)·qinv_i`` and the carry factor ``exp(G_last − G_i)·kinv_i``."""


@dataclass
class ChunkScratch:
    """What the prepare kernel leaves for the scan (device arrays), sized for ``max_tokens`` tokens.

    tinv, intra ``[tokens, Hv, 2, padded]`` bf16: row ``i`` of the token's chunk matrices ``(I+L)⁻¹`` and ``intra``
      as a hi row and a lo row (``split_bf16x2``), zero past the diagonal and past ``chunk_size`` (``padded``: the
      chunk rounded up to 16);
    scales ``[tokens, Hv, 4]`` f32: ``SCALES``;  gcum ``[tokens, Hv]`` f32: ``G_i``.
    """
    tinv: object
    intra: object
    scales: object
    gcum: object
    chunk_size: int

    @property
    def max_tokens(self) -> int:
        return self.tinv.shape[0]

    @staticmethod
    def bytes_per_token(num_k_heads: int, num_v_heads: int, chunk_size: int) -> int:
        """Device bytes a token of ``allocate_chunk_scratch`` takes."""
        padded = MMA_TILE * -(-chunk_size // MMA_TILE)
        return num_v_heads * (2 * 2 * 2 * padded + 4 * (SCALES + 1))


def allocate_chunk_scratch(max_tokens: int, num_k_heads: int, num_v_heads: int,
                           chunk_size: int = MAX_CHUNK) -> ChunkScratch:
    """Device scratch for ``gated_delta_chunked`` over at most ``max_tokens`` tokens per call (allocate once)."""
    assert 1 <= chunk_size <= MAX_CHUNK, chunk_size
    n = max(1, max_tokens)
    padded = MMA_TILE * -(-chunk_size // MMA_TILE)
    return ChunkScratch(tinv=cuda.device_array((n, num_v_heads, 2, padded), np.uint16),
                        intra=cuda.device_array((n, num_v_heads, 2, padded), np.uint16),
                        scales=cuda.device_array((n, num_v_heads, SCALES), np.float32),
                        gcum=cuda.device_array((n, num_v_heads), np.float32), chunk_size=chunk_size)


@device_fn
def _lane_offset_a(lane, row_words):
    """Word offset, inside a 16-row tile of rows ``row_words`` words apart, of the row a lane gives ``ldmatrix``
    for an A fragment (rows 0-15 × the k16 step's two 16-byte chunks: a0..a3), or for ``ldmatrix .trans`` B
    fragments of two n8 tiles from ``[k, n]`` rows (b0, b1 of n8 tile 0 in r0, r1; of n8 tile 1 in r2, r3)."""
    return uint32((lane & 15) * row_words + 4 * (lane >> 4))


@device_fn
def _lane_offset_b(lane, row_words):
    """... of the row a lane gives ``ldmatrix`` for the B fragments of two n8 tiles from ``[n, k]`` rows (b0, b1 of
    n8 tile 0 in r0, r1; of n8 tile 1 in r2, r3)."""
    return uint32(((lane & 7) + 8 * (lane >> 4)) * row_words + 4 * ((lane >> 3) & 1))


@functools.cache
def _prepare_kernel(key_dim: int, tiles: int):
    """Build the state-independent kernel for key heads of ``key_dim`` dims and chunks of ``tiles`` 16-token
    tiles (closure constants: every loop over tiles and key dims unrolls)."""
    KD, CT = key_dim, tiles
    CP = MMA_TILE * CT                 # padded chunk rows
    NTHREADS = WARP * CT               # = 2·CP: one warp per 16-row tile; a thread per q or k row for the norms
    KROW = KD // 2 + 4                 # words a staged q / k row (4 spare: 8 rows' 16-byte chunks hit 8 bank groups)
    KCH = KD // 8                      # 16-byte chunks of a q / k row
    KSTEPS = KD // 16                  # k16 steps over the key dims
    NT8 = CP // 8                      # n8 tiles over the chunk's tokens
    G_REGS = 4 * NT8                   # a Gram tile: 16 rows × CP columns, 4 f32 a lane per n8 tile
    LROW = CP + 1                      # f32 words a row of L and of (I+L)⁻¹
    HALF = CP // 2                     # words of a hi or lo row in global scratch
    K_OFF, Q_OFF = 0, CP * KROW
    L_OFF = 2 * CP * KROW
    T_OFF = L_OFF + CP * LROW
    X_OFF = T_OFF + CP * LROW          # 16 rows: a block row of partial products of the blocked substitution
    KINV, QINV = X_OFF + MMA_TILE * LROW, X_OFF + MMA_TILE * LROW + CP
    GCUM, BETA = QINV + CP, QINV + 2 * CP
    wait_all = cp_async_wait_group(0)

    @kernel
    def gated_delta_chunk_prepare_mma_kernel(qkv32, a, b, a_log, dt_bias, token_offsets, num_k_heads, chunk_size,
                                             max_chunks, head_parts, tinv32, intra32, scales, gcum):
        """The state-independent half (module docstring) for chunk ``[t0, t0+n)`` of a sequence and key head ``hk``
        (grid-strided over (sequence, chunk < ``max_chunks``, key head, part < ``head_parts``)); per value head ``h``
        of the part's share of those reading ``hk`` (``head_parts`` blocks share a key head's value heads, each
        computing the key head's Gram products itself)::

            scales[t0+i, h] = (beta_i, beta_i·exp(G_i)·kinv_i, exp(G_i)·qinv_i, exp(G_last − G_i)·kinv_i)
            gcum[t0+i, h]   = G_i
            tinv[t0+i, h]   = (I+L)⁻¹ row i, intra[t0+i, h] = intra row i     (hi row, lo row; i < n)

        qkv32: the bf16 qkv rows as flat uint32 (16-byte aligned; row width a multiple of 8 bf16); tinv32, intra32:
        ``ChunkScratch.tinv`` / ``intra`` as flat uint32.

        Geometry: ``tiles`` warps; warp w owns chunk rows ``16w .. 16w+15``.  Steps, with barriers between:

        1. the chunk's k and q rows into shared memory (``cp.async``, rows past n zero-filled);
        2. the l2 norms, a thread per row (the Gram products run beside them);
        3. ``K Kᵀ`` and ``Q Kᵀ`` for the warp's 16 rows × all CP columns (``ldmatrix``, mma; raw bf16 rows, f32
           sums) -- held in registers over the value heads;
        4. per value head: g and beta (a thread per token), their running sum (one thread), the per-token factors;
           ``L`` into shared memory and ``intra`` (split into hi / lo) to global memory from the accumulators;
        5. ``Tinv = (I+L)⁻¹`` in f32: the 16×16 diagonal blocks by forward substitution (a thread per column), then
           block row by block row ``Tinv[I,J] = −Tinv[I,I] · Σ_{J≤P<I} L[I,P] · Tinv[P,J]`` (a thread per entry);
           its rows split into hi / lo to global memory.
        """
        pdl_prologue()
        smem = cuda.shared.array(0, nbtypes.uint32)
        smemf = cuda.shared.array(0, nbtypes.float32)      # the same bytes as f32
        kk = cuda.local.array(G_REGS, float32)               # K Kᵀ: n8 tile j at 4j (rows g, g+8 × cols 2t, 2t+1)
        qk = cuda.local.array(G_REGS, float32)               # Q Kᵀ
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        tq = lane & 3
        num_v_heads = a.shape[1]
        heads_per_key = num_v_heads // num_k_heads
        token_words = qkv32.shape[0] // a.shape[0]          # qkv32 words a token
        q_scale = float32(1.0) / float32(math.sqrt(float32(KD)))
        a_lane = _lane_offset_a(lane, KROW)
        b_lane = _lane_offset_b(lane, KROW)
        heads_per_part = heads_per_key // head_parts
        for item in range(cuda.blockIdx.x, (token_offsets.shape[0] - 1) * max_chunks * num_k_heads * head_parts,
                          cuda.gridDim.x):
            head_part = item % head_parts
            hk = (item // head_parts) % num_k_heads
            chunk = (item // (head_parts * num_k_heads)) % max_chunks
            seq = item // (head_parts * num_k_heads * max_chunks)
            t0 = token_offsets[seq] + chunk * chunk_size
            n = min(chunk_size, token_offsets[seq + 1] - t0)
            if n <= 0:
                continue                                    # uniform across the block
            # 1. k rows, then q rows (rows past n: zeros, read nothing)
            q_word = hk * (KD // 2)
            k_word = num_k_heads * (KD // 2) + q_word
            for idx in range(tid, 2 * CP * KCH, NTHREADS):
                part = idx // (CP * KCH)
                i = (idx // KCH) % CP
                c = idx % KCH
                src = (t0 + min(i, n - 1)) * token_words + (q_word if part else k_word) + 4 * c
                cp_async_16(smem, uint32(part * Q_OFF + i * KROW + 4 * c), qkv32, src, 16 if i < n else 0)
            cp_async_commit()
            wait_all()
            cuda.syncthreads()
            # 2. l2 norms: thread r < CP takes k row r, thread CP + r q row r
            row = tid % CP
            part = tid // CP
            base = uint32(part * Q_OFF + row * KROW)
            ss = float32(0.0)
            for w in range(KD // 2):
                pair = smem[base + uint32(w)]
                lo = bf16x2_lo(pair)
                hi = bf16x2_hi(pair)
                ss += lo * lo + hi * hi
            if part:
                smemf[QINV + row] = inverse_l2_norm(ss) * q_scale
            else:
                smemf[KINV + row] = inverse_l2_norm(ss)
            # 3. K Kᵀ and Q Kᵀ, rows 16·warp .. +15 of the chunk, all columns
            for i in range(4 * NT8):
                kk[i] = float32(0.0)
                qk[i] = float32(0.0)
            for ks in range(KSTEPS):
                a_at = uint32(16 * warp * KROW + 8 * ks) + a_lane
                ka0, ka1, ka2, ka3 = ldmatrix_x4(smem, uint32(K_OFF) + a_at)
                qa0, qa1, qa2, qa3 = ldmatrix_x4(smem, uint32(Q_OFF) + a_at)
                for j2 in range(CT):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, uint32(K_OFF + 16 * j2 * KROW + 8 * ks) + b_lane)
                    o = 8 * j2
                    kk[o], kk[o + 1], kk[o + 2], kk[o + 3] = mma_bf16_m16n8k16(
                        ka0, ka1, ka2, ka3, b0, b1, kk[o], kk[o + 1], kk[o + 2], kk[o + 3])
                    kk[o + 4], kk[o + 5], kk[o + 6], kk[o + 7] = mma_bf16_m16n8k16(
                        ka0, ka1, ka2, ka3, b2, b3, kk[o + 4], kk[o + 5], kk[o + 6], kk[o + 7])
                    qk[o], qk[o + 1], qk[o + 2], qk[o + 3] = mma_bf16_m16n8k16(
                        qa0, qa1, qa2, qa3, b0, b1, qk[o], qk[o + 1], qk[o + 2], qk[o + 3])
                    qk[o + 4], qk[o + 5], qk[o + 6], qk[o + 7] = mma_bf16_m16n8k16(
                        qa0, qa1, qa2, qa3, b2, b3, qk[o + 4], qk[o + 5], qk[o + 6], qk[o + 7])
            cuda.syncthreads()                              # the norms are in

            h0 = hk * heads_per_key + head_part * heads_per_part
            for h in range(h0, h0 + heads_per_part):
                # 4. decay and write strength a token, their running sum, the per-token factors
                if tid < CP:
                    gi = float32(0.0)
                    bi = float32(0.0)
                    if tid < n:
                        gi = log_decay(a[t0 + tid, h], a_log[h], dt_bias[h])
                        bi = write_strength(b[t0 + tid, h])
                    smemf[GCUM + tid] = gi
                    smemf[BETA + tid] = bi
                cuda.syncthreads()
                if tid == 0:
                    run = float32(0.0)
                    for i in range(n):
                        run += smemf[GCUM + i]
                        smemf[GCUM + i] = run
                cuda.syncthreads()
                g_last = smemf[GCUM + n - 1]
                for i in range(tid, n, NTHREADS):
                    gi = smemf[GCUM + i]
                    e_g = float32(math.exp(gi))
                    kinv = smemf[KINV + i]
                    s_at = ((t0 + i) * num_v_heads + h) * 4
                    scales[s_at] = smemf[BETA + i]
                    scales[s_at + 1] = smemf[BETA + i] * e_g * kinv
                    scales[s_at + 2] = e_g * smemf[QINV + i]
                    scales[s_at + 3] = float32(math.exp(g_last - gi)) * kinv
                    gcum[t0 + i, h] = gi
                # L into shared memory, intra (hi, lo) to global memory: entry e of n8 tile j is row
                # i = 16·warp + g + 8·(e >> 1), column m = 8j + 2·tq + (e & 1)
                for j in range(NT8):
                    for half in range(2):
                        i = 16 * warp + g + 8 * half
                        vals_l0 = float32(0.0)
                        vals_l1 = float32(0.0)
                        vals_q0 = float32(0.0)
                        vals_q1 = float32(0.0)
                        if i < n:
                            gi = smemf[GCUM + i]
                            bk = smemf[BETA + i] * smemf[KINV + i]
                            qi = smemf[QINV + i]
                            for c in range(2):
                                m = 8 * j + 2 * tq + c
                                if m <= i:
                                    decay = float32(math.exp(gi - smemf[GCUM + m])) * smemf[KINV + m]
                                    lv = bk * decay * kk[4 * j + 2 * half + c] if m < i else float32(0.0)
                                    qv = qi * decay * qk[4 * j + 2 * half + c]
                                    if c == 0:
                                        vals_l0 = lv
                                        vals_q0 = qv
                                    else:
                                        vals_l1 = lv
                                        vals_q1 = qv
                        m0 = 8 * j + 2 * tq
                        smemf[L_OFF + i * LROW + m0] = vals_l0
                        smemf[L_OFF + i * LROW + m0 + 1] = vals_l1
                        if i < n:
                            hi, lo = split_bf16x2(vals_q0, vals_q1)
                            at = ((t0 + i) * num_v_heads + h) * CP + m0 // 2
                            intra32[at] = hi
                            intra32[at + HALF] = lo
                cuda.syncthreads()
                # 5a. diagonal 16×16 blocks of (I+L)⁻¹: thread 16·bk + c solves column c of block bk
                if tid < 16 * CT:
                    d0 = MMA_TILE * (tid // 16)
                    c = tid % 16
                    for r in range(16):
                        x = float32(0.0)
                        if r == c:
                            x = float32(1.0)
                        elif r > c:
                            for p in range(c, r):
                                x -= smemf[L_OFF + (d0 + r) * LROW + d0 + p] * smemf[T_OFF + (d0 + p) * LROW + d0 + c]
                        smemf[T_OFF + (d0 + r) * LROW + d0 + c] = x
                cuda.syncthreads()
                # 5b. the blocks below the diagonal, block row by block row
                for bi_ in range(1, CT):
                    r0 = MMA_TILE * bi_
                    for e in range(tid, 256 * bi_, NTHREADS):      # X[r, c'] = Σ_{P<I} L[I,P] · Tinv[P,J]
                        bj = e // 256
                        r = (e // 16) % 16
                        c = MMA_TILE * bj + e % 16
                        x = float32(0.0)
                        for p in range(MMA_TILE * bj, r0):
                            x += smemf[L_OFF + (r0 + r) * LROW + p] * smemf[T_OFF + p * LROW + c]
                        smemf[X_OFF + r * LROW + c] = x
                    cuda.syncthreads()
                    for e in range(tid, 256 * bi_, NTHREADS):      # Tinv[I,J] = −Tinv[I,I] · X
                        r = (e // 16) % 16
                        c = MMA_TILE * (e // 256) + e % 16
                        x = float32(0.0)
                        for p in range(r + 1):
                            x -= smemf[T_OFF + (r0 + r) * LROW + r0 + p] * smemf[X_OFF + p * LROW + c]
                        smemf[T_OFF + (r0 + r) * LROW + c] = x
                    cuda.syncthreads()
                # 5c. rows i < n of (I+L)⁻¹ (zero past the diagonal) to global memory, hi row then lo row
                for e in range(tid, n * HALF, NTHREADS):
                    i = e // HALF
                    m = 2 * (e % HALF)
                    x0 = smemf[T_OFF + i * LROW + m] if m <= i else float32(0.0)
                    x1 = smemf[T_OFF + i * LROW + m + 1] if m + 1 <= i else float32(0.0)
                    hi, lo = split_bf16x2(x0, x1)
                    at = ((t0 + i) * num_v_heads + h) * CP + e % HALF
                    tinv32[at] = hi
                    tinv32[at + HALF] = lo
                cuda.syncthreads()                          # the scalars, L and Tinv are rewritten next

    return gated_delta_chunk_prepare_mma_kernel


@functools.cache
def _scan_kernel(key_dim: int, value_dim: int, tiles: int, warps: int, stages: int, state_bf16: bool = False):
    """Build the state-carrying kernel for one head shape and geometry (closure constants: the register tiles and
    every loop over them unroll), for a state of f32 or (``state_bf16``) bf16 bits (``common.state_codec``)."""
    KD, DV, CT, STAGES = key_dim, value_dim, tiles, stages
    load_state, store_state = state_codec(state_bf16)
    CP = MMA_TILE * CT                  # padded chunk rows
    NC = 16 * warps                     # value columns of a block
    NTHREADS = WARP * warps
    KROW = KD // 2 + 4                  # words a staged q / k row
    CROW = CP // 2 + 4                  # words a staged hi or lo row of Tinv / intra
    VROW = NC // 2 + 4                  # words a staged v row (the block's columns)
    OROW = NC + 4                       # f32 words a row of the output tile
    KCH, CCH, VCH = KD // 8, CP // 8, NC // 8          # 16-byte chunks a row
    HALF = CP // 2
    KSTEPS = KD // 16
    NT8 = CP // 8
    C_REGS = 4 * NT8                    # a [16 columns, CP tokens] tile: n8 tile jt at 4·jt
    S_REGS = 4 * (KD // 8)              # the state tile: n8 tile jd of Sᵀ (key dims 8jd ..) at 4·jd
    K_OFF, Q_OFF = 0, CP * KROW
    T_OFF = 2 * CP * KROW               # Tinv: CP hi rows, then CP lo rows
    I_OFF = T_OFF + 2 * CP * CROW       # intra: the same
    V_OFF = I_OFF + 2 * CP * CROW
    SC_OFF = V_OFF + CP * VROW          # SCALES f32 a token
    STAGE = SC_OFF + SCALES * CP
    O_OFF = STAGES * STAGE              # the f32 output tile
    wait_all = cp_async_wait_group(0)
    wait_one = cp_async_wait_group(1)

    @device_fn
    def stage_chunk(smem, stage, qkv32, t0, n, token_words, q_word, k_word, v_word, v_cols, tinv32, intra32,
                    scales32, head_row, num_v_heads, tid):
        """Start this thread's ``cp.async`` copies of the chunk ``[t0, t0+n)`` into the stage at word ``stage``:
        k and q rows, the hi and lo rows of Tinv and intra, the v tile (``v_cols`` real columns) and the scalars;
        rows past n (and v columns past ``v_cols``) zero-filled.  ``head_row``: the value head's index in a
        token's ``[Hv, …]`` scratch rows."""
        for idx in range(tid, 2 * CP * KCH, NTHREADS):
            part = idx // (CP * KCH)
            i = (idx // KCH) % CP
            c = idx % KCH
            src = (t0 + min(i, n - 1)) * token_words + (q_word if part else k_word) + 4 * c
            cp_async_16(smem, uint32(stage + part * Q_OFF + i * KROW + 4 * c), qkv32, src, 16 if i < n else 0)
        for idx in range(tid, 4 * CP * CCH, NTHREADS):
            mat = idx // (2 * CP * CCH)            # 0: Tinv, 1: intra
            r = (idx // CCH) % (2 * CP)            # hi rows 0 .. CP-1, lo rows CP ..
            i = r % CP
            c = idx % CCH
            src = (((t0 + min(i, n - 1)) * num_v_heads + head_row) * 2 + r // CP) * HALF + 4 * c
            dst = uint32(stage + T_OFF + mat * 2 * CP * CROW + r * CROW + 4 * c)
            if mat:
                cp_async_16(smem, dst, intra32, src, 16 if i < n else 0)
            else:
                cp_async_16(smem, dst, tinv32, src, 16 if i < n else 0)
        for idx in range(tid, CP * VCH, NTHREADS):
            i = idx // VCH
            c = idx % VCH
            src = (t0 + min(i, n - 1)) * token_words + v_word + 4 * min(c, max(v_cols // 8 - 1, 0))
            cp_async_16(smem, uint32(stage + V_OFF + i * VROW + 4 * c), qkv32, src,
                        16 if i < n and 8 * c < v_cols else 0)
        for i in range(tid, CP, NTHREADS):
            src = ((t0 + min(i, n - 1)) * num_v_heads + head_row) * SCALES
            cp_async_16(smem, uint32(stage + SC_OFF + i * SCALES), scales32, src, 16 if i < n else 0)
        cp_async_commit()

    @device_fn
    def state_times_rows(xa, pa, st, fa, smem, k_at, q_at):
        """``xa = Sᵀ · Kᵀ``, ``pa = Sᵀ · Qᵀ`` over the key dims: the warp's state tile (``st``, split into hi / lo per
        k16 step through ``fa``) times the chunk's CP staged k and q rows at words ``k_at`` / ``q_at`` (the lane's
        ``ldmatrix`` offset included), exact bf16: 2 mma per n8 tile of tokens, k16 step and product.  (Both in
        one pass: the state's split is made once; done twice, the compiler keeps the first one's 128 words live
        for the second.)"""
        for i in range(C_REGS):
            xa[i] = float32(0.0)
            pa[i] = float32(0.0)
        for ks in range(KSTEPS):
            for r in range(4):
                fa[r], fa[4 + r] = split_bf16x2(st[8 * ks + 2 * r], st[8 * ks + 2 * r + 1])
            for j2 in range(CT):
                o = 8 * j2
                for which in range(2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, (q_at if which else k_at) + uint32(16 * j2 * KROW + 8 * ks))
                    for part in range(2):
                        p = 4 * part
                        if which:
                            pa[o], pa[o + 1], pa[o + 2], pa[o + 3] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b0, b1, pa[o], pa[o + 1], pa[o + 2], pa[o + 3])
                            pa[o + 4], pa[o + 5], pa[o + 6], pa[o + 7] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b2, b3,
                                pa[o + 4], pa[o + 5], pa[o + 6], pa[o + 7])
                        else:
                            xa[o], xa[o + 1], xa[o + 2], xa[o + 3] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b0, b1, xa[o], xa[o + 1], xa[o + 2], xa[o + 3])
                            xa[o + 4], xa[o + 5], xa[o + 6], xa[o + 7] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b2, b3,
                                xa[o + 4], xa[o + 5], xa[o + 6], xa[o + 7])

    @device_fn
    def split_times_rows(acc, src, fa, smem, rows_at):
        """``acc += srcᵀ-tile · Mᵀ`` over the chunk's tokens m, for a lower-triangular ``M`` (``Tinv`` or ``intra``)
        staged as CP hi rows then CP lo rows at word ``rows_at`` (the lane's ``ldmatrix`` offset included): ``src``'s
        accumulators (n8 tiles 2s, 2s + 1 = the A fragment of k16 step s) split into hi / lo, 3 mma per n8 tile and
        step (hi·hi, lo·hi, hi·lo); token tiles j2 < s are zero blocks of M, skipped."""
        for s in range(CT):
            for r in range(4):
                fa[r], fa[4 + r] = split_bf16x2(src[8 * s + 2 * r], src[8 * s + 2 * r + 1])
            for j2 in range(CT):
                if j2 < s:
                    continue                        # (a fixed-count loop: unrolled, the test folds away)
                at = rows_at + uint32(16 * j2 * CROW + 8 * s)
                h0, h1, h2, h3 = ldmatrix_x4(smem, at)
                l0, l1, l2, l3 = ldmatrix_x4(smem, at + uint32(CP * CROW))
                o = 8 * j2
                for part in range(3):
                    p = 4 if part == 1 else 0
                    c0, c1, c2, c3 = (l0, l1, l2, l3) if part == 2 else (h0, h1, h2, h3)
                    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16_m16n8k16(
                        fa[p], fa[p + 1], fa[p + 2], fa[p + 3], c0, c1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                    acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7] = mma_bf16_m16n8k16(
                        fa[p], fa[p + 1], fa[p + 2], fa[p + 3], c2, c3,
                        acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7])

    @bounded_kernel(NTHREADS, warps)
    def gated_delta_chunk_scan_mma_kernel(qkv32, ssm_state, slot_ids, token_offsets, num_k_heads, chunk_size,
                                          tinv32, intra32, scales32, gcum, out, out32):
        """The state-carrying half (module docstring), for a (sequence, value head, slice of ``16 · warps`` value
        columns) work item, grid-strided: the chunks of the sequence in order.  ``tinv32`` / ``intra32`` /
        ``scales32``: the ``ChunkScratch`` arrays as flat uint32; ``out32``: ``out`` as flat uint32.  Rows of
        ``out`` of padding tokens -- after the last sequence, and those of a padding sequence (slot -1,
        ``state.sequence_table``) -- are set to zero; no state is read or written for them.

        Per chunk, warp w (value columns ``16w ..`` of the slice; the lane's state entries are those of the
        accumulator layout: columns g, g + 8 × key dims 8jd + 2t, +1):

        1. ``Xᵀ = Sᵀ Kᵀ`` and ``Sᵀ Qᵀ`` (``state_times_rows``: per k16 step of Dk the state's A fragment split into
           hi / lo, the k and q rows' B fragments by ``ldmatrix``);
        2. ``Rᵀ[j,i] = beta_i·v[i,j] − (write factor)_i · Xᵀ[j,i]`` in the accumulators;
        3. ``Uᵀ = Rᵀ Tinvᵀ`` (``split_times_rows``: R's accumulators as A fragments, Tinv's hi / lo rows as B; the
           blocks above the diagonal skipped);
        4. ``Oᵀ = (read factor) ⊙ Sᵀ Qᵀ + Uᵀ intraᵀ`` likewise, staged as f32 in shared memory and written out as
           bf16 rows after a barrier;
        5. ``Sᵀ = exp(G_last)·Sᵀ + Yᵀ K`` with ``Yᵀ[j,i] = Uᵀ[j,i] · (carry factor)_i``: Y's accumulators as A
           fragments, K's B fragments by ``ldmatrix .trans`` from the same k rows.

        Shared memory: ``stages`` stages of the chunk's tiles (``stage_chunk``), then the output tile.  With 2
        stages the next chunk's copies are issued before this chunk is computed.  Indices into shared memory are
        uint32 (no wraparound code).
        """
        pdl_prologue()
        smem = cuda.shared.array(0, nbtypes.uint32)
        smemf = cuda.shared.array(0, nbtypes.float32)
        st = cuda.local.array(S_REGS, float32)          # Sᵀ: this warp's 16 columns × Dk
        xa = cuda.local.array(C_REGS, float32)          # Xᵀ, then Rᵀ
        pa = cuda.local.array(C_REGS, float32)          # Sᵀ Qᵀ, then Oᵀ
        ua = cuda.local.array(C_REGS, float32)          # Uᵀ, then Yᵀ
        fa = cuda.local.array(8, uint32)                # A fragment: hi a0..a3, lo a0..a3
        num_v_heads = ssm_state.shape[1]
        heads_per_key = num_v_heads // num_k_heads
        token_words = (2 * num_k_heads * KD + num_v_heads * DV) // 2
        slices = (DV + NC - 1) // NC
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        tq = lane & 3
        a_k = _lane_offset_a(lane, KROW)               # ldmatrix .trans of K (step 5)
        b_k = _lane_offset_b(lane, KROW)               # B fragments of Kᵀ / Qᵀ (step 1)
        b_c = _lane_offset_b(lane, CROW)               # B fragments of Tinvᵀ / intraᵀ (steps 3, 4)
        col_w = 16 * warp                              # the warp's first column in the slice
        zero_rows_from(out, token_offsets[slot_ids.shape[0]])     # padding rows

        for item in range(cuda.blockIdx.x, slot_ids.shape[0] * num_v_heads * slices, cuda.gridDim.x):
            sl = item % slices
            h = (item // slices) % num_v_heads
            seq = item // (slices * num_v_heads)
            seq_start = token_offsets[seq]
            seq_end = token_offsets[seq + 1]
            if seq_end <= seq_start:
                continue                               # an empty sequence leaves its slot alone (uniform)
            slot = slot_ids[seq]
            hk = h // heads_per_key
            col0 = sl * NC
            v_cols = min(NC, DV - col0)
            if slot < 0:     # a padding sequence: its rows of this slice are zeros, no state touched (uniform)
                for idx in range(tid, (seq_end - seq_start) * v_cols, NTHREADS):
                    out[seq_start + idx // v_cols, h * DV + col0 + idx % v_cols] = 0
                continue
            q_word = hk * (KD // 2)
            k_word = num_k_heads * (KD // 2) + q_word
            v_word = (2 * num_k_heads * KD + h * DV + col0) // 2
            for jd in range(KD // 8):
                for e in range(4):
                    d = 8 * jd + 2 * tq + (e & 1)
                    j = col0 + col_w + g + 8 * (e >> 1)
                    st[4 * jd + e] = load_state(ssm_state[slot, h, d, j]) if j < DV else float32(0.0)
            n_chunks = (seq_end - seq_start + chunk_size - 1) // chunk_size
            stage_chunk(smem, uint32(0), qkv32, seq_start, min(chunk_size, seq_end - seq_start), token_words, q_word,
                        k_word, v_word, v_cols, tinv32, intra32, scales32, h, num_v_heads, tid)
            for ci in range(n_chunks):
                t0 = seq_start + ci * chunk_size
                n = min(chunk_size, seq_end - t0)
                sb = uint32((ci % STAGES) * STAGE)
                if STAGES == 2 and ci + 1 < n_chunks:
                    t1 = t0 + chunk_size
                    stage_chunk(smem, uint32(((ci + 1) % STAGES) * STAGE), qkv32, t1, min(chunk_size, seq_end - t1),
                                token_words, q_word, k_word, v_word, v_cols, tinv32, intra32, scales32, h,
                                num_v_heads, tid)
                    wait_one()
                else:
                    wait_all()
                decay = float32(math.exp(gcum[t0 + n - 1, h]))
                cuda.syncthreads()                     # the chunk's tiles are in

                # 1. Xᵀ = Sᵀ Kᵀ and Sᵀ Qᵀ
                state_times_rows(xa, pa, st, fa, smem, sb + uint32(K_OFF) + b_k, sb + uint32(Q_OFF) + b_k)
                # 2. Rᵀ = beta ⊙ Vᵀ − (write factor) ⊙ Xᵀ
                for jt in range(NT8):
                    for e in range(4):
                        i = uint32(8 * jt + 2 * tq + (e & 1))
                        jl = col_w + g + 8 * (e >> 1)
                        word = smem[sb + uint32(V_OFF) + i * uint32(VROW) + uint32(jl >> 1)]
                        v = bf16x2_hi(word) if jl & 1 else bf16x2_lo(word)
                        sc = sb + uint32(SC_OFF) + i * uint32(SCALES)
                        xa[4 * jt + e] = bits_f32(smem[sc]) * v - bits_f32(smem[sc + uint32(1)]) * xa[4 * jt + e]
                # 3. Uᵀ = Rᵀ Tinvᵀ
                for i in range(C_REGS):
                    ua[i] = float32(0.0)
                split_times_rows(ua, xa, fa, smem, sb + uint32(T_OFF) + b_c)
                # 4. Oᵀ = (read factor) ⊙ Sᵀ Qᵀ + Uᵀ intraᵀ, into the output tile
                for jt in range(NT8):
                    for e in range(4):
                        i = uint32(8 * jt + 2 * tq + (e & 1))
                        pa[4 * jt + e] *= bits_f32(smem[sb + uint32(SC_OFF + 2) + i * uint32(SCALES)])
                split_times_rows(pa, ua, fa, smem, sb + uint32(I_OFF) + b_c)
                for jt in range(NT8):
                    for e in range(4):
                        i = uint32(8 * jt + 2 * tq + (e & 1))
                        jl = uint32(col_w + g + 8 * (e >> 1))
                        smemf[uint32(O_OFF) + i * uint32(OROW) + jl] = pa[4 * jt + e]

                # 5. Sᵀ = exp(G_last)·Sᵀ + Yᵀ K, Yᵀ = Uᵀ ⊙ (carry factor)
                for jt in range(NT8):
                    for e in range(4):
                        i = uint32(8 * jt + 2 * tq + (e & 1))
                        ua[4 * jt + e] *= bits_f32(smem[sb + uint32(SC_OFF + 3) + i * uint32(SCALES)])
                for i in range(S_REGS):
                    st[i] *= decay
                for s in range(CT):
                    for r in range(4):
                        fa[r], fa[4 + r] = split_bf16x2(ua[8 * s + 2 * r], ua[8 * s + 2 * r + 1])
                    for dp in range(KSTEPS):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(smem, sb + uint32(K_OFF + 16 * s * KROW + 8 * dp) + a_k)
                        o = 8 * dp
                        for part in range(2):
                            p = 4 * part
                            st[o], st[o + 1], st[o + 2], st[o + 3] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b0, b1, st[o], st[o + 1], st[o + 2], st[o + 3])
                            st[o + 4], st[o + 5], st[o + 6], st[o + 7] = mma_bf16_m16n8k16(
                                fa[p], fa[p + 1], fa[p + 2], fa[p + 3], b2, b3,
                                st[o + 4], st[o + 5], st[o + 6], st[o + 7])
                cuda.syncthreads()                     # the output tile is whole; the stage is free
                for e in range(tid, n * (NC // 2), NTHREADS):
                    i = uint32(e // (NC // 2))
                    w = uint32(e % (NC // 2))
                    if 2 * w < uint32(v_cols):
                        at = uint32(O_OFF) + i * uint32(OROW) + 2 * w
                        out32[((t0 + i) * num_v_heads * DV + h * DV + col0) // 2 + w] = pack_bf16x2(smemf[at],
                                                                                                 smemf[at + 1])
                if STAGES == 1 and ci + 1 < n_chunks:
                    t1 = t0 + chunk_size
                    stage_chunk(smem, uint32(0), qkv32, t1, min(chunk_size, seq_end - t1), token_words, q_word, k_word,
                                v_word, v_cols, tinv32, intra32, scales32, h, num_v_heads, tid)
            for jd in range(KD // 8):
                for e in range(4):
                    d = 8 * jd + 2 * tq + (e & 1)
                    j = col0 + col_w + g + 8 * (e >> 1)
                    if j < DV:
                        ssm_state[slot, h, d, j] = store_state(st[4 * jd + e])
            cuda.syncthreads()                         # the output tile is rewritten by the next item

    return gated_delta_chunk_scan_mma_kernel


def _aligned_16(a) -> bool:
    """Whether the array's first byte sits on a 16-byte boundary (``cp.async``'s 16-byte copies need it)."""
    return array_address(a) % 16 == 0


def gated_delta_chunked(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out,
                        scratch: ChunkScratch, max_seq_tokens: int | None = None, *,
                        geometry: ChunkGeometry | None = None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Gated delta rule for prompts, chunk by chunk on tensor cores (the result of ``reference_gated_delta``).
    Shapes as in ``reference_gated_delta`` (``qkv`` and ``out`` contiguous, ``qkv`` 16-byte aligned); ``scratch``
    from ``allocate_chunk_scratch`` (its chunk size is used); ``max_seq_tokens`` bounds any sequence's length (grid
    sizing only; defaults to T); ``geometry`` forces the launch geometry (tests, benchmarks), by default
    ``chunk_geometry`` (which reads the policy)."""
    check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    num_tokens = qkv.shape[0]
    if num_tokens == 0 or slot_ids.shape[0] == 0:
        return
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    num_k_heads = num_k_heads_of(qkv, ssm_state)
    geo = geometry or chunk_geometry(key_dim, value_dim, scratch.chunk_size, policy)
    geo.check(key_dim, value_dim)
    if geo.chunk != scratch.chunk_size:
        raise ValueError(f"gated delta geometry chunk {geo.chunk} != the scratch's {scratch.chunk_size}: allocate the "
                         "scratch with the geometry's chunk")
    if not _aligned_16(qkv):
        raise ValueError("gated_delta_chunked (tensor cores): qkv must start on a 16-byte boundary (cp.async copies)")
    assert scratch.max_tokens >= num_tokens, (scratch.max_tokens, num_tokens)
    assert scratch.tinv.shape[1:] == (num_v_heads, 2, geo.padded), (scratch.tinv.shape, num_v_heads, geo.padded)
    for words, what in ((geo.prepare_shared_words(key_dim), "prepare"), (geo.scan_shared_words(key_dim), "scan")):
        if 4 * words > shared_optin():
            raise ValueError(f"gated delta {what} geometry {tuple(geo)} needs {4 * words} bytes of shared memory at "
                             f"Dk {key_dim}; the GPU allows {shared_optin()}: fewer scan warps or stages")
    max_tokens = num_tokens if max_seq_tokens is None else max_seq_tokens
    max_chunks = max(1, -(-max_tokens // geo.chunk))
    num_seqs = slot_ids.shape[0]
    qkv32 = as_words(qkv)
    s = scratch
    # chunks with work: padding sequences (a mixed step's, a graph's) have none, so count the tokens' chunks
    work_chunks = min(num_seqs * max_chunks, -(-num_tokens // geo.chunk))
    parts = geo.prepare_parts(work_chunks * num_k_heads, num_v_heads // num_k_heads)
    launch(_prepare_kernel(key_dim, geo.tiles), grid(num_seqs * max_chunks * num_k_heads * parts, sim_cap=16),
           WARP * geo.tiles, qkv32, a, b, a_log, dt_bias, token_offsets, np.int32(num_k_heads), np.int32(geo.chunk),
           np.int32(max_chunks), np.int32(parts), as_words(s.tinv), as_words(s.intra), s.scales.reshape(-1), s.gcum,
           shared=4 * geo.prepare_shared_words(key_dim), name="gated_delta_chunk_prepare", policy=policy)
    items = num_seqs * num_v_heads * -(-value_dim // geo.scan_columns)
    launch(_scan_kernel(key_dim, value_dim, geo.tiles, geo.scan_warps, geo.scan_stages, state_is_bf16(ssm_state)),
           grid(items, sim_cap=8),
           WARP * geo.scan_warps, qkv32, ssm_state, slot_ids, token_offsets, np.int32(num_k_heads),
           np.int32(geo.chunk), as_words(s.tinv), as_words(s.intra), as_words(s.scales), s.gcum, out, as_words(out),
           shared=4 * geo.scan_shared_words(key_dim), name="gated_delta_chunk_scan", policy=policy)


