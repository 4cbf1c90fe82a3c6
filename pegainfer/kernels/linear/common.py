"""What every projection kernel shares: the gate/up column layout, the SwiGLU epilogue, launch bounds, the GPU's
size, and the one inner loop that the GEMV and the one-token GEMV both run.

The inner loops are device functions with a NumPy twin for the simulator, where every device-function call costs
tens of µs (element-by-element loops would make a tiny model's decode step take minutes); each twin computes the
same f32 math on whole slices.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.activation import silu
from pegainfer.kernels.primitives import (WARP, bf16_to_f32, bf16x2_hi, bf16x2_lo, cuda, device_fn, f32_to_bf16,
                                          launch_bounded, load_u32x4, sm_count, uint16, uint32)

WARPS_PER_SM = 16
"""Occupancy the GEMV and the mma GEMM are compiled for: launch bounds ask ptxas to fit 16 warps per SM, i.e. at
most 128 registers per thread (left alone, ptxas takes 130-190 for the GEMV and leaves one block per SM)."""

SMEM_BYTES = 48 * 1024
"""Shared memory a block may use without opting in to more (the multi-token GEMV stages x within this budget)."""


def bounded_kernel(threads_per_block: int, warps_per_sm: int = WARPS_PER_SM):
    """``@kernel`` for blocks of exactly ``threads_per_block`` threads, compiled for ``warps_per_sm`` resident
    warps per SM, i.e. at most 65536 / (32 · warps_per_sm) registers per thread (``primitives.launch_bounded``)."""
    return launch_bounded(threads_per_block, max(1, warps_per_sm * WARP // threads_per_block))


@functools.cache
def shared_optin() -> int:
    """Shared memory one block may opt in to (227 KB on the H200; a nominal 227 KB in the simulator)."""
    if SIMULATOR:
        return 227 * 1024
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def is_contiguous(a) -> bool:
    f = getattr(a, "is_c_contiguous", None)
    return bool(f()) if callable(f) else bool(a.flags["C_CONTIGUOUS"])


@device_fn
def weight_row(col, n_out, gated):
    """Weight row of logical output column ``col``: itself, or for the gated (gate/up) layout the interleaved pair
    mapping ``2j -> j`` (gate), ``2j + 1 -> n_out + j`` (up), with ``n_out = I``."""
    if gated:
        return (col >> 1) + (col & 1) * n_out
    return col


@device_fn
def silu_mul_bf16(g, u):
    """``bf16(bf16(silu(bf16(g))) · bf16(u))`` from the f32 sums ``g`` (gate) and ``u`` (up)."""
    gb = bf16_to_f32(f32_to_bf16(g))
    ub = bf16_to_f32(f32_to_bf16(u))
    act = bf16_to_f32(f32_to_bf16(silu(gb)))
    return f32_to_bf16(act * ub)


@device_fn
def store_packed_pair(out, t, col, word, gated):
    """Write logical columns ``col, col + 1`` (``col`` even) of token ``t`` from their packed bf16 values: two
    outputs, or for the gated layout one SwiGLU output ``out[t, col / 2]``.  Columns past the end are dropped."""
    n_out = out.shape[1]
    if gated:
        if col < 2 * n_out:
            out[t, col >> 1] = silu_mul_bf16(bf16x2_lo(word), bf16x2_hi(word))
    else:
        if col < n_out:
            out[t, col] = uint16(word & uint32(0xFFFF))
        if col + 1 < n_out:
            out[t, col + 1] = uint16(word >> uint32(16))


if SIMULATOR:
    def words_to_f32(words):
        """The bf16 pairs of ``words`` (uint32, lower index in the low half) as f32, in element order."""
        words = np.asarray(words, dtype=np.uint32)
        f = np.empty(2 * len(words), np.float32)
        f[0::2] = (words << np.uint32(16)).view(np.float32)
        f[1::2] = (words & np.uint32(0xFFFF0000)).view(np.float32)
        return f

    def load_row_slices(w32, row_words, off, dst, base, rows):
        """``dst[base+4r : base+4r+4] = w32[row_words[r] + off : +4]`` for ``r < rows`` (16 bytes of each row)."""
        idx = (np.asarray(row_words[:rows]) + off)[:, None] + np.arange(4)
        dst[base:base + 4 * rows] = w32[idx].ravel()
else:
    @device_fn
    def load_row_slices(w32, row_words, off, dst, base, rows):
        """``dst[base+4r : base+4r+4] = w32[row_words[r] + off : +4]`` for ``r < rows`` (16 bytes of each row), all
        loads issued before any is used."""
        for r in range(rows):
            q0, q1, q2, q3 = load_u32x4(w32, row_words[r] + off)
            dst[base + 4 * r] = q0
            dst[base + 4 * r + 1] = q1
            dst[base + 4 * r + 2] = q2
            dst[base + 4 * r + 3] = q3

    @device_fn
    def dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7):
        """``acc[r·toks + t] += Σ_j W_r[j] · x_j`` for ``r < rows``: the 8 bf16 of row r in ``w[base+4r : +4]`` (low
        half first) against one token's 8 f32 values, multiplied and added in element order."""
        for r in range(rows):
            b = base + 4 * r
            a = acc[r * toks + t]
            a += bf16x2_lo(w[b]) * x0
            a += bf16x2_hi(w[b]) * x1
            a += bf16x2_lo(w[b + 1]) * x2
            a += bf16x2_hi(w[b + 1]) * x3
            a += bf16x2_lo(w[b + 2]) * x4
            a += bf16x2_hi(w[b + 2]) * x5
            a += bf16x2_lo(w[b + 3]) * x6
            a += bf16x2_hi(w[b + 3]) * x7
            acc[r * toks + t] = a
