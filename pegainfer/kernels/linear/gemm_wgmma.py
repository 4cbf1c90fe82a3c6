"""The Hopper tensor-core GEMM: ``out = x @ W.T`` with warpgroup MMAs (``wgmma``) reading both operands straight from
shared memory, fed by the tensor memory accelerator (TMA), for every T > 16 tokens (a batched decode step's weight
stream up to a long prompt).

Math: ``out[t, n] = bf16(Σ_k x[t, k] · W[n, k])`` with f32 accumulation; gated (``linear_silu_mul``), the weight is
``[gate; up]``, ``2I`` rows, and logical column pair ``(2j, 2j + 1)`` is (gate row j, up row I + j): each pair
becomes one SwiGLU output ``out[t, j]``.

Shapes: x ``[T, K]``, W ``[N, K]``, out ``[T, N]`` (gated: ``[T, I]``), bf16 bits; K a multiple of 8.

Tiles (``geometry.WgmmaGeometry``): a unit of work is a ``bm × bn`` output tile, ``bm = 64 · warpgroups`` tokens ×
``bn`` logical columns, over one K range (split-K).  Consumer warpgroup w holds tokens ``64w .. 64w + 63`` of it as
``64 × bn`` f32 accumulators (``bn / 2`` registers a thread, the layout in ``primitives.wgmma``).  Gated, the tile's
W rows are its ``bn / 2`` gate rows then its ``bn / 2`` up rows, so accumulator column c (c < bn / 2) pairs with
column ``c + bn / 2`` in the same thread.

Warp specialization: a block is ``warpgroups`` consumer warpgroups and one producer warp.

    producer (one thread)                          consumers (every thread)
    for each K tile i of the block's units:        for each K tile i:
      wait empty[s] (phase i / stages - 1)           wait full[s] (phase i / stages)
      full[s] expects bm·128 + bn·128 bytes          4 × wgmma m64 n{bn} k16 on stage s (one group)
      TMA x box [bm, 64] and W box(es) [bn, 64]      wait until only this group is in flight
        into stage s, completing on full[s]          arrive on empty[s - 1]: its group has finished

with ``s = i mod stages``: every stage of the ring can be in flight, the copies need no thread but the producer's,
and the consumers meet no block barrier inside the K loop.  A stage is the x tile then the W tile, rows of 128 bytes
in the 128-byte-swizzled K-major layout that both TMA (the tensor maps' swizzle) and ``wgmma`` (the descriptors)
use; out-of-range rows and K arrive as zeros from TMA.  The producer runs ahead into the next unit while the
consumers round and store the last one.

Split-K (``k_splits`` > 1, ``splitk``): the last block of a tile sums the ranges' partials in a fixed order inside
the same launch (every SM streams when few tokens meet a short weight); its barriers are a named barrier of the
consumer warps.

Launch geometry: 1-D blocks of ``128 · warpgroups + 32`` threads grid-stride over the units, token tiles fastest,
then K splits, then column tiles: a block a unit, or (``WgmmaGeometry.persistent``) one resident wave of blocks
walking them, each block's producer filling the ring for its next unit while the consumers store the last.
Dynamic shared memory (``WgmmaGeometry.shared_bytes``): 1024 bytes of alignment slack, the ring, the full and empty
mbarriers, one word of split-K flag.  PDL: the block lets the next kernel launch at once; the producer starts the
first unit's weight copies before waiting for the kernel before it (weights are never written), the x copies
after.

In the simulator TMA copies at once and ``wgmma`` is emulated from the descriptor and swizzle rules
(``primitives.tma``, ``primitives.wgmma``), so the kernel's indexing is tested without a GPU (slowly: tests use
tiny shapes and one warpgroup).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, silu_mul_bf16, store_packed_pair
from pegainfer.kernels.linear.gemm import store_mma_tiles
from pegainfer.kernels.linear.gemm_wgmma_ring import ROW_WORDS, WGMMA_BK, gemm_wgmma_ring_kernel
from pegainfer.kernels.linear.geometry import WgmmaGeometry, mma_units, resident_wave, wgmma_geometry
from pegainfer.kernels.linear.splitk import build_finish_tile, norm_handoff, split_workspace
from pegainfer.kernels.norm import pairs_per_thread
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (SIMULATOR, WARP, as_words, cuda, device_fn, float32, grid,
                                          grid_dependency_wait, launch_dependents, reads_before_wait,
                                          store_bf16_pair, uint32)
from pegainfer.kernels.primitives.barriers import (mbar_arrive, mbar_arrive_expect_tx, mbar_fence_init, mbar_init,
                                                   mbar_wait, named_barrier)
from pegainfer.kernels.primitives.tma import tensor_map, tma_load_2d, tma_prefetch_map
from pegainfer.kernels.primitives.wgmma import (WARPGROUP, shared_address, smem_desc, wgmma_bf16_m64k16,
                                                wgmma_commit, wgmma_fence, wgmma_wait)



@device_fn
def store_gated_halves(out, acc, packed, half_blocks, tok0, j0):
    """Write a warp's gated ``m64`` rows as SwiGLU outputs: accumulator n8 block i (i < ``half_blocks``) holds gate
    rows ``j0 + 8i ..``, block ``i + half_blocks`` the matching up rows; the lane's columns 2t, 2t + 1 of tokens
    ``tok0 + g`` and ``tok0 + g + 8`` become ``out[tok, j0 + 8i + 2t + e]``.  ``packed``: ``2 · half_blocks`` uint32
    of scratch (rounding first, in a fully unrolled loop, so acc stays in registers)."""
    lane = cuda.threadIdx.x % 32
    g = lane >> 2
    t4 = lane & 3
    T = out.shape[0]
    for i in range(half_blocks):
        for h in range(2):
            lo = silu_mul_bf16(acc[4 * i + 2 * h], acc[4 * (i + half_blocks) + 2 * h])
            hi = silu_mul_bf16(acc[4 * i + 2 * h + 1], acc[4 * (i + half_blocks) + 2 * h + 1])
            packed[2 * i + h] = uint32(lo) | (uint32(hi) << uint32(16))
    n_out = out.shape[1]
    if n_out % 2 == 0:                   # every pair 4-byte aligned (``check_shapes``): one store a pair
        for i in range(half_blocks):
            j = j0 + 8 * i + 2 * t4
            if tok0 + g < T and j < n_out:
                store_bf16_pair(out, tok0 + g, j, packed[2 * i])
            if tok0 + g + 8 < T and j < n_out:
                store_bf16_pair(out, tok0 + g + 8, j, packed[2 * i + 1])
        return
    for i in range(half_blocks):
        j = j0 + 8 * i + 2 * t4
        if tok0 + g < T:
            store_packed_pair(out, tok0 + g, j, packed[2 * i], False)
        if tok0 + g + 8 < T:
            store_packed_pair(out, tok0 + g + 8, j, packed[2 * i + 1], False)


@functools.cache
def _gemm_wgmma_kernel(warpgroups: int, bn: int, stages: int, gated: bool, warps_per_sm: int):
    """Build the wgmma GEMM for one tile shape and ring depth (module docstring; all compile-time: they size
    register arrays and unroll loops).  The split count is a launch argument."""
    bm = 64 * warpgroups
    consumers = WARPGROUP * warpgroups                    # threads 0 .. consumers - 1; the producer warp follows
    nthreads = consumers + WARP
    a_stage, b_stage = bm * ROW_WORDS, bn * ROW_WORDS     # words (multiples of 256: 1024-byte aligned)
    stage = a_stage + b_stage
    stage_bytes = 4 * stage
    w_box = bn // 2 if gated else bn                      # rows of one W copy (gated: the gate half, the up half)
    full_at = 256 + stages * stage                        # words: full[s] at full_at + 2s, empty[s] after them
    empty_at = full_at + 2 * stages
    flag_at = empty_at + 2 * stages
    n_acc = bn // 2
    half_blocks = bn // 16
    wgmma = wgmma_bf16_m64k16(bn)
    wgmma_keep_one = wgmma_wait(1, n_acc)
    wgmma_drain = wgmma_wait(0, n_acc)

    @device_fn
    def store_tiles(out, acc, tok0, col0):
        packed = cuda.local.array(n_acc, uint32)
        if gated:
            store_gated_halves(out, acc, packed, half_blocks, tok0, col0 >> 1)
        else:
            store_mma_tiles(out, acc, packed, 1, bn // 8, tok0, col0, False)

    @device_fn
    def consumers_sync():
        named_barrier(1, consumers)

    finish_tile = build_finish_tile(n_acc, consumers, store_tiles, consumers_sync)

    @device_fn
    def load_w(ring, dst, maps, w_slot, w32, n0, n_out, n_cols, k0, k, bar):
        if gated:
            tma_load_2d(ring, dst, maps, w_slot, w32, n0 >> 1, k0, n_cols, k, w_box, ring, bar)
            tma_load_2d(ring, dst + uint32(w_box * ROW_WORDS), maps, w_slot, w32, n_out + (n0 >> 1), k0, n_cols, k,
                        w_box, ring, bar)
        else:
            tma_load_2d(ring, dst, maps, w_slot, w32, n0, k0, n_cols, k, w_box, ring, bar)

    @reads_before_wait("x_maps", "w_maps")      # the tensor maps' prefetch and the weight boxes (through w_maps)
    @bounded_kernel(nthreads, warps_per_sm)
    def gemm_wgmma(x32, w32, out, k, k_splits, ws, counters, x_maps, x_slot, w_maps, w_slot):
        """``out = x @ W.T`` (or SwiGLU of gate/up row pairs when gated) on Hopper tensor cores, f32 accumulation.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors, read by TMA through the
        tensor maps in slot ``x_slot`` of ``x_maps`` and ``w_slot`` of ``w_maps``), out ``[T, n_out]``; ``k`` = K;
        ``k_splits`` K ranges per output tile, their partials in ``ws`` and ``counters`` (``splitk``; stand-ins when
        ``k_splits`` = 1).
        Tiles, warps and pipeline: the module docstring.
        """
        launch_dependents()
        ring = cuda.shared.array(0, nbtypes.uint32)      # dynamic: slack, the stages, the barriers, the flag
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        tid = cuda.threadIdx.x
        base_addr = shared_address(ring, 0)
        base = ((uint32(1024) - (base_addr & uint32(1023))) & uint32(1023)) >> uint32(2)   # first aligned word
        if tid == consumers:
            tma_prefetch_map(x_maps, x_slot)
            tma_prefetch_map(w_maps, w_slot)
            for s in range(stages):
                mbar_init(ring, base + uint32(full_at + 2 * s), 1)
                mbar_init(ring, base + uint32(empty_at + 2 * s), consumers)
            mbar_fence_init()
        cuda.syncthreads()
        tiles_m = (T + bm - 1) // bm
        tiles_n = (n_cols + bn - 1) // bn
        n_kt = (k + WGMMA_BK - 1) // WGMMA_BK
        s = uint32(0)                                    # the stage of the block's current K tile ...
        phase = uint32(0)                                # ... and the parity of its round of the ring
        if tid >= consumers:
            if tid == consumers:                         # the producer
                first = True
                for unit in range(cuda.blockIdx.x, tiles_m * tiles_n * k_splits, cuda.gridDim.x):
                    m_tile = unit % tiles_m
                    split = (unit // tiles_m) % k_splits
                    n0 = (unit // (tiles_m * k_splits)) * bn
                    m0 = m_tile * bm
                    kt0 = split * n_kt // k_splits
                    nk = (split + 1) * n_kt // k_splits - kt0
                    i0 = 0
                    if first:                            # weights before the PDL wait, x after it
                        i0 = min(nk, stages)
                        for i in range(i0):
                            full = base + uint32(full_at + 2 * i)
                            mbar_arrive_expect_tx(ring, full, stage_bytes)
                            load_w(ring, base + uint32(i * stage + a_stage), w_maps, w_slot, w32, n0, n_out, n_cols,
                                   (kt0 + i) * WGMMA_BK, k, full)
                        grid_dependency_wait()
                        for i in range(i0):
                            tma_load_2d(ring, base + uint32(i * stage), x_maps, x_slot, x32, m0, (kt0 + i) * WGMMA_BK,
                                        T, k, bm, ring, base + uint32(full_at + 2 * i))
                        s = uint32(i0 % stages)
                        phase = uint32(1) if i0 == stages else uint32(0)
                        first = False
                    for i in range(i0, nk):
                        mbar_wait(ring, base + uint32(empty_at) + uint32(2) * s, phase ^ uint32(1))
                        full = base + uint32(full_at) + uint32(2) * s
                        mbar_arrive_expect_tx(ring, full, stage_bytes)
                        k0 = (kt0 + i) * WGMMA_BK
                        tma_load_2d(ring, base + s * uint32(stage), x_maps, x_slot, x32, m0, k0, T, k, bm, ring, full)
                        load_w(ring, base + s * uint32(stage) + uint32(a_stage), w_maps, w_slot, w32, n0, n_out, n_cols,
                               k0, k, full)
                        s += uint32(1)
                        if s == uint32(stages):
                            s = uint32(0)
                            phase ^= uint32(1)
            return
        grid_dependency_wait()
        acc = cuda.local.array(n_acc, float32)
        wg = tid // WARPGROUP
        a_off = uint32(wg * 64 * ROW_WORDS)
        for unit in range(cuda.blockIdx.x, tiles_m * tiles_n * k_splits, cuda.gridDim.x):
            m_tile = unit % tiles_m
            split = (unit // tiles_m) % k_splits
            n_tile = unit // (tiles_m * k_splits)
            kt0 = split * n_kt // k_splits
            nk = (split + 1) * n_kt // k_splits - kt0
            for i in range(n_acc):
                acc[i] = float32(0.0)
            prev = uint32(0)
            for i in range(nk):
                mbar_wait(ring, base + uint32(full_at) + uint32(2) * s, phase)
                at = base_addr + uint32(4) * (base + s * uint32(stage))
                a_desc = smem_desc(at + uint32(4) * a_off)
                b_desc = smem_desc(at + uint32(4 * a_stage))
                wgmma_fence()
                for kk in range(WGMMA_BK // 16):
                    wgmma(acc, ring, a_desc + np.uint64(2 * kk), b_desc + np.uint64(2 * kk))
                wgmma_commit()
                wgmma_keep_one(acc)
                if i > 0:                                # the group before has finished reading its stage
                    mbar_arrive(ring, base + uint32(empty_at) + uint32(2) * prev)
                prev = s
                s += uint32(1)
                if s == uint32(stages):
                    s = uint32(0)
                    phase ^= uint32(1)
            wgmma_drain(acc)
            if nk > 0:
                mbar_arrive(ring, base + uint32(empty_at) + uint32(2) * prev)
            tok0 = m_tile * bm + wg * 64 + (tid % WARPGROUP) // 32 * 16
            finish_tile(out, acc, tok0, n_tile * bn, ws, counters, ring, base + uint32(flag_at),
                        m_tile + tiles_m * n_tile, split, k_splits)

    return gemm_wgmma


def gemm_wgmma(x, w, out, *, gated: bool = False, geometry: WgmmaGeometry | None = None, workspace=None,
               policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Hopper tensor-core GEMM path of ``linear`` / ``linear_silu_mul``.

    ``geometry`` overrides ``geometry.wgmma_geometry`` (benchmarks and tests try tiles and splits).  ``workspace``:
    the f32 split-K workspace (``linear_workspace_size``); without one the picked geometry runs unsplit (a given
    ``geometry`` that splits then raises)."""
    T, k = x.shape
    n_cols = w.shape[0]
    geo = geometry or wgmma_geometry(n_cols, k, T, gated, policy)
    geo = dataclasses.replace(geo, k_splits=max(1, min(geo.k_splits, -(-k // WGMMA_BK))))
    if geometry is None and workspace is None and geo.k_splits > 1:
        geo = dataclasses.replace(geo, k_splits=1)
    x32 = as_words(x)
    ws, counters = split_workspace(workspace, geo, T, n_cols, policy, stand_in=x32)
    if geo.fill == "ring":
        kern = gemm_wgmma_ring_kernel(geo.warpgroups, geo.bn, geo.stages, gated, geo.warps_per_sm)
        launch(kern, gemm_blocks(geo, T, n_cols), geo.threads, x32, as_words(w), out, k, geo.k_splits, ws,
               counters, shared=geo.shared_bytes, name="gemm_wgmma", policy=policy)
        return
    kern = _gemm_wgmma_kernel(geo.warpgroups, geo.bn, geo.stages, gated, geo.warps_per_sm)
    x_maps, x_slot = tensor_map(x, geo.bm)
    w_maps, w_slot = tensor_map(w, geo.bn // 2 if gated else geo.bn)
    launch(kern, gemm_blocks(geo, T, n_cols), geo.threads, x32, as_words(w), out, k, geo.k_splits, ws, counters,
           x_maps, x_slot, w_maps, w_slot, shared=geo.shared_bytes, name="gemm_wgmma", policy=policy)


def gemm_blocks(geo: WgmmaGeometry, n_tokens: int, n_cols: int) -> int:
    """The grid of a launch: a block a unit, or (``geo.persistent``) at most one resident wave walking them."""
    blocks = grid(mma_units(geo, n_tokens, n_cols), sim_cap=4)
    return min(blocks, resident_wave(geo)) if geo.persistent else blocks


def fuses_ring_norm(n_tokens: int, n_cols: int, k: int, gated: bool, policy: LaunchPolicy) -> bool:
    """Whether ``linear_add_rms_norm`` of ``n_tokens`` tokens over a ``[n_cols, k]`` weight takes the ring GEMM with
    the add + RMSNorm prologue (``policy.gemm_norm_prologue`` and the ring is the GEMM's geometry there)."""
    return policy.gemm_norm_prologue and wgmma_geometry(n_cols, k, n_tokens, gated, policy).fill == "ring"


def gemm_wgmma_add_rms_norm(residual_in, delta, norm_weight, eps: float, residual_out, normed_out, w, out, *,
                            gated: bool, weight_offset: float, round_before_weight: bool, workspace,
                            geometry: WgmmaGeometry | None = None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``norm.add_rms_norm_into(residual_in, delta, norm_weight, residual_out, normed_out, ...)`` then ``gemm_wgmma(
    normed_out, w, out)`` in one launch of the ring GEMM with its add + RMSNorm prologue (``gemm_wgmma_ring``'s
    docstring), bit for bit.  ``workspace`` (required): its last two words are the prologue's handoff counters.
    The grid is at most one resident wave (blocks of the launch wait for each other)."""
    T, k = residual_in.shape
    n_cols = w.shape[0]
    geo = geometry or wgmma_geometry(n_cols, k, T, gated, policy)
    if geo.fill != "ring":
        raise ValueError(f"the add + RMSNorm prologue is the ring GEMM's (fill 'ring'), got {geo}")
    geo = dataclasses.replace(geo, k_splits=max(1, min(geo.k_splits, -(-k // WGMMA_BK))))
    x32 = as_words(normed_out)
    ws, counters = split_workspace(workspace, geo, T, n_cols, policy, stand_in=x32)
    handoff = norm_handoff(workspace, policy)
    blocks = gemm_blocks(dataclasses.replace(geo, persistent=True), T, n_cols)   # blocks wait for each other
    owners = 1 if SIMULATOR else min(T, blocks)
    r32 = as_words(residual_in)
    kern = gemm_wgmma_ring_kernel(geo.warpgroups, geo.bn, geo.stages, gated, geo.warps_per_sm, pairs_per_thread(k))
    launch(kern, blocks, geo.threads, r32, r32 if delta is None else as_words(delta), delta is not None,
           as_words(norm_weight), np.float32(eps), np.float32(weight_offset), bool(round_before_weight),
           as_words(residual_out), x32, as_words(w), out, k, geo.k_splits, ws, counters, handoff, owners,
           shared=geo.shared_bytes, name="gemm_wgmma_add_rms_norm", policy=policy)
