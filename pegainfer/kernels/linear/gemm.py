"""The ``mma.sync`` tensor-core GEMM: ``out = x @ W.T`` for T > 16 tokens on GPUs without Hopper's ``wgmma``
(Ampere, Ada, Blackwell; ``gemm_wgmma`` on sm_90), from a batched decode step (a weight stream) to a long prompt
(arithmetic-bound).

Math: ``out[t, n] = bf16(Σ_k x[t, k] · W[n, k])`` with f32 accumulation; gated (``linear_silu_mul``), the weight
is ``2I`` logical columns interleaved in pairs (``common.weight_row``) and each pair becomes one SwiGLU output.

Shapes: x ``[T, K]``, W ``[N, K]``, out ``[T, N]`` (gated: ``[T, I]``), bf16 bits; K a multiple of 8.

Tiles (``geometry.MmaGeometry``): a block of ``warps_m × warps_n`` warps owns a ``bm × bn`` output tile (``bm =
16·warps_m·mt`` tokens, ``bn = 8·warps_n·nt`` columns); warp (wm, wn) owns ``mt × nt`` m16n8 f32 accumulator tiles
(tokens ``wm·16·mt ..``, columns ``wn·8·nt ..``).  For few tokens one warp row holds every token of the step
(T <= 64: ``bm`` = 16 .. 64) and four warps split 64 columns; then 128 × 64 and 128 × 128 tiles.

Pipeline (per unit of work): K is walked in 32-wide K tiles.  A ring of ``stages`` shared-memory stages, each
holding the x tile ``[bm, 32]`` and the W tile ``[bn, 32]`` (rows of 64 bytes, 16-byte chunks swizzled:
``_swizzled``), is filled with ``cp.async`` (no registers held while the bytes fly): the first ``stages - 1`` K
tiles go out, then at K tile ``i`` a thread waits for its own copies of ``i``, a block barrier makes everyone's
visible (and frees the stage read at ``i - 1``), the copies of ``i + stages - 1`` go into that freed stage, and K
tile ``i`` is multiplied: per warp ``nt`` ``ldmatrix.x4`` (all 32 K of 8 weight rows each: both k16 steps' B
fragments), ``2·mt`` ``ldmatrix.x4`` for the A fragments, ``2·mt·nt`` ``mma.sync.m16n8k16``.  Each thread's copy
slices are fixed for the unit (16-byte chunk ``tid % 4`` of rows ``tid / 4 + p · threads / 4``), so their source
rows are worked out once per unit, not per K tile.

Split-K (``k_splits`` > 1, ``splitk``): a unit is (token tile, column tile, K range); the last block of a tile sums
the ranges' partials in a fixed order inside the same launch.  This is what keeps every SM streaming when few tokens
meet a short-and-wide weight.

Launch geometry: 1-D blocks of exactly ``32 · warps_m · warps_n`` threads grid-stride over the units, token tiles
fastest, then K splits, then column tiles (the blocks that share a weight tile, or a tile's splits, run together).
Dynamic shared memory (``geometry.MmaGeometry.shared_bytes``): the ring, then one word of split-K flag.  PDL: the
block lets the next kernel launch at once and copies its first unit's weight stages before waiting for the kernel
before it (weights are never written); x, the output and the workspace are touched only after the wait.

``mma_bf16_m16n8k16`` and ``ldmatrix_x4`` come from ``primitives``, which documents the fragment layouts; in the
simulator both are emulated from those layouts, so the kernel's indexing is tested without a GPU (slowly: tests use
tiny shapes and one-warp blocks).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, store_packed_pair, weight_row
from pegainfer.kernels.linear.geometry import MmaGeometry, mma_geometry, mma_units
from pegainfer.kernels.linear.splitk import build_finish_tile, split_workspace
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, cp_async_16, cp_async_commit, cp_async_wait_group, cuda,
                                          device_fn, float32, grid, grid_dependency_wait, int32, launch_dependents,
                                          ldmatrix_x4, mma_bf16_m16n8k16, pack_bf16x2, store_bf16_pair, uint32)

int64 = np.int64

MMA_BK = 32                  # K per shared-memory stage: two m16n8k16 steps
MMA_ROW_WORDS = MMA_BK // 2
"""Shared-memory row of a stage, in uint32 words (bf16 pairs): 16 words = four 16-byte chunks, stored swizzled
(``_swizzled``) rather than padded, so that a stage of a 128 × 128 tile is 16 KB."""


@device_fn
def _swizzled(row, word):
    """Word offset of (row, word) in a stage: 16-byte chunk ``c = word // 4`` of a row is stored at chunk
    ``c ^ ((row >> 1) & 3)``.  An ``ldmatrix`` phase reads 8 rows at one chunk: rows of equal ``row & 1`` then fall in
    four different chunks, and rows 2j, 2j + 1 are 64 bytes apart, so the 8 × 16 bytes hit 32 different banks; a
    16-byte copy stays one aligned chunk."""
    return row * MMA_ROW_WORDS + 4 * ((word >> 2) ^ ((row >> 1) & 3)) + (word & 3)


@device_fn
def _plan_rows(src, lim, per_thread, step, first, row0, n_rows, n_out, gated, k_words, k):
    """A thread's copy slices of one operand for a unit: slice p is tile row ``first + p·step``, global row
    ``row0 + first + p·step`` of an ``[n_rows, K]`` operand (rows ``weight_row`` finds when gated).  ``src[p]``: the
    word offset of its row (rows past the end re-read the last one: loads stay in bounds); ``lim[p]``: K for a row
    inside the operand, 0 outside (its chunks are then zero-filled)."""
    for p in range(per_thread):
        row = row0 + first + p * step
        src[p] = int64(weight_row(min(row, n_rows - 1), n_out, gated)) * k_words
        lim[p] = k if row < n_rows else 0


@device_fn
def _copy_k_tile(src32, ring, dst, src, lim, per_thread, step, first, tile_rows, chunk, k0, k):
    """Start the ``cp.async`` copies of a thread's slices of one operand's K tile (K ``k0 .. k0 + 32``, chunk
    ``chunk`` of each of its rows) into the stage at ``ring[dst ..]`` (``dst``: the swizzled offset of its first
    slice; later slices are ``step`` rows further, with the same swizzle).  Chunks past K are zero-filled.
    ``tile_rows`` 0: every slice is inside the tile (its rows a multiple of ``step``: no test)."""
    kk = k0 + 8 * chunk
    off = min(kk, k - 8) >> 1
    for p in range(per_thread):
        if tile_rows == 0 or first + p * step < tile_rows:
            cp_async_16(ring, dst + uint32(p * step * MMA_ROW_WORDS), src32, src[p] + off, 16 if kk < lim[p] else 0)


@device_fn
def store_mma_tiles(out, acc, packed, mt, nt, tok0, col0, gated):
    """Write a warp's ``mt × nt`` m16n8 f32 accumulator tiles, rounded to bf16: tile (i, j) covers tokens
    ``tok0 + 16i ..`` and logical columns ``col0 + 8j ..``; its fragment ``acc[4(i·nt + j) : +4]`` holds (C/D layout)
    tokens g, g + 8 × columns 2t, 2t + 1 of the lane (g = lane >> 2, t = lane & 3).  Tokens past ``out``'s T and
    columns past the end are dropped; gated, each column pair becomes one SwiGLU output (``store_packed_pair``).
    ``packed`` is ``2·mt·nt`` uint32 of scratch.  Two loops: the first (small body, fully unrolled, so acc stays in
    registers) rounds the accumulators to bf16 pairs; the second writes them, a pair in one 4-byte store when the
    rows have an even number of columns (half the epilogue's store instructions), else value by value."""
    lane = cuda.threadIdx.x % WARP
    g = lane >> 2
    t4 = lane & 3
    T = out.shape[0]
    for i in range(mt * nt):
        packed[2 * i] = pack_bf16x2(acc[4 * i], acc[4 * i + 1])
        packed[2 * i + 1] = pack_bf16x2(acc[4 * i + 2], acc[4 * i + 3])
    n_out = out.shape[1]
    if not gated and n_out % 2 == 0:     # every pair 4-byte aligned (``check_shapes``): one store a pair
        for i in range(mt):
            tok = tok0 + 16 * i + g
            for j in range(nt):
                col = col0 + 8 * j + 2 * t4
                if tok < T and col < n_out:
                    store_bf16_pair(out, tok, col, packed[2 * (i * nt + j)])
                if tok + 8 < T and col < n_out:
                    store_bf16_pair(out, tok + 8, col, packed[2 * (i * nt + j) + 1])
        return
    for i in range(mt):
        tok = tok0 + 16 * i + g
        for j in range(nt):
            col = col0 + 8 * j + 2 * t4
            if tok < T:
                store_packed_pair(out, tok, col, packed[2 * (i * nt + j)], gated)
            if tok + 8 < T:
                store_packed_pair(out, tok + 8, col, packed[2 * (i * nt + j) + 1], gated)


@functools.cache
def _gemm_mma_kernel(warps_m: int, warps_n: int, mt: int, nt: int, stages: int, gated: bool, warps_per_sm: int):
    """Build the tensor-core GEMM for one tile shape and ring depth (module docstring; all compile-time: they size
    register arrays and unroll loops).  The split count is a launch argument."""
    bm, bn = 16 * warps_m * mt, 8 * warps_n * nt
    nthreads = WARP * warps_m * warps_n
    step = nthreads // 4                                 # tile rows one round of the block's 16-byte copies covers
    a_pt, b_pt = -(-bm // step), -(-bn // step)          # copy slices per thread and K tile
    a_rows = 0 if bm % step == 0 else bm                 # (0: no slice falls outside the tile)
    b_rows = 0 if bn % step == 0 else bn
    a_stage, b_stage = bm * MMA_ROW_WORDS, bn * MMA_ROW_WORDS
    w_ring = stages * a_stage                            # the W stages follow the x stages
    flag_at = stages * (a_stage + b_stage)               # then one word: "this block is the tile's last split"
    n_acc, n_packed, n_bfrag = 4 * mt * nt, 2 * mt * nt, 4 * nt
    wait_ring = cp_async_wait_group(stages - 2)          # all but the newest stages - 2 copy groups have landed
    wait_all = cp_async_wait_group(0)

    @device_fn
    def store_tiles(out, acc, tok0, col0):
        packed = cuda.local.array(n_packed, uint32)
        store_mma_tiles(out, acc, packed, mt, nt, tok0, col0, gated)

    finish_tile = build_finish_tile(n_acc, nthreads, store_tiles)

    @bounded_kernel(nthreads, warps_per_sm)
    def gemm_mma(x32, w32, out, k, k_splits, ws, counters):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) on tensor cores, f32 accumulation.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``;
        ``k`` = K; ``k_splits`` K ranges per output tile, their partials in ``ws`` (uint32 words of the f32
        workspace) and ``counters`` (``splitk``; stand-ins when ``k_splits`` = 1).  Geometry, ring and fragment
        loads: the module docstring.
        """
        launch_dependents()
        ring = cuda.shared.array(0, nbtypes.uint32)     # dynamic: the x stages, the W stages from word w_ring, the
        #                                                 split-K flag at word flag_at (no static shared array: the
        #                                                 ring must start 16-byte aligned for cp.async and ldmatrix)
        acc = cuda.local.array(n_acc, float32)
        bfrag = cuda.local.array(n_bfrag, uint32)
        a_src = cuda.local.array(a_pt, int64)
        a_lim = cuda.local.array(a_pt, int32)
        b_src = cuda.local.array(b_pt, int64)
        b_lim = cuda.local.array(b_pt, int32)
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        wm = warp % warps_m
        wn = warp // warps_m
        # ldmatrix row addresses (``primitives.mma``): A: lane l gives row l % 16 of an m16 tile at chunk
        # 2·ks + l / 16; B: row l % 8 of an n8 tile at chunk l / 8 (all four chunks: both k16 steps).  Tile bases
        # are multiples of 8 rows, so the swizzle of a lane's row is (l >> 1) & 3 in both.
        sw = (lane >> 1) & 3
        a_lane0 = uint32(wm * mt * 16 * MMA_ROW_WORDS + (lane & 15) * MMA_ROW_WORDS + 4 * ((lane >> 4) ^ sw))
        a_lane1 = uint32(wm * mt * 16 * MMA_ROW_WORDS + (lane & 15) * MMA_ROW_WORDS + 4 * ((2 + (lane >> 4)) ^ sw))
        b_lane = uint32(w_ring + wn * nt * 8 * MMA_ROW_WORDS + (lane & 7) * MMA_ROW_WORDS + 4 * ((lane >> 3) ^ sw))
        first = tid >> 2                                  # the thread's copy slices: rows first + p·step, chunk
        chunk = tid & 3
        dst0 = uint32(_swizzled(first, 4 * chunk))
        tiles_m = (T + bm - 1) // bm
        tiles_n = (n_cols + bn - 1) // bn
        n_kt = (k + MMA_BK - 1) // MMA_BK
        for unit in range(cuda.blockIdx.x, tiles_m * tiles_n * k_splits, cuda.gridDim.x):
            m_tile = unit % tiles_m
            split = (unit // tiles_m) % k_splits
            n_tile = unit // (tiles_m * k_splits)
            m0 = m_tile * bm
            n0 = n_tile * bn
            kt0 = split * n_kt // k_splits
            nk = (split + 1) * n_kt // k_splits - kt0
            _plan_rows(a_src, a_lim, a_pt, step, first, m0, T, 0, False, k_words, k)
            _plan_rows(b_src, b_lim, b_pt, step, first, n0, n_cols, n_out, gated, k_words, k)
            for i in range(n_acc):
                acc[i] = float32(0.0)
            # the ring's first stages: weights first (readable before the PDL wait), then x after it; the first
            # commit group holds every prologue weight tile, so K tile s is complete once group s is
            # (loops with a run-time bound, not unrolled: their copies' addresses would all be live at once)
            n_first = min(nk, stages - 1)
            for s in range(n_first):
                _copy_k_tile(w32, ring, uint32(w_ring) + uint32(s) * uint32(b_stage) + dst0, b_src, b_lim, b_pt, step,
                             first, b_rows, chunk, (kt0 + s) * MMA_BK, k)
            grid_dependency_wait()
            for s in range(n_first):
                _copy_k_tile(x32, ring, uint32(s) * uint32(a_stage) + dst0, a_src, a_lim, a_pt, step, first, a_rows,
                             chunk, (kt0 + s) * MMA_BK, k)
                cp_async_commit()
            for s in range(n_first, stages - 1):       # empty groups: the waits count stages - 1 groups ahead
                cp_async_commit()
            cur = uint32(0)                             # the stage K tile i sits in (i mod stages) ...
            slot = uint32(stages - 1)                   # ... and the one K tile i + stages - 1 goes to
            for i in range(nk):
                wait_ring()
                cuda.syncthreads()
                if i + stages - 1 < nk:
                    k0 = (kt0 + i + stages - 1) * MMA_BK
                    _copy_k_tile(x32, ring, slot * uint32(a_stage) + dst0, a_src, a_lim, a_pt, step, first, a_rows,
                                 chunk, k0, k)
                    _copy_k_tile(w32, ring, uint32(w_ring) + slot * uint32(b_stage) + dst0, b_src, b_lim, b_pt, step,
                                 first, b_rows, chunk, k0, k)
                cp_async_commit()
                a_base = cur * uint32(a_stage)
                b_base = cur * uint32(b_stage)
                cur = uint32(0) if cur == uint32(stages - 1) else cur + uint32(1)
                slot = uint32(0) if slot == uint32(stages - 1) else slot + uint32(1)
                for j in range(nt):
                    q0, q1, q2, q3 = ldmatrix_x4(ring, b_base + b_lane + uint32(j * 8 * MMA_ROW_WORDS))
                    bfrag[4 * j] = q0
                    bfrag[4 * j + 1] = q1
                    bfrag[4 * j + 2] = q2
                    bfrag[4 * j + 3] = q3
                for ks in range(2):
                    a_lane = a_lane0 if ks == 0 else a_lane1
                    for im in range(mt):
                        a0, a1, a2, a3 = ldmatrix_x4(ring, a_base + a_lane + uint32(im * 16 * MMA_ROW_WORDS))
                        for j in range(nt):
                            o = 4 * (im * nt + j)
                            d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, bfrag[4 * j + 2 * ks],
                                                               bfrag[4 * j + 2 * ks + 1],
                                                               acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                            acc[o] = d0
                            acc[o + 1] = d1
                            acc[o + 2] = d2
                            acc[o + 3] = d3
            wait_all()
            cuda.syncthreads()                      # every warp is done with the ring before the next unit's copies
            finish_tile(out, acc, m0 + wm * mt * 16, n0 + wn * nt * 8, ws, counters, ring, flag_at,
                        m_tile + tiles_m * n_tile, split, k_splits)

    return gemm_mma


def gemm_mma(x, w, out, *, gated: bool = False, geometry: MmaGeometry | None = None, workspace=None,
             policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Tensor-core GEMM path of ``linear`` / ``linear_silu_mul``.

    ``geometry`` overrides ``geometry.mma_geometry`` (benchmarks and tests try tiles and splits).  ``workspace``:
    the f32 split-K workspace (``linear_workspace_size``); without one the picked geometry runs unsplit (a given
    ``geometry`` that splits then raises).  In the simulator ``mma.sync`` and ``ldmatrix`` are emulated (slow; for
    testing the kernel's indexing: ``linear(impl=None)`` takes the FMA tiles there)."""
    T, k = x.shape
    n_cols = w.shape[0]
    geo = geometry or mma_geometry(n_cols, k, T, gated, policy)
    geo = dataclasses.replace(geo, k_splits=max(1, min(geo.k_splits, -(-k // MMA_BK))))
    if geometry is None and workspace is None and geo.k_splits > 1:
        geo = dataclasses.replace(geo, k_splits=1)
    x32 = as_words(x)
    ws, counters = split_workspace(workspace, geo, T, n_cols, policy, stand_in=x32)
    kern = _gemm_mma_kernel(geo.warps_m, geo.warps_n, geo.mt, geo.nt, geo.stages, gated, geo.warps_per_sm)
    launch(kern, grid(mma_units(geo, T, n_cols), sim_cap=16), geo.threads, x32, as_words(w), out, k,
           geo.k_splits, ws, counters, shared=geo.shared_bytes, name="gemm_mma", policy=policy)
