"""The Hopper GEMM of the weight stream (17 to 64 tokens): ``gemm_wgmma``'s math and tiles (see its module), with the
ring filled by ``cp.async`` from every thread instead of TMA from a producer warp (``WgmmaGeometry.fill`` "ring").

Why a second fill: with 17-64 tokens a launch is a 13-40 µs stream of one weight, and there every thread's 16-byte
copies beat the producer warp's TMA boxes (docs/perf/linear.md: 4B qkv at 64 tokens 15.0 against 18.0 µs, o 13.6
against 16.5, down 22.4 against 24.4), while from 128 tokens on TMA's producer wins.

Pipeline (per unit of work): K is walked in 64-wide K tiles.  A ring of ``stages`` shared-memory stages, each the x
tile ``[bm, 64]`` then the W tile ``[bn, 64]`` in the 128-byte-swizzled K-major layout ``wgmma`` reads (rows of 128
bytes, 1024-byte-aligned tiles), is filled with ``cp.async`` by every thread (16-byte chunk ``tid % 8`` of rows
``tid / 8 + p · threads / 8``; gated, tile row r holds weight row ``common.weight_row``: gate and up rows
interleaved).  ``stages - 2`` K tiles are in flight ahead of the one being multiplied:

    at K tile i:  wait for my copies of tile i; fence them into the async proxy; block barrier (everyone's copies of
                  i are visible, and every warpgroup has retired its wgmma group i - 2)
                  copy tile i + stages - 2 into the stage tile i - 2 used
                  4 × wgmma m64 n{bn} k16 on tile i (one group); wait until only this group is in flight

so the tensor cores work on tile i while tile i - 1's group drains and the next tiles' bytes fly.

Launch geometry: 1-D blocks of ``128 · warpgroups`` threads; units, split-K, dynamic shared memory and PDL as in
``gemm_wgmma`` (no mbarriers: the block barrier orders the ring).

**The add + RMSNorm prologue** (``norm_pairs`` > 0: ``linear_add_rms_norm`` of 17-64 tokens in one launch, the
decoder's residual add and norm before qkv / in_proj and gate/up): x is the normed rows, which this launch writes
itself.  After its PDL wait, block b < ``owners`` computes rows b, b + owners, ... exactly as ``norm.add_rms_norm_into``
does (``norm.build_row_norm``: the same sum order, so the same bits), writing ``residual_out`` and the normed rows,
then counts them on the handoff counter; every block waits there until all T rows are counted before its first x
copy, its first weight tiles already in flight.  The last block past the wait puts the counters back to 0 (zero at
rest, as the split-K counters).  A block waits for other blocks of the launch, so the grid is at most one resident
wave (``gemm_wgmma``'s launch caps it; blocks grid-stride over the units).  In the simulator, whose blocks run one
after another, block 0 owns every row (``owners`` = 1).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.linear.common import bounded_kernel
from pegainfer.kernels.linear.gemm import _plan_rows, store_mma_tiles
from pegainfer.kernels.linear.splitk import build_finish_tile
from pegainfer.kernels.norm import build_row_norm
from pegainfer.kernels.primitives import (cp_async_16, cp_async_commit, cp_async_wait_group, cuda, device_fn,
                                          float32, grid_dependency_wait, int32, launch_dependents, load_acquire_u32,
                                          reads_before_wait, uint32)
from pegainfer.kernels.primitives.wgmma import (WARPGROUP, fence_proxy_async, shared_address, smem_desc,
                                                swizzled_word, wgmma_bf16_m64k16, wgmma_commit, wgmma_fence,
                                                wgmma_wait)

int64 = np.int64

WGMMA_BK = 64                 # K per stage: one 128-byte swizzled row per operand row, four k16 steps
ROW_WORDS = WGMMA_BK // 2     # uint32 words of a stage row


@device_fn
def _copy_k_tile(src32, ring, dst, src, lim, per_thread, step, chunk, k0, k):
    """Start the ``cp.async`` copies of a thread's slices of one operand's K tile (K ``k0 .. k0 + 64``, chunk
    ``chunk`` of each row) into the stage at ``ring[dst ..]`` (``dst``: the swizzled word of the first slice; the
    slices are ``step`` rows apart, a multiple of 8, so they share its swizzle).  Chunks past K are zero-filled."""
    kk = k0 + 8 * chunk
    off = min(kk, k - 8) >> 1
    for p in range(per_thread):
        cp_async_16(ring, dst + uint32(p * step * ROW_WORDS), src32, src[p] + off, 16 if kk < lim[p] else 0)


@functools.cache
def gemm_wgmma_ring_kernel(warpgroups: int, bn: int, stages: int, gated: bool, warps_per_sm: int,
                           norm_pairs: int = 0):
    """Build the ring GEMM for one tile shape and ring depth (module docstring; all compile-time: they size register
    arrays and unroll loops).  The split count is a launch argument.  ``norm_pairs`` > 0: the kernel with the add +
    RMSNorm prologue, for rows of up to ``2 · norm_pairs · norm.BLOCK_THREADS`` elements."""
    bm = 64 * warpgroups
    nthreads = WARPGROUP * warpgroups
    step = nthreads // 8                                  # tile rows one round of the block's copies covers
    a_pt, b_pt = bm // step, bn // step                   # copy slices per thread and K tile (exact: bn >= 64)
    a_stage, b_stage = bm * ROW_WORDS, bn * ROW_WORDS     # words (multiples of 256: 1024-byte aligned)
    stage = a_stage + b_stage
    flag_at = 256 + stages * stage                        # after the alignment slack and the ring
    n_acc = bn // 2
    ahead = stages - 2                                    # K tiles in flight ahead of the one multiplied
    wgmma = wgmma_bf16_m64k16(bn)
    wait_ring = cp_async_wait_group(ahead - 1)
    wait_all = cp_async_wait_group(0)
    wgmma_keep_one = wgmma_wait(1, n_acc)
    wgmma_drain = wgmma_wait(0, n_acc)

    @device_fn
    def store_tiles(out, acc, tok0, col0):
        packed = cuda.local.array(n_acc, uint32)
        store_mma_tiles(out, acc, packed, 1, bn // 8, tok0, col0, gated)

    finish_tile = build_finish_tile(n_acc, nthreads, store_tiles)
    NORM = norm_pairs > 0
    norm_row = build_row_norm(max(1, norm_pairs), nthreads)

    @device_fn
    def add_rms_norm_prologue(residual_in32, delta32, has_delta, norm_weight32, eps, weight_offset,
                              round_before_weight, residual_out32, x32, handoff, owners, T):
        """This block's rows of the add + RMSNorm, then the wait until every block's are written (module
        docstring).  ``handoff``: two uint32 counters, rows written and blocks past the wait."""
        partial = cuda.shared.array(32, float32)
        rows = 0
        for row in range(cuda.blockIdx.x, T, owners):
            norm_row(residual_in32, delta32, has_delta, norm_weight32, residual_out32, x32, row, eps, weight_offset,
                     round_before_weight, partial)
            rows += 1
        cuda.threadfence()                               # publish the rows before counting them
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            if rows > 0:
                cuda.atomic.add(handoff, 0, uint32(rows))
            while load_acquire_u32(handoff, 0) < uint32(T):   # (a weak load here is a loop ptxas may delete)
                pass
            if cuda.atomic.add(handoff, 1, uint32(1)) == uint32(cuda.gridDim.x - 1):
                handoff[0] = uint32(0)                   # every block is past the wait: zero at rest
                handoff[1] = uint32(0)
        cuda.syncthreads()

    @device_fn
    def ring_gemm(x32, w32, out, k, k_splits, ws, counters, residual_in32, delta32, has_delta, norm_weight32, eps,
                  weight_offset, round_before_weight, residual_out32, handoff, owners):
        ring = cuda.shared.array(0, nbtypes.uint32)      # dynamic: slack, then the stages, then the split-K flag
        acc = cuda.local.array(n_acc, float32)
        a_src = cuda.local.array(a_pt, int64)
        a_lim = cuda.local.array(a_pt, int32)
        b_src = cuda.local.array(b_pt, int64)
        b_lim = cuda.local.array(b_pt, int32)
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        tid = cuda.threadIdx.x
        wg = tid // WARPGROUP
        base_addr = shared_address(ring, 0)
        base = ((uint32(1024) - (base_addr & uint32(1023))) & uint32(1023)) >> uint32(2)   # first aligned word
        first = uint32(tid >> 3)                          # the thread's copy slices: rows first + p·step, chunk
        chunk = uint32(tid & 7)
        a_dst0 = base + swizzled_word(first, chunk)
        b_dst0 = a_dst0 + uint32(a_stage)
        tiles_m = (T + bm - 1) // bm
        tiles_n = (n_cols + bn - 1) // bn
        n_kt = (k + WGMMA_BK - 1) // WGMMA_BK
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
            # the first tiles: weights before the PDL wait, x after it; group s holds tile s (the first group also
            # every prologue weight tile)
            n_first = min(nk, ahead)
            for s in range(n_first):
                _copy_k_tile(w32, ring, b_dst0 + uint32(s * stage), b_src, b_lim, b_pt, step, chunk,
                             (kt0 + s) * WGMMA_BK, k)
            grid_dependency_wait()
            if NORM and unit == cuda.blockIdx.x:
                add_rms_norm_prologue(residual_in32, delta32, has_delta, norm_weight32, eps, weight_offset,
                                      round_before_weight, residual_out32, x32, handoff, owners, T)
            for s in range(n_first):
                _copy_k_tile(x32, ring, a_dst0 + uint32(s * stage), a_src, a_lim, a_pt, step, chunk,
                             (kt0 + s) * WGMMA_BK, k)
                cp_async_commit()
            for s in range(n_first, ahead):              # empty groups: the waits count `ahead` groups
                cp_async_commit()
            cur = uint32(0)                              # the stage K tile i sits in (i mod stages) ...
            slot = uint32(ahead)                         # ... and the one K tile i + ahead goes to
            for i in range(nk):
                wait_ring()
                fence_proxy_async()
                cuda.syncthreads()
                if i + ahead < nk:
                    k0 = (kt0 + i + ahead) * WGMMA_BK
                    _copy_k_tile(x32, ring, a_dst0 + slot * uint32(stage), a_src, a_lim, a_pt, step, chunk, k0, k)
                    _copy_k_tile(w32, ring, b_dst0 + slot * uint32(stage), b_src, b_lim, b_pt, step, chunk, k0, k)
                cp_async_commit()
                a_desc = smem_desc(base_addr + uint32(4) * (base + cur * uint32(stage) + uint32(wg * 64 * ROW_WORDS)))
                b_desc = smem_desc(base_addr + uint32(4) * (base + cur * uint32(stage) + uint32(a_stage)))
                cur = uint32(0) if cur == uint32(stages - 1) else cur + uint32(1)
                slot = uint32(0) if slot == uint32(stages - 1) else slot + uint32(1)
                wgmma_fence()
                for kk in range(WGMMA_BK // 16):
                    wgmma(acc, ring, a_desc + np.uint64(2 * kk), b_desc + np.uint64(2 * kk))
                wgmma_commit()
                wgmma_keep_one(acc)
            wgmma_drain(acc)
            wait_all()
            cuda.syncthreads()                      # every warpgroup is done with the ring before the next unit
            tok0 = m0 + wg * 64 + (tid % WARPGROUP) // 32 * 16
            finish_tile(out, acc, tok0, n0, ws, counters, ring, flag_at, m_tile + tiles_m * n_tile, split, k_splits)

    if NORM:
        @reads_before_wait("w32")                   # the first weight tiles
        @bounded_kernel(nthreads, warps_per_sm)
        def gemm_wgmma_ring_add_rms_norm(residual_in32, delta32, has_delta, norm_weight32, eps, weight_offset,
                                         round_before_weight, residual_out32, x32, w32, out, k, k_splits, ws,
                                         counters, handoff, owners):
            """``residual_out = s = bf16(residual_in + delta)`` (``s = residual_in`` without ``has_delta``), ``x =
            rms_norm(s)`` (``norm``'s flags), ``out = x @ W.T`` (or its SwiGLU): ``gemm_wgmma_ring`` with the
            prologue of the module docstring.  The word views of ``[T, H]`` / ``[H]`` bf16 tensors; ``handoff``
            two zero-at-rest uint32 counters; ``owners`` the blocks that write rows."""
            launch_dependents()
            ring_gemm(x32, w32, out, k, k_splits, ws, counters, residual_in32, delta32, has_delta, norm_weight32,
                      eps, weight_offset, round_before_weight, residual_out32, handoff, owners)

        return gemm_wgmma_ring_add_rms_norm

    @reads_before_wait("w32")                       # the first weight tiles
    @bounded_kernel(nthreads, warps_per_sm)
    def gemm_wgmma_ring(x32, w32, out, k, k_splits, ws, counters):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) on Hopper tensor cores, f32 accumulation.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``;
        ``k`` = K; ``k_splits`` K ranges per output tile, their partials in ``ws`` and ``counters`` (``splitk``;
        stand-ins when ``k_splits`` = 1).  Tiles and pipeline: the module docstring.
        """
        launch_dependents()
        ring_gemm(x32, w32, out, k, k_splits, ws, counters, x32, x32, False, x32, float32(0.0), float32(0.0), False,
                  x32, x32, 1)

    return gemm_wgmma_ring
