"""Tiled GEMMs: ``out = x @ W.T`` for prompts, where the arithmetic, not the weight stream, is the bottleneck.

* ``gemm_mma`` (the default above 64 tokens on a GPU): block tiles of x and W copied into a ring of shared-memory
  stages with ``cp.async`` (the next stages' copies are in flight, holding no registers, while the current one is
  multiplied), each warp issuing ``mma.sync.m16n8k16`` bf16 -> f32 through an inline-PTX ``@intrinsic``.
* ``gemm_fma``: the same tiling with plain f32 multiply-adds on a register micro-tile.  Portable: it is what
  ``linear`` runs above 8 tokens in the simulator (where inline PTX cannot run).

``mma_bf16_m16n8k16`` and ``pack_bf16x2`` come from ``primitives``, which documents the fragment layout; in the
simulator the mma is emulated from that layout, so the tensor-core kernels' indexing is tested without a GPU.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import WARPS_PER_SM, bounded_kernel, store_packed_pair, weight_row
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, bf16x2_hi, bf16x2_lo, cp_async_16, cp_async_commit,
                                          cp_async_wait_group, cuda, device_fn, float32, grid, kernel, load_u32x4,
                                          mma_bf16_m16n8k16, pack_bf16x2, pdl_prologue, uint32)

# ------------------------------------------------------------------------------------------------ FMA tiles
if SIMULATOR:
    from pegainfer.kernels.linear.common import words_to_f32

    def _fma_tile(acc, a_s, b_s, i0, j0, tm, tn, bk):
        """``acc[i·tn + j] += Σ_kk a_s[kk, i0 + i] · b_s[kk, j0 + j]`` (one K step of a thread's micro-tile)."""
        acc[:tm * tn] += (a_s[:bk, i0:i0 + tm].T @ b_s[:bk, j0:j0 + tn]).ravel()

    def _stage_transposed(src32, word, valid, dst, j, kbase):
        """The 8 bf16 of ``src32[word:word+4]`` (zeros when not ``valid``) as f32 into ``dst[kbase:kbase+8, j]``."""
        dst[kbase:kbase + 8, j] = words_to_f32(src32[word:word + 4]) if valid else np.float32(0.0)
else:
    @device_fn
    def _fma_tile(acc, a_s, b_s, i0, j0, tm, tn, bk):
        """``acc[i·tn + j] += Σ_kk a_s[kk, i0 + i] · b_s[kk, j0 + j]`` (one K step of a thread's micro-tile)."""
        for kk in range(bk):
            for i in range(tm):
                a = a_s[kk, i0 + i]
                for j in range(tn):
                    acc[i * tn + j] += a * b_s[kk, j0 + j]

    @device_fn
    def _stage_transposed(src32, word, valid, dst, j, kbase):
        """The 8 bf16 of ``src32[word:word+4]`` (zeros when not ``valid``) as f32 into ``dst[kbase:kbase+8, j]``."""
        if valid:
            v0, v1, v2, v3 = load_u32x4(src32, word)
        else:
            v0 = v1 = v2 = v3 = uint32(0)
        dst[kbase, j] = bf16x2_lo(v0)
        dst[kbase + 1, j] = bf16x2_hi(v0)
        dst[kbase + 2, j] = bf16x2_lo(v1)
        dst[kbase + 3, j] = bf16x2_hi(v1)
        dst[kbase + 4, j] = bf16x2_lo(v2)
        dst[kbase + 5, j] = bf16x2_hi(v2)
        dst[kbase + 6, j] = bf16x2_lo(v3)
        dst[kbase + 7, j] = bf16x2_hi(v3)


@functools.cache
def _gemm_fma_kernel(bm: int, bn: int, bk: int, tm: int, tn: int, gated: bool):
    """Build the FMA-tiled GEMM for a ``bm × bn`` block tile, ``bk`` K per step, ``tm × tn`` outputs per thread."""
    assert bm % tm == 0 and bn % tn == 0 and bk % 8 == 0 and tn % 2 == 0
    threads_n = bn // tn
    slices_per_row = bk // 8
    tmn = tm * tn

    @kernel
    def gemm_fma(x32, w32, out, k):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) with f32 multiply-adds.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``.

        Geometry: 1-D blocks of exactly ``(bm / tm) · (bn / tn)`` threads; blocks grid-stride over the
        ``ceil(T / bm) · ceil(n_cols / bn)`` tiles, token tiles fastest (neighbouring blocks share a weight tile, so
        W is read from DRAM about once).  Per K step the block stages x ``[bm, bk]`` and W ``[bn, bk]`` transposed
        as f32 in shared memory; thread (ty, tx) accumulates tokens ``ty·tm ..`` × columns ``tx·tn ..``.
        """
        pdl_prologue()
        a_s = cuda.shared.array((bk, bm), float32)
        b_s = cuda.shared.array((bk, bn), float32)
        acc = cuda.local.array(tmn, float32)
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        tx = tid % threads_n
        ty = tid // threads_n
        tiles_m = (T + bm - 1) // bm
        tiles_n = (n_cols + bn - 1) // bn
        for tile in range(cuda.blockIdx.x, tiles_m * tiles_n, cuda.gridDim.x):
            m0 = (tile % tiles_m) * bm
            n0 = (tile // tiles_m) * bn
            for i in range(tm * tn):
                acc[i] = float32(0.0)
            for k0 in range(0, k, bk):
                cuda.syncthreads()                 # previous step's tiles fully read
                for idx in range(tid, (bm + bn) * slices_per_row, nthreads):
                    row = idx // slices_per_row
                    s = idx - row * slices_per_row
                    kk = k0 + 8 * s
                    if row < bm:
                        tok = m0 + row
                        _stage_transposed(x32, tok * k_words + kk // 2, tok < T and kk < k, a_s, row, 8 * s)
                    else:
                        col = n0 + row - bm
                        wr = weight_row(min(col, n_cols - 1), n_out, gated)
                        _stage_transposed(w32, wr * k_words + kk // 2, col < n_cols and kk < k, b_s, row - bm, 8 * s)
                cuda.syncthreads()
                _fma_tile(acc, a_s, b_s, ty * tm, tx * tn, tm, tn, bk)
            for i in range(tm):
                tok = m0 + ty * tm + i
                if tok < T:
                    for j in range(0, tn, 2):
                        word = pack_bf16x2(acc[i * tn + j], acc[i * tn + j + 1])
                        store_packed_pair(out, tok, n0 + tx * tn + j, word, gated)

    return gemm_fma


# Block tiles (bm, bn, bk, tm, tn): 256 threads of 4×4 outputs on a GPU; one warp of 4×4 in the simulator.
_FMA_TILE = (16, 32, 32, 4, 4) if SIMULATOR else (64, 64, 16, 4, 4)


def gemm_fma(x, w, out, *, gated: bool = False, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """FMA-tiled GEMM path of ``linear`` / ``linear_silu_mul``."""
    bm, bn, bk, tm, tn = _FMA_TILE
    T, k = x.shape
    tiles = -(-T // bm) * -(-w.shape[0] // bn)
    launch(_gemm_fma_kernel(bm, bn, bk, tm, tn, gated), grid(tiles, sim_cap=16), (bm // tm) * (bn // tn),
           as_words(x), as_words(w), out, k, name="gemm_fma", policy=policy)


# ------------------------------------------------------------------------------------------------ tensor cores
MMA_BK = 32                  # K per shared-memory stage: two m16n8k16 steps
MMA_ROW_WORDS = MMA_BK // 2
"""Shared-memory row of a stage, in uint32 words (bf16 pairs): 16 words = four 16-byte chunks, stored swizzled
(``_swizzled``) rather than padded, so that a stage of a 128 × 128 tile is 16 KB and three fit in 48 KB."""
MMA_SMEM_BYTES = 64 * 1024   # the stage ring of x and W tiles of one block (dynamic shared memory)
MMA_MAX_STAGES = 4
"""Ring depth at most (deeper rings were slower on the H200: docs/perf/linear.md)."""


@device_fn
def _swizzled(row, word):
    """Word offset of (row, word) in a stage: 16-byte chunk ``c = word // 4`` of a row is stored at chunk
    ``c ^ ((row >> 1) & 3)``.  A fragment load reads rows g = 0..7 at one chunk: rows of equal ``g & 1`` then fall
    in four different chunks, so the 8 × 4 words hit 32 different banks; a 16-byte copy stays one aligned chunk."""
    return row * MMA_ROW_WORDS + 4 * ((word >> 2) ^ ((row >> 1) & 3)) + (word & 3)


@device_fn
def _copy_tile_async(src32, dst, base, per_thread, tid, nthreads, n_slices, row0, n_rows, n_out, gated, k_words,
                     k0, k):
    """Start ``cp.async`` copies of the tile ``[rows row0 .., 32 of K from k0]`` of a ``[n_rows, K]`` operand into
    the stage at ``dst[base ..]`` (swizzled); zeros outside the operand.  The x tile: ``row0 = m0``, ``n_rows = T``,
    not gated; the weight tile: ``row0 = n0``, ``n_rows = n_cols`` logical columns, whose rows ``weight_row``
    finds.  Slice ``idx`` of the tile is row ``idx // 4``, 16-byte chunk ``idx % 4``."""
    for p in range(per_thread):
        idx = tid + p * nthreads
        if idx < n_slices:
            r = idx >> 2
            c = idx & 3
            row = row0 + r
            kk = k0 + 8 * c
            inside = row < n_rows and kk < k
            src = weight_row(min(row, n_rows - 1), n_out, gated) * k_words + min(kk, k - 8) // 2
            cp_async_16(dst, base + _swizzled(r, 4 * c), src32, src, 16 if inside else 0)


