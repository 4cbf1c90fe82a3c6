"""Tiled prefill attention (FlashAttention-2 style) on tensor cores: prompt chunks of ``PREFILL_MIN_TOKENS`` tokens
and more.

Math (``__init__``'s docstring): ``out[t, h] = bf16(softmax(scale · q K^T) V)`` over keys ``0 .. positions[t]`` of
the token's slot.  Rounding as the split-K kernel's: scores and sums in f32, the probabilities rounded to bf16 for
``P V``, the output rounded to bf16 once (``acc · (1 / l)``).  Scores stay unscaled; ``scale · log2 e`` is folded
into the exponent, ``p = 2^(s · c - m · c)`` with ``m`` the running row max (one multiply-add and one ``exp2`` a
score).  Qwen3.5's gate is applied after, by ``gating.sigmoid_gate_mul``.

Shapes: q, out ``[T, nq, D]``; the caches ``[pages, page_size, nkv, D]`` (all bf16 bits, read as flat uint32 words);
G = nq / nkv q heads share a kv head.

Work: one block per (tile of ``BQ`` consecutive query tokens, kv head), the tiles of the latest tokens (the most
keys) first.  The tile's ``ROWS = 16 · warps · m_tiles`` query rows are ``BQ = ROWS / G`` tokens × the G q heads of
the kv head (row r = token ``t0 + r // G``, head ``kvh · G + r % G``), so every K/V tile the block loads serves G
heads.  Warp w owns rows ``16 · m_tiles · w ..`` (``m_tiles`` m16 tiles) and keeps their running max / sum and the O
accumulator ``[16 · m_tiles, D]`` (f32) in registers.  Geometry (``geometry.prefill_geometry``): D = 128: 4 warps × 2
m16 tiles, 64-key tiles, 2 stages; D = 256: 8 warps × 1 m16 tile, 64-key tiles, 2 stages; both 128 rows.

Shared memory (dynamic): the Q tile ``[ROWS, D]``, then a ring of ``stages`` stages, each a K tile and a V tile
``[BK, D]`` (one key per row, as the cache holds them).  Rows are ``D · 2`` bytes, 16-byte chunk ``c`` of row ``r``
stored at chunk ``c ^ (r & 7)`` (``swizzled``; ``r & 3``, ``r & 1`` for the 4- and 2-chunk rows of D = 32, 16): an
``ldmatrix`` phase reads one chunk of 8 consecutive rows, which then fall in 8 different bank groups, and a 16-byte
``cp.async`` stays one aligned chunk.

Pipeline, per run of tokens of one slot (below): the key tiles ``0 .. ⌈(max position + 1) / BK⌉`` -- tiles wholly
past the run's last position (above the causal diagonal) are never loaded -- go through the ring.  Its first
``stages - 1`` tiles are copied with ``cp.async`` (the Q tile with the first), each tile one commit group; at key tile
``i`` a thread waits for its own copies of ``i``, a block barrier makes everyone's visible (and frees the stage read
at ``i - 1``), the copies of tile ``i + stages - 1`` go into that stage, and tile ``i`` is computed, per warp:

1. **scores** ``S = Q K^T`` (``[16 · m_tiles, BK]``, f32): per k16 step of D, ``m_tiles`` ``ldmatrix.x4`` of Q
   (the A fragments) and one ``ldmatrix.x4`` per 16 keys of K (B fragments of two n8 tiles), ``2 · m_tiles``
   ``mma.sync.m16n8k16`` each; keys past a row's position set to -inf (only in tiles that cross the diagonal);
2. **online softmax** in the accumulator registers: the tile's row max over the 4 lanes of a row; a row's base
   ``m`` moves up to it only when it passes ``m`` by more than ``RESCALE_LOG2`` (8, in log2 units), then ``O`` and
   the row sum are rescaled by ``2^((m_old - m_new) · c)`` -- a warp skips the rescale when none of its rows moved
   (``warp_any``), as it does in nearly every tile after the first; ``P = 2^(S · c - m · c)`` (below 2^8);
3. **``O += bf16(P) V``**: the S accumulators of n8 tiles ``2k, 2k + 1`` are the A fragment of k16 step k, and one
   ``ldmatrix.x4.trans`` of the V tile (``primitives.ldmatrix_x4_trans``) gives the B fragments of 16 dims × 16
   keys, ``2 · m_tiles`` mma each.

At the end ``out = bf16(O / l)``, each lane writing its rows' bf16 pairs.  Tokens of different slots in one tile are
handled run by run (a run = consecutive tokens of one slot, the ring restarted for each); rows outside the current
run see only masked keys.  Padding tokens (``token_slots[t] < 0``) read nothing and get zeros; K/V rows past a run's
last position are zero-filled (their scores are masked, and a zero V keeps ``0 · V`` finite).

Indices into shared memory are ``uint32`` (numba adds a negative-index wraparound and 64-bit arithmetic to every
signed one); each lane's ``ldmatrix`` row offsets within a 16-row tile are worked out once (``qv_off``, ``k_off``:
the swizzle of a lane's row depends only on the lane), so a fragment load is one register add and an immediate.
In the simulator the warp-wide mma, ``ldmatrix``, ``cp.async`` and the warp vote are emulated (``primitives``), so
the same kernel is tested there.  PDL: the kernel lets the next launch start and waits at its start (``pdl_prologue``).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.attention.geometry import PrefillGeometry, ceil_div, prefill_geometry
from pegainfer.kernels.attention.merge import LOG2E, NEG_INF
from pegainfer.kernels.attention.workspace import flat_u32
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, shared_optin
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, cp_async_16, cp_async_commit, cp_async_wait_group, cuda, device_fn,
                                          exp2_approx, float32, grid, int32, lane_group_max, lane_group_sum,
                                          ldmatrix_x4, ldmatrix_x4_trans, mma_bf16_m16n8k16, pack_bf16x2,
                                          pdl_prologue, uint32, warp_any)

uint64 = np.uint64

RESCALE_LOG2 = 8.0
"""A row's probabilities are taken against a base at most this far (log2 units) below its running max, so they stay
below 2^8: exact in f32 sums, rounded to bf16 for ``P V`` at the same relative precision as below 1."""


@functools.lru_cache(maxsize=None)
def prefill_kernel(head_dim: int, group: int, warps: int, m_tiles: int, block_keys: int, stages: int):
    """Build the kernel for one shape and tile (module docstring).  Closure constants size the register fragments,
    the shared-memory tiles and the copy plan, and unroll every loop over them."""
    D, G, MT, BK, STAGES = head_dim, group, m_tiles, block_keys, stages
    ROWS = 16 * warps * MT          # query rows of a block
    BQ = ROWS // G                  # query tokens of a block
    NTHREADS = WARP * warps
    ROW_WORDS = D // 2              # a shared-memory row (one query row or one key), in uint32 words
    CHUNKS = D // 8                 # 16-byte chunks of a row
    SWZ = min(CHUNKS, 8) - 1        # chunk c of row r is stored at chunk c ^ (r & SWZ)
    NOFF = (SWZ + 1) // 2           # distinct swizzled lane offsets over the k16 steps (below)
    S_TILES = BK // 8               # n8 tiles of S = Q K^T (keys)
    O_TILES = D // 8                # n8 tiles of O (head dims)
    QK_STEPS = D // 16              # k16 steps of Q K^T (head dims)
    PV_STEPS = BK // 16             # k16 steps of P V (keys)
    STEP = NTHREADS // CHUNKS       # rows one round of the block's 16-byte copies covers
    Q_PT, KV_PT = ceil_div(ROWS, STEP), ceil_div(BK, STEP)     # copy rounds a thread makes for Q / a K/V tile
    Q_ALL, KV_ALL = ROWS % STEP == 0, BK % STEP == 0            # (every round inside the tile: no row test)
    TILE_WORDS = BK * ROW_WORDS
    RING = ROWS * ROW_WORDS         # the ring starts after the Q tile
    STAGE_WORDS = 2 * TILE_WORDS    # a stage: the K tile, then the V tile
    A_REGS, S_REGS, O_REGS, ROW_REGS = 4 * MT, 4 * MT * S_TILES, 4 * MT * O_TILES, 2 * MT   # (local array sizes)
    assert ROWS % G == 0 and BK % 16 == 0 and D % 16 == 0 and NTHREADS % CHUNKS == 0 and STAGES >= 2
    wait_ring = cp_async_wait_group(STAGES - 2)     # all but the newest stages - 2 copy groups have landed
    wait_all = cp_async_wait_group(0)

    @device_fn
    def swizzled(row, chunk):
        """Word offset of 16-byte chunk ``chunk`` of shared-memory row ``row`` (module docstring), as uint32."""
        r, c = uint32(row), uint32(chunk)
        return uint32(r * uint32(ROW_WORDS) + uint32(4) * (c ^ (r & uint32(SWZ))))

    @device_fn
    def copy_q_tile(smem, q32, t0, kvh, nq, n_tokens, first, chunk):
        """Start the ``cp.async`` copies of this thread's slices of the Q tile (chunk ``chunk`` of rows ``first +
        p · STEP``); rows of tokens past T are zero-filled."""
        for p in range(Q_PT):
            r = int32(first) + p * STEP
            if Q_ALL or r < ROWS:
                tok = t0 + r // G
                src = (min(tok, n_tokens - 1) * nq + kvh * G + r % G) * ROW_WORDS + 4 * int32(chunk)
                cp_async_16(smem, swizzled(r, chunk), q32, src, 16 if tok < n_tokens else 0)

    @device_fn
    def copy_kv_tile(smem, stage, k32, v32, pages, k0, max_pos, kv_col, kv_row_words, page_shift, first, chunk):
        """Start the copies of this thread's slices of the K and V tiles of keys ``k0 .. k0 + BK`` into the stage at
        word ``stage``: key ``kp`` of the slot is cache row ``pages[kp // page_size] · page_size + kp % page_size``
        (``pages``: the slot's block-table row), word ``row · kv_row_words + kv_col`` (``kv_col``: the kv head's and
        this thread's chunk's offset).  Keys past ``max_pos`` (only in a run's last tile) are zero-filled, and read
        no block-table entry past the run's.  Every value is uint32 (no wraparound tests, 32-bit arithmetic; a layer's
        cache stays under 16 GB)."""
        page_mask = (uint32(1) << page_shift) - uint32(1)
        for p in range(KV_PT):
            r = uint32(first + uint32(p * STEP))
            if KV_ALL or r < uint32(BK):
                key = uint32(k0 + r)
                kp = min(key, max_pos)                      # (a key past the run: any in-bounds source)
                src = uint32(uint32((uint32(pages[kp >> page_shift]) << page_shift) | (kp & page_mask))
                             * kv_row_words + kv_col)
                nbytes = uint32(16) if key <= max_pos else uint32(0)
                dst = uint32(stage + swizzled(r, chunk))
                cp_async_16(smem, dst, k32, src, nbytes)
                cp_async_16(smem, uint32(dst + uint32(TILE_WORDS)), v32, src, nbytes)

    @bounded_kernel(NTHREADS, warps)
    def paged_attention_prefill_kernel(q32, k32, v32, block_tables, token_slots, positions, out32, scale_log2,
                                       num_kv_heads, page_shift):
        """Causal attention of a tile of ``BQ`` consecutive query tokens × the ``G`` q heads of one kv head
        (module docstring).  q32, out32 ``[T · nq · D/2]`` (bf16 pairs of ``[T, nq, D]``), k32 / v32 the caches as
        flat uint32; ``scale_log2`` = scale · log2 e; ``page_shift`` = log2(page_size).  Grid-stride over
        ``ceil(T / BQ) · nkv`` work items, ``32 · warps`` threads."""
        pdl_prologue()
        smem = cuda.shared.array(0, nbtypes.uint32)       # Q tile, then the ring (dynamic: 16-byte aligned)
        qv_off = cuda.local.array(NOFF, uint32)            # a lane's ldmatrix row offsets (below)
        k_off = cuda.local.array(NOFF, uint32)
        qa = cuda.local.array(A_REGS, uint32)              # A fragments of Q (one k16 step) or of P
        sf = cuda.local.array(S_REGS, float32)             # S / P: m16 tile im, n8 tile j at 4(im·S_TILES + j)
        of = cuda.local.array(O_REGS, float32)             # O: m16 tile im, n8 tile jd at 4(im·O_TILES + jd)
        # per lane row r = 2·im + h (m16 tile im, row g + 8h): the base of its probabilities (raw score units), this
        # lane's share of its sum (the row's 4 lanes are summed at the end), its position in the current run (-1
        # outside it) and its max over the keys so far
        row_max = cuda.local.array(ROW_REGS, float32)
        row_sum = cuda.local.array(ROW_REGS, float32)
        row_pos = cuda.local.array(ROW_REGS, int32)
        tile_max = cuda.local.array(ROW_REGS, float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        tq = lane & 3
        nq = num_kv_heads * G
        n_tokens = positions.shape[0]
        # ldmatrix row addresses within a 16-row tile at k16 step s (16-byte chunks 2s, 2s + 1), by lane l:
        # * Q (A fragments a0..a3) and V (.trans: b0, b1 of dim tile 2s, then of 2s + 1): row l & 15, chunk
        #   2s + (l >> 4);
        # * K (b0, b1 of key tile 0-7, then of keys 8-15: each pair in consecutive registers, as the mma takes
        #   them): row (l & 7) + 8·(l >> 4), chunk 2s + ((l >> 3) & 1).
        # Tile bases are multiples of 16 rows, so the swizzle of a lane's row is l & SWZ, and (2s | hi) ^ x =
        # 2·NOFF·(s // NOFF) + ((2(s % NOFF) | hi) ^ x): NOFF offsets a lane, plus a constant per step.
        qv_row = lane & 15
        k_row = (lane & 7) + 8 * (lane >> 4)
        for i in range(NOFF):
            qv_off[i] = uint32(qv_row * ROW_WORDS + 4 * (((2 * i) | (lane >> 4)) ^ (lane & SWZ)))
            k_off[i] = uint32(k_row * ROW_WORDS + 4 * (((2 * i) | ((lane >> 3) & 1)) ^ (lane & SWZ)))
        q_warp = uint32(warp * 16 * MT * ROW_WORDS)        # the warp's first Q row
        first = uint32(tid // CHUNKS)                      # this thread's copy slices: rows first + p·STEP, chunk
        chunk = uint32(tid % CHUNKS)
        kv_row_words = uint32(num_kv_heads * ROW_WORDS)    # words from one cache row (token) to the next
        shift_u = uint32(page_shift)
        n_tiles = (n_tokens + BQ - 1) // BQ
        n_work = n_tiles * num_kv_heads
        rescale_raw = float32(RESCALE_LOG2) / scale_log2    # the rescale threshold in raw score units

        for work in range(cuda.blockIdx.x, n_work, cuda.gridDim.x):
            kvh = work % num_kv_heads
            t0 = (n_tiles - 1 - work // num_kv_heads) * BQ          # the latest tokens (the most keys) first
            t_end = min(t0 + BQ, n_tokens)
            copy_q_tile(smem, q32, t0, kvh, nq, n_tokens, first, chunk)   # lands with the first K/V group
            kv_col = uint32(kvh * ROW_WORDS + 4 * chunk)
            for i in range(O_REGS):
                of[i] = float32(0.0)
            for i in range(2 * MT):
                row_max[i] = NEG_INF
                row_sum[i] = float32(0.0)

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
                for im in range(MT):
                    for h in range(2):
                        tok = t0 + (warp * 16 * MT + 16 * im + 8 * h + g) // G
                        row_pos[2 * im + h] = positions[tok] if run_start <= tok and tok < run_end else -1
                whole_tile = run_start == t0 and run_end == t0 + BQ   # every row of the block is in this run
                n_kt = (max_pos + BK) // BK if slot >= 0 else 0        # padding tokens (slot < 0) read nothing
                pages = block_tables[uint32(max(slot, 0))]             # the slot's block-table row
                max_pos_u = uint32(max(max_pos, 0))

                for s in range(STAGES - 1):                            # the ring's first tiles, one group each
                    if s < n_kt:
                        copy_kv_tile(smem, uint32(RING + s * STAGE_WORDS), k32, v32, pages, uint32(s * BK),
                                     max_pos_u, kv_col, kv_row_words, shift_u, first, chunk)
                    cp_async_commit()
                cur = uint32(0)                  # the stage key tile kt sits in (kt mod STAGES) ...
                nxt = uint32(STAGES - 1)         # ... and the one tile kt + STAGES - 1 goes to
                for kt in range(n_kt):
                    wait_ring()
                    cuda.syncthreads()           # tile kt visible to all; everyone is done with tile kt - 1's stage
                    if kt + STAGES - 1 < n_kt:
                        copy_kv_tile(smem, uint32(RING) + nxt * uint32(STAGE_WORDS), k32, v32, pages,
                                     uint32((kt + STAGES - 1) * BK), max_pos_u, kv_col, kv_row_words, shift_u, first,
                                     chunk)
                    cp_async_commit()
                    k_tile = uint32(RING) + cur * uint32(STAGE_WORDS)
                    v_tile = k_tile + uint32(TILE_WORDS)
                    cur = uint32(0) if cur == uint32(STAGES - 1) else cur + uint32(1)
                    nxt = uint32(0) if nxt == uint32(STAGES - 1) else nxt + uint32(1)
                    k0 = kt * BK

                    # 1. S = Q K^T (raw scores)
                    for i in range(S_REGS):
                        sf[i] = float32(0.0)
                    for ks in range(QK_STEPS):
                        step_const = uint32(8 * NOFF * (ks // NOFF))
                        for im in range(MT):
                            qa[4 * im], qa[4 * im + 1], qa[4 * im + 2], qa[4 * im + 3] = ldmatrix_x4(
                                smem, q_warp + uint32(16 * im * ROW_WORDS) + qv_off[ks % NOFF] + step_const)
                        for j2 in range(S_TILES // 2):
                            # b0, b1 of key tile 2·j2 in r0, r1; of key tile 2·j2 + 1 in r2, r3
                            r0, r1, r2, r3 = ldmatrix_x4(smem, k_tile + uint32(16 * j2 * ROW_WORDS) + k_off[ks % NOFF]
                                                         + step_const)
                            for im in range(MT):
                                o = 4 * (im * S_TILES + 2 * j2)
                                sf[o], sf[o + 1], sf[o + 2], sf[o + 3] = mma_bf16_m16n8k16(
                                    qa[4 * im], qa[4 * im + 1], qa[4 * im + 2], qa[4 * im + 3], r0, r1,
                                    sf[o], sf[o + 1], sf[o + 2], sf[o + 3])
                                sf[o + 4], sf[o + 5], sf[o + 6], sf[o + 7] = mma_bf16_m16n8k16(
                                    qa[4 * im], qa[4 * im + 1], qa[4 * im + 2], qa[4 * im + 3], r2, r3,
                                    sf[o + 4], sf[o + 5], sf[o + 6], sf[o + 7])
                    if not (whole_tile and k0 + BK - 1 <= min_pos):    # causal / run mask needed in this tile
                        for r in range(ROW_REGS):
                            # the row sees key k0 + 8j + 2·tq + c (entry c & 1 of n8 tile j) while 8j + c <= last
                            last = int32(row_pos[r] - k0 - 2 * tq)
                            for j in range(S_TILES):
                                for c in range(2):
                                    if int32(8 * j + c) > last:
                                        sf[4 * ((r >> 1) * S_TILES + j) + 2 * (r & 1) + c] = NEG_INF

                    # 2. online softmax, per lane row r = 2·im + h (m16 tile im, accumulator entries 2h, 2h + 1).
                    # The base a row's probabilities are taken against moves up only when the tile's max passes it
                    # by more than RESCALE_LOG2 (or it was -inf): then O and the row sum are rescaled, skipped by the
                    # whole warp when no row of it moved (after the first tiles, nearly always).
                    grow = False
                    for r in range(ROW_REGS):
                        mx = row_max[r]
                        for j in range(S_TILES):
                            o = 4 * ((r >> 1) * S_TILES + j) + 2 * (r & 1)
                            mx = max(mx, max(sf[o], sf[o + 1]))
                        tile_max[r] = lane_group_max(mx, 4)
                        grow = grow or tile_max[r] > row_max[r] + rescale_raw
                    if warp_any(grow):
                        for r in range(ROW_REGS):
                            alpha = float32(1.0)
                            if tile_max[r] > row_max[r] + rescale_raw:        # (2^-inf = 0 from an empty row)
                                alpha = exp2_approx((row_max[r] - tile_max[r]) * scale_log2)
                                row_max[r] = tile_max[r]
                            row_sum[r] *= alpha
                            for jd in range(O_TILES):
                                o = 4 * ((r >> 1) * O_TILES + jd) + 2 * (r & 1)
                                of[o] *= alpha
                                of[o + 1] *= alpha
                    for r in range(ROW_REGS):
                        base = row_max[r] * scale_log2 if row_max[r] != NEG_INF else float32(0.0)   # masked: 0
                        total = float32(0.0)
                        for j in range(S_TILES):
                            o = 4 * ((r >> 1) * S_TILES + j) + 2 * (r & 1)
                            p0 = exp2_approx(sf[o] * scale_log2 - base)
                            p1 = exp2_approx(sf[o + 1] * scale_log2 - base)
                            sf[o] = p0
                            sf[o + 1] = p1
                            total += p0 + p1
                        row_sum[r] += total

                    # 3. O += bf16(P) V
                    for kk in range(PV_STEPS):
                        for im in range(MT):
                            o = 4 * (im * S_TILES + 2 * kk)
                            qa[4 * im] = pack_bf16x2(sf[o], sf[o + 1])
                            qa[4 * im + 1] = pack_bf16x2(sf[o + 2], sf[o + 3])
                            qa[4 * im + 2] = pack_bf16x2(sf[o + 4], sf[o + 5])
                            qa[4 * im + 3] = pack_bf16x2(sf[o + 6], sf[o + 7])
                        for jp in range(O_TILES // 2):
                            # b0 / b1 of dim tile 2·jp in r0 / r1, of dim tile 2·jp + 1 in r2 / r3
                            r0, r1, r2, r3 = ldmatrix_x4_trans(smem, v_tile + uint32(16 * kk * ROW_WORDS)
                                                               + qv_off[jp % NOFF] + uint32(8 * NOFF * (jp // NOFF)))
                            for im in range(MT):
                                o = 4 * (im * O_TILES + 2 * jp)
                                of[o], of[o + 1], of[o + 2], of[o + 3] = mma_bf16_m16n8k16(
                                    qa[4 * im], qa[4 * im + 1], qa[4 * im + 2], qa[4 * im + 3], r0, r1,
                                    of[o], of[o + 1], of[o + 2], of[o + 3])
                                of[o + 4], of[o + 5], of[o + 6], of[o + 7] = mma_bf16_m16n8k16(
                                    qa[4 * im], qa[4 * im + 1], qa[4 * im + 2], qa[4 * im + 3], r2, r3,
                                    of[o + 4], of[o + 5], of[o + 6], of[o + 7])
                cuda.syncthreads()               # every warp is done with the ring before the next run refills it
                run_start = run_end

            wait_all()                           # (a tile of padding tokens only never waited for its Q copies)
            cuda.syncthreads()                   # every warp is done with the Q tile before the next work item's
            for im in range(MT):
                for h in range(2):
                    r = 2 * im + h
                    row = warp * 16 * MT + 16 * im + 8 * h + g
                    tok = t0 + row // G
                    total = lane_group_sum(row_sum[r], 4)
                    inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                    if tok < n_tokens:
                        base_word = uint64((tok * nq + kvh * G + row % G) * ROW_WORDS + tq)
                        for jd in range(O_TILES):
                            o = 4 * (im * O_TILES + jd) + 2 * h
                            out32[base_word + uint64(4 * jd)] = pack_bf16x2(of[o] * inv, of[o + 1] * inv)

    return paged_attention_prefill_kernel


def paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, *,
                            geometry: PrefillGeometry | None = None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Launch the tiled kernel (``paged_attention``'s arguments, already checked there); ``geometry`` forces the
    tile (tests, ``benchmarks/bench_attention.py``), by default ``prefill_geometry`` (which reads the policy)."""
    T, nq, D = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nq // nkv
    geo = geometry or prefill_geometry(D, group, policy)
    if not (1 <= geo.warps <= 32 and geo.m_tiles >= 1 and geo.block_keys >= 16 and geo.block_keys % 16 == 0
            and geo.stages >= 2):
        raise ValueError(f"prefill tile {tuple(geo)}: needs 1-32 warps, m_tiles >= 1, block_keys a multiple of 16 "
                         "and stages >= 2")
    if geo.rows % group:
        raise ValueError(f"the tiled prefill kernel needs nq/nkv = {group} to divide its {geo.rows} query rows")
    shared = geo.shared_bytes(D)
    if shared > shared_optin():
        raise ValueError(f"prefill tile {tuple(geo)} needs {shared} bytes of shared memory at head_dim {D}; the GPU "
                         f"allows {shared_optin()}: use fewer keys a tile, stages or rows")
    kern = prefill_kernel(D, group, geo.warps, geo.m_tiles, geo.block_keys, geo.stages)
    launch(kern, grid(ceil_div(T, geo.rows // group) * nkv, sim_cap=64), WARP * geo.warps,
           flat_u32(q), flat_u32(k_cache), flat_u32(v_cache), block_tables, token_slots, positions,
           flat_u32(out), np.float32(scale * LOG2E), np.int32(nkv), np.int32(page_size.bit_length() - 1),
           shared=shared, name="paged_attention_prefill", policy=policy)
