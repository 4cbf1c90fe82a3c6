"""The one-token GEMV of a decode step: ``out[0] = x @ W.T`` as a stream over W at memory bandwidth, with what the
step needs around it folded into the same launch.

* **The stream** (every launch): blocks grid-stride over tiles of ``warps / k_split · rows_per_warp`` logical
  columns; a lane keeps ``stages - 1`` steps of 16-byte loads of each of its rows in flight through a register
  ring.  The first tile's loads go out *before* the PDL wait (weights do not depend on the kernel before), each
  next tile's before the current tile's reduction barrier.  x is staged once per block, as bf16 pairs.
* **The add + RMSNorm prologue** (``linear_add_rms_norm`` with one token): instead of reading x, every block
  computes ``s = bf16(residual + delta)`` and ``x = rms_norm(s)`` from the whole row, bit-identical to ``norm``'s
  kernels, and writes its share of ``s`` to ``residual_out``.
* **The embedding gather** (the first layer): the residual is a row of the embedding table picked by ``row_ids``.
* **The LM head's argmax** (``HeadArgmax``): the launch also finds the greedy token of its one output row.

Every block lets the next kernel launch (``launch_dependents``) when it starts its last tile: blocks of the next
kernel launched earlier would sit on SM slots for the whole stream (docs/perf/linear.md).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels import timeline
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, load_row_slices, silu_mul_bf16, weight_row
from pegainfer.kernels.linear.geometry import NORM_THREADS, GemvGeometry, resident_blocks
from pegainfer.kernels.norm import add_pair, inverse_rms, normalize_pair, pairs_per_thread
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import (NO_INDEX, WARP, as_words, bf16x2_hi, bf16x2_lo, bits_f32, block_argmax,
                                          block_sum, cuda, device_fn, f32_to_bf16, float32, global_timer, grid,
                                          grid_dependency_wait, launch_dependents, load_u32_l2, load_u32x4, math,
                                          reads_before_wait, uint32, warp_sums_to_shared)

int32, int64, uint64 = np.int32, np.int64, np.uint64

step_fn = device_fn if SIMULATOR else cuda.jit(device=True, inline="always")
"""The decorator of the kernel's steps below: inlined into the kernel at numba's IR level, so the kernel compiles to
the code of one written as a single body (the simulator's ``cuda.jit`` calls them as functions)."""

X_SLICES_AT_ONCE = 8
"""A one-token GEMV without the norm prologue stages x with every thread's loads issued at once when it has at most
this many 16-byte slices to stage (the down projection: 5 a thread); otherwise in a loop, which the compiler
splits into a remainder of single load-then-store trips and groups of four: two round trips where one does."""


@device_fn
def _x_word_index(c, j):
    """Shared-memory word of bf16 pair ``j`` (0..3) of 16-byte slice ``c`` of the staged x:
    ``128·(c // 32) + 32·j + c % 32``, so the 32 lanes of a step (consecutive c) read 32 consecutive words."""
    return 128 * (c >> 5) + 32 * j + (c & 31)


if SIMULATOR:
    from pegainfer.kernels.linear.common import words_to_f32

    def _dot_slices_x_words(acc, w, base, x0, x1, x2, x3, rows):
        """``acc[r] += Σ_j W_r[j] · X[j]``: 8 bf16 of row r in ``w[base+4r : +4]``, of x in the words x0..x3."""
        wf = words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        acc[:rows] += wf @ words_to_f32([x0, x1, x2, x3])
else:
    from pegainfer.kernels.linear.common import dot_rows_8

    @device_fn
    def _dot_slices_x_words(acc, w, base, x0, x1, x2, x3, rows):
        """``acc[r] += Σ_j W_r[j] · X[j]``: 8 bf16 of row r in ``w[base+4r : +4]``, of x in the words x0..x3,
        multiplied and added in element order (``dot_rows_8`` with one token)."""
        dot_rows_8(acc, w, base, 0, rows, 1, bf16x2_lo(x0), bf16x2_hi(x0), bf16x2_lo(x1), bf16x2_hi(x1),
                   bf16x2_lo(x2), bf16x2_hi(x2), bf16x2_lo(x3), bf16x2_hi(x3))


# ------------------------------------------------------------------------------------------------ the steps
@functools.cache
def _tile_steps(rows_per_warp: int, stages: int, warps: int, gated: bool, argmax: bool):
    """The weight stream's device functions for ``rows_per_warp`` rows a warp, a ring ``stages`` deep and blocks of
    ``warps`` warps: ``start_tile`` (the tile's row offsets and its first ``stages - 1`` steps of loads),
    ``stream_tile`` (the ring over K into ``acc``) and ``write_tile`` (the reduction's outputs)."""
    R, S = rows_per_warp, stages
    R4 = 4 * R
    ARGMAX = argmax
    nthreads = warps * WARP

    @step_fn
    def start_tile(w32, wrow, wbuf, tile, cols_per_block, group, n_cols, n_out, k_words, first, step, n_slices):
        """The word offsets of the warp's rows of ``tile`` (rows past the end re-read the last row: loads stay in
        bounds, their sums are never stored) and the ring's first ``stages - 1`` steps of loads."""
        for r in range(R):
            wrow[r] = weight_row(min(tile * cols_per_block + group * R + r, n_cols - 1), n_out, gated) * k_words
        for s in range(S - 1):
            cs = first + s * step
            if cs < n_slices:
                load_row_slices(w32, wrow, 4 * cs, wbuf, s * R4, R)

    @step_fn
    def stream_tile(w32, wrow, wbuf, xs, acc, first, step, n_slices):
        """``acc[r]`` = the lane's partial dot of row r with x: slices ``first, first + step, ...``, ring slot s of
        the unrolled inner loop holding step s mod stages, each step refilling the slot the previous one freed."""
        for r in range(R):
            acc[r] = float32(0.0)
        c = first
        while c < n_slices:
            for s in range(S):                  # unrolled: ring slot s holds slice c
                c_pre = c + (S - 1) * step      # refill the slot the previous step freed
                if c_pre < n_slices:
                    load_row_slices(w32, wrow, 4 * c_pre, wbuf, ((s + S - 1) % S) * R4, R)
                if c < n_slices:
                    xb = uint64(128 * (c >> 5) + (c & 31))
                    _dot_slices_x_words(acc, wbuf, s * R4, xs[xb], xs[xb + uint64(32)], xs[xb + uint64(64)],
                                        xs[xb + uint64(96)], R)
                c += step

    @step_fn
    def write_tile(out, xs, red, tile, cols_per_block, groups, k_split, n_cols, tid, t_best, t_col):
        """One thread per output of ``tile``: the sum of its ``k_split`` warps' partials (f32 bits at ``xs[red
        ..]``), written as ``bf16`` (gated: ``silu_mul_bf16`` of the gate/up pair).  With ``argmax``, also the
        thread's largest output so far and its column (the first of equals; NaN never wins), returned."""
        per_out = 2 if gated else 1
        for item in range(tid, groups * (R // per_out), nthreads):
            g_ = item // (R // per_out)
            r = (item - g_ * (R // per_out)) * per_out
            col = tile * cols_per_block + g_ * R + r
            if col < n_cols:
                v0 = float32(0.0)
                v1 = float32(0.0)
                for p_ in range(k_split):
                    base = uint64(red + (g_ * k_split + p_) * R + r)
                    v0 += bits_f32(xs[base])
                    if gated:
                        v1 += bits_f32(xs[base + uint64(1)])
                if gated:
                    out[uint64(0), uint64(col >> 1)] = silu_mul_bf16(v0, v1)
                else:
                    bits = f32_to_bf16(v0)
                    out[uint64(0), uint64(col)] = bits
                    if ARGMAX:
                        logit = bits_f32(uint32(bits) << uint32(16))
                        if logit > t_best:
                            t_best = logit
                            t_col = int32(col)
        return t_best, t_col

    return start_tile, stream_tile, write_tile


@functools.cache
def _norm_steps(norm_pairs: int, warps: int, gather: bool, residual_early: bool, whole_pairs: bool):
    """The add + RMSNorm prologue's device functions for ``norm_pairs`` element pairs a thread in blocks of
    ``warps`` warps: ``read_early`` (before the PDL wait: the norm weights, and the residual when it is ready) and
    ``stage_normed_x`` (after it: the rest of the prologue, x into shared memory)."""
    U = norm_pairs
    nthreads = warps * WARP
    GATHER = gather
    RESIDUAL_EARLY = residual_early and not gather
    WHOLE = whole_pairs

    @step_fn
    def read_early(norm_weight32, residual_in32, n_w, s_w, tid, k_words):
        """The norm weights (no kernel writes them) and, when the caller says it is ready, the residual (from L2:
        it was written by a kernel that has completed): pair ``tid + u · threads`` into slot u."""
        for u in range(U):
            n_w[u] = norm_weight32[uint64(min(tid + u * nthreads, k_words - 1))]
        if RESIDUAL_EARLY:
            for u in range(U):
                s_w[u] = load_u32_l2(residual_in32, uint64(min(tid + u * nthreads, k_words - 1)))

    @step_fn
    def stage_normed_x(xs, residual_in32, delta32, residual_out32, row_ids, n_w, s_w, has_delta, eps, weight_offset,
                       round_before_weight, k, k_words, tid):
        """``s = bf16(residual + delta)``, this block's share of it into ``residual_out`` (pair group u belongs to
        block u mod grid), ``x = rms_norm(s)`` into ``xs`` in ``_x_word_index`` order.

        Everything after the wait runs on every warp of the SM at once, so it is written for few instructions:
        32-bit unsigned indices (numba widens integer arithmetic to 64 bits: hence the casts; no negative-index
        code either), the owner block of pair group u kept as a running count instead of a division per pair, and
        no bounds checks when K / 2 is a whole number of pair strides (``whole_pairs``)."""
        d_w = cuda.local.array(U, uint32)
        row0 = uint64(0)
        valid = True
        if GATHER:                              # (the ids are read after the wait, as the residual would be)
            token = row_ids[0]
            valid = token >= 0 and token < residual_in32.shape[0] // k_words
            row0 = uint64(token if valid else 0) * uint64(k_words)
        utid = uint32(tid)
        uk_words = uint32(k_words)
        ulast = uint32(uk_words - uint32(1))
        for u in range(U):                      # every load of the prologue at once
            pu = uint32(utid + uint32(u * nthreads)) if WHOLE else uint32(min(uint32(utid + uint32(u * nthreads)),
                                                                              ulast))
            if not RESIDUAL_EARLY:
                s_w[u] = residual_in32[row0 + uint64(pu)] if valid else uint32(0)
            d_w[u] = delta32[pu] if has_delta else uint32(0)
        ss = float32(0.0)
        owner = uint32(0)                       # the block that writes pair group u: u mod grid
        bid = uint32(cuda.blockIdx.x)
        n_blocks = uint32(cuda.gridDim.x)
        for u in range(U):
            p = uint32(utid + uint32(u * nthreads))
            s_w[u] = add_pair(s_w[u], d_w[u], has_delta)
            if WHOLE or p < uk_words:
                if owner == bid:
                    residual_out32[p] = s_w[u]
                v0 = bf16x2_lo(s_w[u])
                v1 = bf16x2_hi(s_w[u])
                ss += v0 * v0
                ss += v1 * v1
            owner = uint32(owner + uint32(1))
            if owner == n_blocks:
                owner = uint32(0)
        inv_rms = inverse_rms(block_sum(ss), k, float32(eps))
        for u in range(U):
            p = uint32(utid + uint32(u * nthreads))
            if WHOLE or p < uk_words:           # _x_word_index(p / 4, p % 4), in 32 bits
                at = uint32(uint32(uint32(p >> uint32(7)) << uint32(7)) | uint32(uint32(p & uint32(3)) << uint32(5))
                            | uint32(uint32(p >> uint32(2)) & uint32(31)))
                xs[at] = normalize_pair(s_w[u], n_w[u], inv_rms, float32(weight_offset), round_before_weight)

    return read_early, stage_normed_x


@functools.cache
def _stage_x_step(warps: int, x_slices: int):
    """``stage_x(x32, xs, tid, n_slices)``: x's 16-byte slices into ``xs`` in ``_x_word_index`` order, for blocks of
    ``warps`` warps: with every thread's loads at once, then its stores, when a thread has at most ``x_slices``
    slices; ``x_slices`` = 0: a loop."""
    XS = x_slices
    XQ = 4 * max(1, XS)
    nthreads = warps * WARP

    @step_fn
    def stage_x(x32, xs, tid, n_slices):
        if XS:
            xq = cuda.local.array(XQ, uint32)
            un_slices = uint32(n_slices)
            for i in range(XS):
                c = uint32(uint32(tid) + uint32(i * nthreads))
                if c < un_slices:
                    xq[4 * i], xq[4 * i + 1], xq[4 * i + 2], xq[4 * i + 3] = load_u32x4(x32, uint32(4) * c)
            for i in range(XS):
                c = uint32(uint32(tid) + uint32(i * nthreads))
                if c < un_slices:               # _x_word_index(c, j), in 32 bits
                    at = uint32(uint32(uint32(c >> uint32(5)) << uint32(7)) | uint32(c & uint32(31)))
                    for j in range(4):
                        xs[uint32(at + uint32(32 * j))] = xq[4 * i + j]
        else:
            for c in range(tid, n_slices, nthreads):
                q0, q1, q2, q3 = load_u32x4(x32, 4 * c)
                xs[uint64(_x_word_index(c, 0))] = q0
                xs[uint64(_x_word_index(c, 1))] = q1
                xs[uint64(_x_word_index(c, 2))] = q2
                xs[uint64(_x_word_index(c, 3))] = q3

    return stage_x


@functools.cache
def _head_argmax_step(warps: int):
    """``merge_head_argmax``: the LM head's greedy token from every thread's best output (``HeadArgmax``)."""
    nthreads = warps * WARP

    @step_fn
    def merge_head_argmax(t_best, t_col, head_max, head_index, head_token, head_threshold, head_kept, tid):
        """The block reduces its threads' pairs (``block_argmax``: ties -> the smaller column) into ``head_max[b]``,
        ``head_index[b]`` and counts itself on ``head_index[-1]``; the block that counts last merges the blocks'
        pairs the same way and writes the greedy token to ``head_token[0]`` (0 when no output beats -inf, as
        ``sampling.sample``), the max to ``head_threshold[0]``, 1 to ``head_kept[0]``, and zeroes the counter."""
        last_block = cuda.shared.array(1, int32)
        b_best, b_col = block_argmax(t_best, t_col)
        counter = head_index.shape[0] - 1
        if tid == 0:
            head_max[cuda.blockIdx.x] = b_best
            head_index[cuda.blockIdx.x] = b_col
            cuda.threadfence()                  # publish the pair before counting it
            last_block[0] = 1 if cuda.atomic.add(head_index, counter, 1) == cuda.gridDim.x - 1 else 0
        cuda.syncthreads()
        if last_block[0] == 1:
            cuda.threadfence()
            m_best = float32(-math.inf)
            m_col = int32(NO_INDEX)
            for q in range(tid, cuda.gridDim.x, nthreads):
                v = head_max[q]
                j = head_index[q]
                if v > m_best or (v == m_best and j < m_col):
                    m_best = v
                    m_col = j
            m_best, m_col = block_argmax(m_best, m_col)
            if tid == 0:
                head_token[0] = m_col if m_col != NO_INDEX else 0
                head_threshold[0] = m_best
                head_kept[0] = 1
                head_index[counter] = 0         # at rest again (graph replays)

    return merge_head_argmax


# ------------------------------------------------------------------------------------------------ the kernel
@functools.cache
def _gemv_decode_kernel(rows_per_warp: int, stages: int, warps: int, gated: bool, norm_pairs: int,
                        gather: bool = False, argmax: bool = False, stamps: bool = False,
                        residual_early: bool = False, whole_pairs: bool = False, x_slices: int = 0):
    """Build the one-token GEMV for ``rows_per_warp`` rows per warp, a load ring ``stages`` deep, blocks of
    ``warps`` warps (all compile-time: they size the register arrays and set the launch bounds) and, when
    ``norm_pairs`` > 0, the add + RMSNorm prologue with that many element pairs per thread; ``gather``: that
    prologue reads row ``row_ids[0]`` of an embedding table as the residual; ``argmax``: the kernel also finds the
    greedy token of its one output row; ``stamps``: each block appends its ``timeline`` record; ``residual_early``
    (with the prologue, not ``gather``): the residual is read before the PDL wait; ``whole_pairs``: K / 2 is
    exactly ``norm_pairs`` · threads, so the prologue needs no bounds checks; ``x_slices`` (without the prologue;
    0: a loop): the 16-byte slices of x each thread stages, at most (all its loads then go out at once)."""
    assert not (argmax and gated)
    STAMPS = stamps
    NORM = norm_pairs > 0
    KIND = 2 if NORM else 1
    ARGMAX = argmax
    R, S, U = rows_per_warp, stages, max(1, norm_pairs)
    SR4 = S * 4 * R
    start_tile, stream_tile, write_tile = _tile_steps(rows_per_warp, stages, warps, gated, argmax)
    # both kinds of step are bound (the unused one is never called: its branch is pruned at compile time), so the
    # kernel's closure has no empty cell -- numba's disk cache pickles every cell of a cached kernel's closure
    if NORM:
        read_early, stage_normed_x = _norm_steps(norm_pairs, warps, gather, residual_early, whole_pairs)
        stage_x = _stage_x_step(warps, 0)
    else:
        read_early, stage_normed_x = _norm_steps(1, warps, False, False, False)
        stage_x = _stage_x_step(warps, x_slices)
    merge_head_argmax = _head_argmax_step(warps)
    early_reads = (("w32",) + (("norm_weight32",) if NORM else ())
                   + (("residual_in32",) if NORM and residual_early and not gather else ()))

    @reads_before_wait(*early_reads)
    @bounded_kernel(warps * WARP)
    def gemv_decode(x32, w32, out, k, k_split, residual_in32, delta32, norm_weight32, residual_out32, eps,
                    weight_offset, round_before_weight, has_delta, row_ids, head_max, head_index, head_token,
                    head_threshold, head_kept, stamp_buf):
        """``out[0, n] = bf16(Σ_k x[k] · W[row(n), k])`` for one token (or SwiGLU of column pairs when gated).

        x32 ``[K/2]``, w32 ``[rows · K/2]`` uint32 (bf16 pairs of x ``[1, K]`` and W ``[rows, K]``), out
        ``[1, n_out]`` bf16 bits, ``k`` = K (a multiple of 8), ``k_split`` warps per row group.

        1. *Before the PDL wait* (``reads_before_wait`` above: what no kernel writes): the first tile's first
           ``stages - 1`` steps of weight loads, and with the prologue its norm weights (and the residual when
           ``residual_early``).
        2. *Stage x once per block* as bf16 pairs in shared memory (``_x_word_index`` order: no bank conflicts when
           a warp reads the 4 words of its 32 slices), ~``2K`` bytes, so even K = 12288 fits.  With the prologue
           (blocks of ``NORM_THREADS``) x is not read: every block computes ``s = bf16(residual + delta)``
           (``has_delta``; else ``s = residual``) and ``x = rms_norm(s)`` with ``norm_weight`` and the norm's
           ``eps`` / ``weight_offset`` / ``round_before_weight`` from the whole row (L2 hits); thread t holds pairs
           t, t + B, ... (norm's sum order, ``norm.row_kernel``'s docstring: bit-identical to ``norm``'s
           kernels); block b writes pairs p with ``(p // B) % grid == b`` of ``residual_out``.  With ``gather`` the residual is row ``row_ids[0]`` of
           ``residual_in`` (the embedding table ``[V, K]``; an id outside ``[0, V)`` reads as zeros, as
           ``embedding`` does).
        3. *Stream W*: blocks grid-stride over tiles of ``warps / k_split · rows_per_warp`` logical columns (at most
           one resident wave: ``resident_blocks``).  Warp ``group · k_split + part`` takes ``rows_per_warp`` rows
           and the 16-byte slices ``c ≡ part · 32 + lane (mod 32 · k_split)`` of each (a warp covers 256 contiguous
           elements of a row per step), ``stages - 1`` steps of loads in flight per lane: cold weights come from
           HBM, and a warp that waits on each load in turn is latency-bound.  A block lets the next kernel launch
           when it starts its last tile.
        4. *Reduce*: ``warp_sum`` per row, the ``k_split`` partial sums through shared memory, one thread per output
           writes ``bf16(sum)``.
        5. With ``argmax`` (the LM head of a one-sequence step): the greedy token of the row (``merge_head_argmax``),
           so the sampler has nothing left to do for a greedy row.
        Shared memory (dynamic, uint32 words): ``128 · ceil(K / 256)`` for x, then ``warps · rows_per_warp`` f32
        partial sums (bits).
        """
        xs = cuda.shared.array(0, nbtypes.uint32)
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        n_slices = k // 8
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        part = warp % k_split
        group = warp // k_split
        groups = warps // k_split
        cols_per_block = groups * R
        n_tiles = (n_cols + cols_per_block - 1) // cols_per_block
        step = WARP * k_split
        first = part * WARP + lane                  # this lane's first slice of every row
        acc = cuda.local.array(R, float32)
        wrow = cuda.local.array(R, int64)           # word offset of each of the warp's rows
        wbuf = cuda.local.array(SR4, uint32)        # the load ring: S slots × 16 bytes per row
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()

        # 1. before the wait: what no kernel writes
        n_w = cuda.local.array(U, uint32)           # the norm weights of the prologue's pairs
        s_w = cuda.local.array(U, uint32)           # ... its residual pairs (then the sums)
        if NORM:
            read_early(norm_weight32, residual_in32, n_w, s_w, tid, k_words)
        tile = cuda.blockIdx.x
        if tile < n_tiles:                          # the first tile's loads fly while x is staged
            start_tile(w32, wrow, wbuf, tile, cols_per_block, group, n_cols, n_out, k_words, first, step, n_slices)
        grid_dependency_wait()                      # x / the residual, which the previous kernel writes
        if STAMPS:
            t_wait = global_timer()

        # 2. x into shared memory
        if NORM:
            stage_normed_x(xs, residual_in32, delta32, residual_out32, row_ids, n_w, s_w, has_delta, eps,
                           weight_offset, round_before_weight, k, k_words, tid)
        else:
            stage_x(x32, xs, tid, n_slices)
        cuda.syncthreads()
        if STAMPS:
            t_ready = global_timer()

        # 3, 4. stream and reduce the block's tiles
        red = 128 * ((n_slices + 31) // 32)         # partial sums follow x (padded to whole 32-slice groups)
        t_best = float32(-math.inf)                 # argmax: this thread's largest output and its column
        t_col = int32(NO_INDEX)
        if tile + cuda.gridDim.x >= n_tiles:
            launch_dependents()                     # this block's only tile
        while tile < n_tiles:
            stream_tile(w32, wrow, wbuf, xs, acc, first, step, n_slices)
            warp_sums_to_shared(acc, R, xs, red + warp * R, True)   # f32 bits (xs is uint32)
            this_tile = tile
            tile += cuda.gridDim.x
            if tile < n_tiles and tile + cuda.gridDim.x >= n_tiles:
                launch_dependents()                 # entering the last tile
            if tile < n_tiles:                      # the next tile's loads fly through the reduction
                start_tile(w32, wrow, wbuf, tile, cols_per_block, group, n_cols, n_out, k_words, first, step,
                           n_slices)
            cuda.syncthreads()
            t_best, t_col = write_tile(out, xs, red, this_tile, cols_per_block, groups, k_split, n_cols, tid,
                                       t_best, t_col)
            cuda.syncthreads()                      # partial sums read before the next tile overwrites them

        # 5. the LM head's greedy token
        if ARGMAX:
            merge_head_argmax(t_best, t_col, head_max, head_index, head_token, head_threshold, head_kept, tid)
        if STAMPS and tid == 0:
            timeline.record(stamp_buf, KIND, t_entry, t_wait, t_ready, n_out)

    return gemv_decode


# ------------------------------------------------------------------------------------------------ the launch
@functools.cache
def _unused(dtype):
    """A one-element device array for an argument the launch does not use (``row_ids`` of a GEMV that gathers
    nothing, the argmax outputs of one that finds no token): never read or written."""
    return cuda.to_device(np.zeros(1, dtype))


def gemv_decode(x, w, out, gated: bool, geo: GemvGeometry, policy: LaunchPolicy) -> None:
    """Launch the one-token GEMV on ``x [1, K]``."""
    k = x.shape[1]
    x32 = as_words(x)
    _launch(k, (x32, as_words(w), out, k, geo.k_split, x32, x32, x32, x32), w, out, gated, geo, policy,
            norm_pairs=0, eps=0.0, weight_offset=0.0, round_before_weight=True, has_delta=False)


def gemv_decode_add_rms_norm(residual_in, delta, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                             round_before_weight, geo: GemvGeometry, policy: LaunchPolicy, row_ids=None,
                             head=None, residual_early: bool = False) -> None:
    """Launch the one-token GEMV with the add + RMSNorm prologue over ``residual_in`` / ``delta`` /
    ``norm_weight``, writing ``residual_out`` (blocks of ``NORM_THREADS``); ``row_ids``: the residual is row
    ``row_ids[0]`` of the table ``residual_in``; ``head``: ``sampling.HeadArgmax`` (its arrays ``part_max``,
    ``part_index``, ``token``, ``threshold``, ``kept``) to write the greedy token of the output row into;
    ``residual_early``: read the residual before the PDL wait (not with ``row_ids``)."""
    k = residual_in.shape[1]
    assert geo.warps * WARP == NORM_THREADS, f"the fused norm needs blocks of {NORM_THREADS} threads: {geo}"
    r32 = as_words(residual_in)
    d32 = r32 if delta is None else as_words(delta)
    args = (r32, as_words(w), out, k, geo.k_split, r32, d32, as_words(norm_weight), as_words(residual_out))
    _launch(k, args, w, out, gated, geo, policy, norm_pairs=pairs_per_thread(k), eps=eps, weight_offset=weight_offset,
            round_before_weight=round_before_weight, has_delta=delta is not None, row_ids=row_ids, head=head,
            residual_early=residual_early and row_ids is None)


def _launch(k, args, w, out, gated, geo, policy, *, norm_pairs, eps, weight_offset, round_before_weight, has_delta,
            row_ids=None, head=None, residual_early=False) -> None:
    assert not gated or geo.rows_per_warp % 2 == 0, f"the gated GEMV needs an even rows_per_warp: {geo}"
    assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
    assert k % 8 == 0, f"K must be a multiple of 8, got {k}"
    cols_per_block = geo.warps // geo.k_split * geo.rows_per_warp
    n_tiles = -(-w.shape[0] // cols_per_block)
    shared = 4 * (128 * -(-k // 256) + geo.warps * geo.rows_per_warp)
    x_slices = -(-k // (8 * geo.warps * WARP))     # the plain GEMV: 16-byte slices of x a thread stages
    kern = _gemv_decode_kernel(geo.rows_per_warp, geo.stages, geo.warps, gated, norm_pairs, row_ids is not None,
                               head is not None, policy.timeline, residual_early,
                               norm_pairs > 0 and k // 2 == norm_pairs * NORM_THREADS,
                               0 if norm_pairs or x_slices > X_SLICES_AT_ONCE else x_slices)
    # the fused norm prologue runs once per block, so that path is always persistent; a bare projection may take one
    # block per tile (``persistent=False``: the hardware scheduler balances blocks, e.g. when a kernel still
    # running holds some SMs that a persistent grid counts on)
    blocks = resident_blocks(n_tiles, geo) if geo.persistent or norm_pairs else grid(n_tiles, sim_cap=2)
    if head is None:
        head_args = (_unused(np.float32), _unused(np.int32), _unused(np.int32), _unused(np.float32), _unused(np.int32))
    else:
        assert not gated and out.shape[0] == 1 and blocks < head.part_index.shape[0], (out.shape, blocks)
        head_args = (head.part_max, head.part_index, head.token, head.threshold, head.kept)
    stamps = timeline.buffer() if policy.timeline else timeline.unused()
    launch(kern, blocks, geo.warps * WARP, *args, np.float32(eps), np.float32(weight_offset),
           bool(round_before_weight), has_delta, _unused(np.int32) if row_ids is None else row_ids,
           *head_args, stamps, shared=shared, name="gemv_add_rms_norm" if norm_pairs else "gemv", policy=policy)