@device_fn
def store_mma_tiles(out, acc, packed, mt, nt, tok0, col0, gated):
    """Write a warp's ``mt × nt`` m16n8 f32 accumulator tiles, rounded to bf16: tile (i, j) covers tokens
    ``tok0 + 16i ..`` and logical columns ``col0 + 8j ..``; its fragment ``acc[4(i·nt + j) : +4]`` holds (C/D layout)
    tokens g, g + 8 × columns 2t, 2t + 1 of the lane (g = lane >> 2, t = lane & 3).  Tokens past ``out``'s T and
    columns past the end are dropped; gated, each column pair becomes one SwiGLU output (``store_packed_pair``).
    ``packed`` is ``2·mt·nt`` uint32 of scratch.  Two loops: the first (small body, fully unrolled, so acc stays in
    registers) rounds the accumulators to bf16 pairs; the second writes them."""
    lane = cuda.threadIdx.x % WARP
    g = lane >> 2
    t4 = lane & 3
    T = out.shape[0]
    for i in range(mt * nt):
        packed[2 * i] = pack_bf16x2(acc[4 * i], acc[4 * i + 1])
        packed[2 * i + 1] = pack_bf16x2(acc[4 * i + 2], acc[4 * i + 3])
    for i in range(mt):
        tok = tok0 + 16 * i + g
        for j in range(nt):
            col = col0 + 8 * j + 2 * t4
            if tok < T:
                store_packed_pair(out, tok, col, packed[2 * (i * nt + j)], gated)
            if tok + 8 < T:
                store_packed_pair(out, tok + 8, col, packed[2 * (i * nt + j) + 1], gated)


