"""The FMA-tiled GEMM: ``out = x @ W.T`` with plain f32 multiply-adds on a register micro-tile (``gemm_fma``).

Portable: it is what ``linear`` runs above 8 tokens in the simulator, where inline PTX cannot run and the emulated
tensor-core kernels are slow.  Block tiles of x and W are staged transposed as f32 in shared memory, each thread
accumulating a ``tm × tn`` micro-tile; the SwiGLU epilogue pairs columns as every path does (``common.weight_row``).
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import store_packed_pair, weight_row
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (as_words, bf16x2_hi, bf16x2_lo, cuda, device_fn, float32, grid, kernel,
                                          load_u32x4, pack_bf16x2, pdl_prologue, uint32)

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
