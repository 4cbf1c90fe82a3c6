"""The skinny tensor-core kernel: ``out = x @ W.T`` for 1 <= T <= 16 tokens (small decode batches), reading every
weight byte once like the GEMV, with the arithmetic on the tensor cores.

Weights go straight from global memory into ``mma.sync.m16n8k16`` B fragments (16-byte loads, K permuted within
32-wide chunks so that A and B fragments are both whole 16-byte runs), x is read through L1 into A fragments, f32
accumulators, split-K across the warps of a block through shared memory, the fused SwiGLU epilogue
(``gemm.store_mma_tiles``).  The arithmetic of up to 16 tokens (one m16 tile) rides on the tensor cores, so a
16-token batch costs about what one decode step's weight stream costs.  Above 16 tokens the tensor-core GEMM
(``gemm``), which stages the weight in shared memory once for all tokens, is faster.  ``geometry.skinny_geometry`` / ``SKINNY_TUNED`` pick the split.
In the simulator ``mma.sync`` is emulated from the PTX fragment layout (slow: tests use tiny shapes).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, weight_row
from pegainfer.kernels.linear.gemm import store_mma_tiles
from pegainfer.kernels.linear.geometry import SKINNY_MAX_TOKENS, SkinnyGeometry, skinny_geometry
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, cuda, device_fn, float32, grid, load_u32x4,
                                          mma_bf16_m16n8k16, pdl_prologue, uint32)

int64 = np.int64


@functools.cache
def _skinny_kernel(n_tiles: int, unroll: int, warps: int, gated: bool, warps_per_sm: int, upper_rows: bool = True,
                   stages: int = 1):
    """Build the skinny kernel for one m16 token tile × ``n_tiles`` n8 column tiles per warp, ``unroll`` K chunks
    per iteration, a register ring of ``stages`` iterations, blocks of ``warps`` warps (all compile-time: they size
    register arrays and unroll loops).  ``upper_rows=False`` (T <= 8): token rows g + 8 of the A fragment are known
    zeros, never loaded."""
    NT, U, S = n_tiles, unroll, stages
    HALVES = 2 if upper_rows else 1
    XW = 8 * U               # x words per lane per iteration: 2 token rows × 4 words × U chunks
    WW = 4 * NT * U          # weight words per lane per iteration: NT rows × 4 words × U chunks
    SXW, SWW = S * XW, S * WW
    NACC = 4 * NT            # accumulator fragment values per lane
    NPK = 2 * NT
    nthreads = warps * WARP

    @device_fn
    def load_iteration(w32, x32, wrow, wr, xr, wbase, xbase, c_first, k, k_words, t4, g, T):
        """One iteration's loads into ring slot (``wbase``, ``xbase``): ``unroll`` chunks from chunk ``c_first``,
        16 bytes of each of the warp's ``n_tiles`` weight rows and of x for tokens g and g + 8."""
        for u in range(U):
            e = (c_first + u) * 32 + 8 * t4
            word = e // 2
            for j in range(NT):
                if e < k:
                    v0, v1, v2, v3 = load_u32x4(w32, wrow[j] + word)
                else:
                    v0 = v1 = v2 = v3 = uint32(0)
                o = wbase + 4 * (u * NT + j)
                wr[o] = v0
                wr[o + 1] = v1
                wr[o + 2] = v2
                wr[o + 3] = v3
            for h in range(2):                     # token rows g and g + 8
                m = 8 * h + g
                if h < HALVES and e < k and m < T:
                    v0, v1, v2, v3 = load_u32x4(x32, m * k_words + word)
                else:
                    v0 = v1 = v2 = v3 = uint32(0)
                o = xbase + 8 * u + 4 * h
                xr[o] = v0
                xr[o + 1] = v1
                xr[o + 2] = v2
                xr[o + 3] = v3

    @device_fn
    def mma_iteration(acc, wr, xr, wbase, xbase):
        """The tensor-core steps of the iteration held in ring slot (``wbase``, ``xbase``)."""
        for u in range(U):
            xo = xbase + 8 * u
            for j in range(NT):
                wo = wbase + 4 * (u * NT + j)
                o = 4 * j
                d0, d1, d2, d3 = mma_bf16_m16n8k16(xr[xo], xr[xo + 4], xr[xo + 1], xr[xo + 5],
                                                   wr[wo], wr[wo + 1],
                                                   acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                d0, d1, d2, d3 = mma_bf16_m16n8k16(xr[xo + 2], xr[xo + 6], xr[xo + 3], xr[xo + 7],
                                                   wr[wo + 2], wr[wo + 3], d0, d1, d2, d3)
                acc[o] = d0
                acc[o + 1] = d1
                acc[o + 2] = d2
                acc[o + 3] = d3

    @bounded_kernel(nthreads, warps_per_sm)
    def linear_skinny(x32, w32, out, k, k_split):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) for T <= 16 tokens on tensor cores,
        reading every weight byte once, straight from global memory into ``mma.sync.m16n8k16`` B fragments.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``;
        ``k`` = K; ``k_split`` warps share a row group.

        The sum over k does not care in which order k is visited, so the fragments use a permuted K: within a
        32-wide chunk, lane (g = lane >> 2, t = lane & 3) loads 16 bytes (elements 8t .. 8t+8) of weight row g of
        each n8 tile and the same 16 bytes of x for tokens g and g + 8 of each m16 tile.  Words 0, 1 are the
        (k 2t.., k 2t+8..) halves of the first m16n8k16 step, words 2, 3 those of the second, for A and B alike.
        So every load is 16 bytes (the 4 lanes of a row cover 64 contiguous bytes; ``unroll`` chunks make runs of
        64·unroll bytes), no shared memory stages the weights and no barrier stalls the stream.  x (at most
        16 × K bf16) is read through the L1 cache by every warp.  An iteration is ``unroll`` chunks: with
        ``stages`` = 1 a warp issues all of its loads, then its mma steps; with a ring of ``stages`` > 1 (slot s of
        the unrolled loop holds iteration s mod stages) the loads of the next ``stages - 1`` iterations are in
        flight while an iteration's mma steps wait on its own, so the warp never stops streaming.

        Geometry: 1-D blocks of ``warps`` warps.  A block owns ``warps / k_split · 8 · n_tiles`` consecutive
        logical columns (a tile); blocks grid-stride over tiles.  Warp ``group · k_split + part`` takes chunk runs
        ``part, part + k_split, ...``; every warp runs the same number of iterations (chunks past K load zeros), so
        the simulator's emulated mma sees every thread equally often.  Dynamic shared memory (``k_split`` > 1):
        ``4 · warps · 4 · n_tiles · 32`` bytes of partial accumulators, summed by the group's part-0 warp,
        which writes the outputs from its accumulator fragments (columns 2t, 2t + 1 of a fragment are one gate/up
        pair when gated).
        """
        pdl_prologue()
        red = cuda.shared.array(0, nbtypes.float32)   # dynamic: [warps, NACC, 32] partial accumulators
        xr = cuda.local.array(SXW, uint32)            # the load ring: S iterations of x and W fragments
        wr = cuda.local.array(SWW, uint32)
        acc = cuda.local.array(NACC, float32)
        packed = cuda.local.array(NPK, uint32)
        wrow = cuda.local.array(NT, int64)
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        t4 = lane & 3
        part = warp % k_split
        group = warp // k_split
        cols_per_block = (warps // k_split) * 8 * NT
        n_tiles_total = (n_cols + cols_per_block - 1) // cols_per_block
        n_chunks = (k + 31) // 32
        per_iter = k_split * U
        n_iter = (n_chunks + per_iter - 1) // per_iter
        for tile in range(cuda.blockIdx.x, n_tiles_total, cuda.gridDim.x):
            col0 = tile * cols_per_block + group * 8 * NT
            for j in range(NT):
                # rows past the end re-read the last row (loads stay in bounds); their sums are never stored
                wrow[j] = weight_row(min(col0 + 8 * j + g, n_cols - 1), n_out, gated) * k_words
            for i in range(NACC):
                acc[i] = float32(0.0)
            for s in range(S - 1):                 # the ring's first S - 1 iterations of loads
                if s < n_iter:
                    load_iteration(w32, x32, wrow, wr, xr, s * WW, s * XW, (s * k_split + part) * U, k, k_words,
                                   t4, g, T)
            it = 0
            while it < n_iter:
                for s in range(S):                 # unrolled: ring slot s holds iteration it
                    if it < n_iter:
                        ahead = it + S - 1         # refill the slot the previous iteration freed
                        if S == 1:                 # no ring: this iteration's loads, then its mma
                            load_iteration(w32, x32, wrow, wr, xr, 0, 0, (it * k_split + part) * U, k, k_words,
                                           t4, g, T)
                        elif ahead < n_iter:
                            slot = (s + S - 1) % S
                            load_iteration(w32, x32, wrow, wr, xr, slot * WW, slot * XW,
                                           (ahead * k_split + part) * U, k, k_words, t4, g, T)
                        mma_iteration(acc, wr, xr, s * WW, s * XW)
                    it += 1
            if k_split > 1:                        # block-uniform: every thread reaches the barriers
                for i in range(NACC):
                    red[(warp * NACC + i) * WARP + lane] = acc[i]
                cuda.syncthreads()
                if part == 0:
                    for p in range(1, k_split):
                        for i in range(NACC):
                            acc[i] += red[((warp + p) * NACC + i) * WARP + lane]
                cuda.syncthreads()                 # partials read before the next tile overwrites them
            if part == 0:
                store_mma_tiles(out, acc, packed, 1, NT, 0, col0, gated)

    return linear_skinny


def linear_skinny(x, w, out, *, gated: bool = False, geometry: SkinnyGeometry | None = None,
                  policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Skinny tensor-core path of ``linear`` / ``linear_silu_mul`` for 1 <= T <= 16 (``SKINNY_MAX_TOKENS``);
    ``geometry`` overrides ``skinny_geometry`` (benchmarks and tests try splits)."""
    T, k = x.shape
    if T > SKINNY_MAX_TOKENS:
        raise ValueError(f"the skinny path takes at most {SKINNY_MAX_TOKENS} tokens, got {T}")
    n_cols = w.shape[0]
    geo = geometry or skinny_geometry(n_cols, k, T, gated, policy)
    assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
    cols_per_block = geo.warps // geo.k_split * 8 * geo.n_tiles
    shared = 4 * geo.warps * 4 * geo.n_tiles * WARP if geo.k_split > 1 else 0
    kern = _skinny_kernel(geo.n_tiles, geo.unroll, geo.warps, gated, geo.warps_per_sm, T > 8, geo.stages)
    launch(kern, grid(n_cols, cols_per_block, sim_cap=8), geo.warps * WARP,
           as_words(x), as_words(w), out, k, geo.k_split, shared=shared, name="linear_skinny", policy=policy)