def mma_stage_bytes(warps_m: int, warps_n: int, mt: int, nt: int) -> int:
    """Shared memory of one stage of the GEMM's ring: the x ``[bm, 32]`` and W ``[bn, 32]`` tiles."""
    return 4 * MMA_ROW_WORDS * (16 * warps_m * mt + 8 * warps_n * nt)


def mma_stages(warps_m: int, warps_n: int, mt: int, nt: int) -> int:
    """Depth of the GEMM's shared-memory ring: as many stages of x and W tiles as fit in ``MMA_SMEM_BYTES`` (at
    most ``MMA_MAX_STAGES``): 4 for 128 × 128 and 64 × 128 tiles."""
    return max(2, min(MMA_MAX_STAGES, MMA_SMEM_BYTES // mma_stage_bytes(warps_m, warps_n, mt, nt)))


@functools.cache
def _gemm_mma_kernel(warps_m: int, warps_n: int, mt: int, nt: int, gated: bool, stages: int,
                     warps_per_sm: int = WARPS_PER_SM):
    """Build the tensor-core GEMM: ``warps_m × warps_n`` warps, each owning ``mt × nt`` m16n8 accumulator tiles, so
    the block tile is ``bm = 16·warps_m·mt`` tokens × ``bn = 8·warps_n·nt`` logical columns; a ring of ``stages``
    K tiles; registers for ``warps_per_sm`` resident warps (``bounded_kernel``)."""
    bm, bn = 16 * warps_m * mt, 8 * warps_n * nt
    nthreads_c = WARP * warps_m * warps_n
    a_slices, b_slices = 4 * bm, 4 * bn                 # 16-byte slices per 32-wide K stage
    a_pt, b_pt = -(-a_slices // nthreads_c), -(-b_slices // nthreads_c)
    a_stage, b_stage = bm * MMA_ROW_WORDS, bn * MMA_ROW_WORDS
    a_smem = stages * a_stage                            # the W stages follow the x stages
    n_acc, a_frag, b_frag, n_packed = 4 * mt * nt, 4 * mt, 2 * nt, 2 * mt * nt
    wait_oldest = cp_async_wait_group(stages - 2)      # all but the newest stages - 2 copy groups have landed
    wait_all = cp_async_wait_group(0)

    @bounded_kernel(nthreads_c, warps_per_sm)
    def gemm_mma(x32, w32, out, k):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) on tensor cores, f32 accumulation.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``.

        Geometry: 1-D blocks of exactly ``32 · warps_m · warps_n`` threads; blocks grid-stride over the
        ``ceil(T / bm) · ceil(n_cols / bn)`` tiles, token tiles fastest.  Shared memory (dynamic, ``stages`` ×
        ``mma_stage_bytes``): a ring of ``stages`` x ``[bm, 32]`` tiles, then one of W ``[bn, 32]`` tiles, rows
        swizzled (``_swizzled``).  K loop
        (the usual multistage pipeline): the copies of the first ``stages - 1`` K tiles go out; at K tile ``kt`` a
        thread waits for its own copies of ``kt``, a barrier makes everyone's visible (and frees the stage read at
        ``kt - 1``), the copies of ``kt + stages - 1`` go into that freed stage, and ``kt`` feeds ``mma.sync``
        (fragments read straight from shared memory in the PTX fragment layout).  Warp (wm, wn) owns tokens
        ``wm·16·mt ..`` × columns ``wn·8·nt ..`` of the tile.
        """
        pdl_prologue()
        ring = cuda.shared.array(0, nbtypes.uint32)   # dynamic: the x stages, then the W stages from word a_smem
        acc = cuda.local.array(n_acc, float32)
        af = cuda.local.array(a_frag, uint32)
        bf = cuda.local.array(b_frag, uint32)
        packed = cuda.local.array(n_packed, uint32)
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        g = lane >> 2
        t4 = lane & 3
        wm = warp % warps_m
        wn = warp // warps_m
        # fragment rows: A rows wm·16·mt + 16i + g (+ 8), B rows wn·8·nt + 8j + g; their bases are multiples of 8,
        # so every row a lane reads has the swizzle of row g (``_swizzled``)
        a_row = (wm * mt * 16 + g) * MMA_ROW_WORDS
        b_row = (wn * nt * 8 + g) * MMA_ROW_WORDS
        swizzle = (g >> 1) & 3
        tiles_m = (T + bm - 1) // bm
        tiles_n = (n_cols + bn - 1) // bn
        n_kt = (k + MMA_BK - 1) // MMA_BK
        for tile in range(cuda.blockIdx.x, tiles_m * tiles_n, cuda.gridDim.x):
            m0 = (tile % tiles_m) * bm
            n0 = (tile // tiles_m) * bn
            for i in range(4 * mt * nt):
                acc[i] = float32(0.0)
            for s in range(stages - 1):
                if s < n_kt:
                    _copy_tile_async(x32, ring, s * a_stage, a_pt, tid, nthreads_c, a_slices, m0, T, 0, False,
                                     k_words, s * MMA_BK, k)
                    _copy_tile_async(w32, ring, a_smem + s * b_stage, b_pt, tid, nthreads_c, b_slices, n0, n_cols,
                                     n_out, gated, k_words, s * MMA_BK, k)
                cp_async_commit()
            for kt in range(n_kt):
                wait_oldest()
                cuda.syncthreads()
                ahead = kt + stages - 1
                if ahead < n_kt:
                    slot = ahead % stages
                    _copy_tile_async(x32, ring, slot * a_stage, a_pt, tid, nthreads_c, a_slices, m0, T, 0, False,
                                     k_words, ahead * MMA_BK, k)
                    _copy_tile_async(w32, ring, a_smem + slot * b_stage, b_pt, tid, nthreads_c, b_slices, n0, n_cols,
                                     n_out, gated, k_words, ahead * MMA_BK, k)
                cp_async_commit()
                a_base = (kt % stages) * a_stage
                b_base = a_smem + (kt % stages) * b_stage
                for ks in range(MMA_BK // 16):
                    # words 8·ks + t4 (k = 16·ks + 2·t4) and 8·ks + 4 + t4 of rows whose swizzle is the lane's;
                    # unsigned indices (``primitives``: no wraparound code per load)
                    lo = 4 * ((2 * ks) ^ swizzle) + t4
                    hi = 4 * ((2 * ks + 1) ^ swizzle) + t4
                    for i in range(mt):
                        r = a_base + a_row + i * 16 * MMA_ROW_WORDS
                        af[4 * i] = ring[uint32(r + lo)]
                        af[4 * i + 1] = ring[uint32(r + 8 * MMA_ROW_WORDS + lo)]
                        af[4 * i + 2] = ring[uint32(r + hi)]
                        af[4 * i + 3] = ring[uint32(r + 8 * MMA_ROW_WORDS + hi)]
                    for j in range(nt):
                        c = b_base + b_row + j * 8 * MMA_ROW_WORDS
                        bf[2 * j] = ring[uint32(c + lo)]
                        bf[2 * j + 1] = ring[uint32(c + hi)]
                    for i in range(mt):
                        for j in range(nt):
                            o = 4 * (i * nt + j)
                            d0, d1, d2, d3 = mma_bf16_m16n8k16(af[4 * i], af[4 * i + 1], af[4 * i + 2],
                                                               af[4 * i + 3], bf[2 * j], bf[2 * j + 1],
                                                               acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                            acc[o] = d0
                            acc[o + 1] = d1
                            acc[o + 2] = d2
                            acc[o + 3] = d3
            wait_all()
            cuda.syncthreads()                      # every warp is done with the ring before the next tile's copies
            store_mma_tiles(out, acc, packed, mt, nt, m0 + wm * mt * 16, n0 + wn * nt * 8, gated)

    return gemm_mma


def mma_tile(n_tokens: int, n_cols: int = 0) -> tuple[int, int, int, int]:
    """(warps_m, warps_n, mt, nt) for T tokens and ``n_cols`` logical columns.  Prefill: 128×128 tiles of 8 warps
    (64×32 per warp) for wide weights (n_cols >= 6144, although ptxas spills ~190 bytes at 128 registers) and for
    long prompts (T >= 1024), faster on the H200 (docs/perf/linear.md); 64×128 tiles (32×32 per warp, no spill)
    for short prompts of narrow weights, where 128×128 tiles would leave SMs idle.  For few tokens one warp row of
    ``ceil(T/16)`` m16 tiles (up to 64 tokens) and 64-column tiles, so that short batches still spread the weight
    over many blocks."""
    if n_tokens > 64:
        wide = (n_cols >= 6144 and n_tokens >= 128) or n_tokens >= 1024
        return (2, 4, 4, 4) if wide else (2, 4, 2, 4)
    return (1, 4, -(-n_tokens // 16), 2)


def gemm_mma(x, w, out, *, gated: bool = False, tile: tuple[int, int, int, int] | None = None,
             stages: int | None = None, warps_per_sm: int = WARPS_PER_SM,
             policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Tensor-core GEMM path of ``linear`` / ``linear_silu_mul`` (``tile``, ``stages``: ``mma_tile``'s and
    ``mma_stages``' choice unless given).  In the simulator ``mma.sync`` is emulated (slow; for testing the kernel's
    indexing: ``linear(impl=None)`` uses the FMA tiles there)."""
    warps_m, warps_n, mt, nt = tile or mma_tile(x.shape[0], w.shape[0])
    stages = stages or mma_stages(warps_m, warps_n, mt, nt)
    T, k = x.shape
    tiles = -(-T // (16 * warps_m * mt)) * -(-w.shape[0] // (8 * warps_n * nt))
    launch(_gemm_mma_kernel(warps_m, warps_n, mt, nt, gated, stages, warps_per_sm), grid(tiles, sim_cap=16),
           32 * warps_m * warps_n, as_words(x), as_words(w), out, k,
           shared=stages * mma_stage_bytes(warps_m, warps_n, mt, nt), name="gemm_mma", policy=policy)
