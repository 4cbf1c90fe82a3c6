"""Matrix products with bf16 weights: ``out = x @ W.T`` (the projections of every layer and the LM head).

Shapes: ``x [tokens, K]``, ``W [N, K]`` (row-major as in Hugging Face checkpoints, K the input dimension),
``out [tokens, N]``, all bf16 bits (``uint16``), products summed in f32 and rounded to bf16 once.

Four implementations; ``linear(..., impl=None)`` picks one from the number of tokens T (``default_impl``): on a GPU
the GEMV for T = 1, the skinny tensor-core kernel for 2 <= T <= 64, the tiled tensor-core GEMM above; in the
simulator the GEMV up to 8 tokens and the FMA tiles above.

* **GEMV** (batch-1 decode; any T in passes of at most 8 tokens).  Memory-bound: every weight byte is read exactly once, so the
  kernel is built to stream W at the GPU's read bandwidth.  Each warp owns ``rows_per_warp`` weight rows; a lane
  reads 16 bytes (8 bf16) of each of them per step with ``load_u32x4``, all rows' loads issued before any is used,
  and the next step's loads issued before the current step's arithmetic (software pipelining).  The tokens' x
  rows are staged once per block in shared memory as f32 and reused by every row of the block; each weight row
  is dotted with all T tokens while it is in registers (T > 1 costs arithmetic, not bandwidth).  A warp's partial
  dot products are summed with ``warp_sum``; when rows are few (short-and-wide matrices such as ``o_proj`` and
  ``down_proj``: 2560 rows), ``k_split`` warps share a row group, each taking every ``k_split``-th 256-wide slice
  of K, and their partial sums meet in shared memory — this keeps all SMs busy.  ``gemv_geometry`` picks these
  parameters per shape.  Above 8 tokens the register tile (8 accumulators per row) and the shared-memory x
  traffic make the multiply-adds, not the weight stream, the bottleneck: the GEMM takes over.
* **Skinny tensor-core kernel** (``"skinny"``, 1 <= T <= 64: batched decode and short prompts).  Reads every
  weight byte once like the GEMV, but straight from global memory into ``mma.sync.m16n8k16`` B fragments (16-byte
  loads, K permuted within 32-wide chunks so that A and B fragments are both whole 16-byte runs), x read through
  L1 into A fragments, f32 accumulators, split-K across the warps of a block through shared memory, the same
  fused SwiGLU epilogue.  The arithmetic of up to 64 tokens rides on the tensor cores, so a 16-token prompt costs
  about what one decode step's weight stream costs.  ``skinny_geometry`` / ``SKINNY_TUNED`` pick its split.
* **GEMM with tensor cores** (``"gemm_mma"``, the default for T > 64 on a GPU): block tiles of x and W copied
  into a ring of shared-memory stages with ``cp.async`` (the next stages' copies are in flight, holding no
  registers, while the current one is multiplied), each warp issuing ``mma.sync.m16n8k16`` bf16 → f32 through an
  inline-PTX ``@intrinsic``.
* **GEMM with FMA tiles** (``"gemm_fma"``): the same tiling with plain f32 multiply-adds on a register micro-tile.
  Portable: it is what runs in the simulator (where inline PTX cannot run) and the reference the mma path is
  checked against.

``linear_preloaded`` is the one-token projection that follows a latency-bound kernel (the o projection after
attention): when the whole matrix fits in the SMs' shared memory, each block copies its rows in before its PDL
wait, while the kernel before still runs, and only multiplies once x is ready.

``linear_silu_mul`` fuses the MLP's gate/up projection with SwiGLU.  ``w_gate_up [2I, K]`` holds the gate rows then
the up rows (as the loader concatenates ``gate_proj`` and ``up_proj``).  Every kernel here sees it as 2I *logical
columns interleaved in pairs*: logical column ``2j`` is gate row ``j`` and ``2j + 1`` is up row ``I + j``
(``_weight_row``).  A pair always lands in one thread (GEMV epilogue, FMA micro-tile, and the mma accumulator
fragment, whose two adjacent columns ``2t, 2t+1`` live in the same lane), which writes
``out[t, j] = bf16(bf16(silu(bf16(g))) · bf16(u))`` — Hugging Face rounds after each op.

``linear_add_rms_norm`` puts the decoder's residual add and RMSNorm in front of a projection (``norm``'s
``add_rms_norm`` semantics, both norm forms, the updated residual written to a second buffer).  For one token it
is a single GEMV launch: every block reads the whole residual row (at most a few KB, from L2), sums its squares in
``norm``'s own order (so the results are bit-identical to the separate ops), stages the normalised row as the x it
multiplies, and writes its own slice of the new residual.  For more tokens it is ``norm.add_rms_norm_into`` +
``linear``.

Requirements: K a multiple of 8 (16-byte loads of whole rows); N arbitrary; x, W, out contiguous.  No kernel
allocates and none takes a per-step value, so every launch can be captured in a CUDA graph.

The GEMV and the mma GEMM are compiled with launch bounds for 16 resident warps per SM (at most 128 registers per
thread; ``WARPS_PER_SM``).  In the simulator: the innermost loops are device functions with NumPy twins (a device
function call costs tens of µs there), ``mma.sync`` is emulated from the PTX fragment layout so the tensor-core
kernel's indexing is tested too, and ``linear(impl=None)`` takes the FMA tiles for T > 8.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.errors import PegainferError
from numba import types as nbtypes  # noqa: E402  (after pegainfer.device: it picks GPU or simulator)
from pegainfer.kernels import norm
from pegainfer.kernels.activation import silu
from pegainfer.kernels.launch import can_overlap, launch
from pegainfer.kernels.policy import DEFAULT_POLICY
from pegainfer.kernels.norm import (add_pair, add_rms_norm_into, check_residual_buffers, inverse_rms,
                                    normalize_pair, pairs_per_thread)
from pegainfer.kernels.primitives import (NO_INDEX, WARP, as_words, bf16_to_f32, bf16x2_hi, bf16x2_lo, bits_f32,
                                          block_argmax, block_sum, math, cuda, device_fn, f32_to_bf16, float32,
                                          grid, kernel, load_u32x4, load_u32_l2,
                                          mma_bf16_m16n8k16, pack_bf16x2, threads, uint16, uint32, cp_async_16,
                                          cp_async_commit, cp_async_wait_group, bulk_barrier_init,
                                          bulk_expect_bytes, bulk_copy, bulk_wait,
                                          warp_sums_to_shared, warp_row_sums_to_shared, launch_dependents,
                                          grid_dependency_wait, pdl_prologue, global_timer)
from pegainfer.kernels import timeline

int32, int64, uint64 = np.int32, np.int64, np.uint64

GEMV_MAX_TOKENS = 8
"""Largest token count the GEMV path takes by default (``linear(..., impl=None)``); above it, the GEMM."""

SMEM_BYTES = 48 * 1024
"""Shared memory a block may use without opting in to more (the GEMV stages x within this budget)."""

IMPLS = ("gemv", "skinny", "gemm_fma", "gemm_mma")


# ================================================================================================ shared helpers
WARPS_PER_SM = 16
"""Occupancy the GEMV and the mma GEMM are compiled for: launch bounds ask ptxas to fit 16 warps per SM, i.e. at
most 128 registers per thread (left alone, ptxas takes 130-190 for the GEMV and leaves one block per SM)."""


def _bounded_kernel(threads_per_block: int, warps_per_sm: int = WARPS_PER_SM):
    """``@kernel`` for blocks of exactly ``threads_per_block`` threads, compiled for ``warps_per_sm`` resident
    warps per SM, i.e. at most 65536 / (32 · warps_per_sm) registers per thread (``launch_bounds`` is a GPU-only
    option: the simulator's ``cuda.jit`` rejects it)."""
    if SIMULATOR:
        return kernel
    min_blocks = max(1, warps_per_sm * WARP // threads_per_block)
    return cuda.jit(cache=True, launch_bounds=(threads_per_block, min_blocks))


@device_fn
def _weight_row(col, n_out, gated):
    """Weight row of logical output column ``col``: itself, or for the gated (gate/up) layout the interleaved pair
    mapping ``2j -> j`` (gate), ``2j + 1 -> n_out + j`` (up), with ``n_out = I``."""
    if gated:
        return (col >> 1) + (col & 1) * n_out
    return col


@device_fn
def _silu_mul_bf16(g, u):
    """``bf16(bf16(silu(bf16(g))) · bf16(u))`` from the f32 sums ``g`` (gate) and ``u`` (up)."""
    gb = bf16_to_f32(f32_to_bf16(g))
    ub = bf16_to_f32(f32_to_bf16(u))
    act = bf16_to_f32(f32_to_bf16(silu(gb)))
    return f32_to_bf16(act * ub)


@device_fn
def _store_packed_pair(out, t, col, word, gated):
    """Write logical columns ``col, col + 1`` (``col`` even) of token ``t`` from their packed bf16 values: two
    outputs, or for the gated layout one SwiGLU output ``out[t, col / 2]``.  Columns past the end are dropped."""
    n_out = out.shape[1]
    if gated:
        if col < 2 * n_out:
            out[t, col >> 1] = _silu_mul_bf16(bf16x2_lo(word), bf16x2_hi(word))
    else:
        if col < n_out:
            out[t, col] = uint16(word & uint32(0xFFFF))
        if col + 1 < n_out:
            out[t, col + 1] = uint16(word >> uint32(16))


# ================================================================================================ hot-loop helpers
# The innermost loops of the GEMV and of the FMA GEMM are device functions with a NumPy twin for the simulator.  The
# simulator runs kernels as Python, where every device-function call costs tens of µs: element-by-element loops
# would make a tiny model's decode step take minutes.  Each twin computes the same f32 math on whole slices.
if SIMULATOR:
    def _words_to_f32(words):
        """The bf16 pairs of ``words`` (uint32, lower index in the low half) as f32, in element order."""
        words = np.asarray(words, dtype=np.uint32)
        f = np.empty(2 * len(words), np.float32)
        f[0::2] = (words << np.uint32(16)).view(np.float32)
        f[1::2] = (words & np.uint32(0xFFFF0000)).view(np.float32)
        return f

    def _load_row_slices(w32, row_words, off, dst, base, rows):
        """``dst[base+4r : base+4r+4] = w32[row_words[r] + off : +4]`` for ``r < rows`` (16 bytes of each row)."""
        idx = (np.asarray(row_words[:rows]) + off)[:, None] + np.arange(4)
        dst[base:base + 4 * rows] = w32[idx].ravel()

    def _dot_row_slices(acc, w, base, xs, x_base, x_stride, n_tok, rows, toks):
        """``acc[r·toks + t] += Σ_j W_r[j] · xs[x_base + t·x_stride + 32·j]`` for ``r < rows``, ``t < n_tok``, where
        ``W_r[2q], W_r[2q+1]`` are the low / high bf16 of ``w[base + 4r + q]``."""
        wf = _words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        nt = min(int(n_tok), toks)
        xv = xs[x_base + x_stride * np.arange(nt)[:, None] + 32 * np.arange(8)]
        acc.reshape(rows, toks)[:, :nt] += wf @ xv.T

    def _fma_tile(acc, a_s, b_s, i0, j0, tm, tn, bk):
        """``acc[i·tn + j] += Σ_kk a_s[kk, i0 + i] · b_s[kk, j0 + j]`` (one K step of a thread's micro-tile)."""
        acc[:tm * tn] += (a_s[:bk, i0:i0 + tm].T @ b_s[:bk, j0:j0 + tn]).ravel()

    def _load_x_words(x32, k_words, word, dst, base, n_tok, toks):
        """``dst[base+4t : base+4t+4] = x32[t·k_words + word : +4]`` for ``t < min(n_tok, toks)`` (16 bytes of each
        token)."""
        nt = min(int(n_tok), toks)
        idx = (np.arange(nt) * int(k_words) + int(word))[:, None] + np.arange(4)
        dst[base:base + 4 * nt] = x32[idx].ravel()

    def _dot_row_words(acc, w, base, xw, xbase, n_tok, rows, toks):
        """``acc[r·toks + t] += Σ_j W_r[j] · X_t[j]`` for ``r < rows``, ``t < n_tok``: 8 bf16 of each row in
        ``w[base+4r : +4]`` and of each token in ``xw[xbase+4t : +4]``."""
        nt = min(int(n_tok), toks)
        wf = _words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        xf = _words_to_f32(xw[xbase:xbase + 4 * nt]).reshape(nt, 8)
        acc.reshape(rows, toks)[:, :nt] += wf @ xf.T

    def _stage_x_slice(x32, word, xs, base):
        """The 8 bf16 of ``x32[word:word+4]`` as f32 into ``xs[base + 32·j]``, j = 0..7 (the GEMV's x layout)."""
        xs[base:base + 256:32] = _words_to_f32(x32[word:word + 4])

    def _stage_transposed(src32, word, valid, dst, j, kbase):
        """The 8 bf16 of ``src32[word:word+4]`` (zeros when not ``valid``) as f32 into ``dst[kbase:kbase+8, j]``."""
        dst[kbase:kbase + 8, j] = _words_to_f32(src32[word:word + 4]) if valid else np.float32(0.0)
else:
    @device_fn
    def _load_row_slices(w32, row_words, off, dst, base, rows):
        """``dst[base+4r : base+4r+4] = w32[row_words[r] + off : +4]`` for ``r < rows`` (16 bytes of each row), all
        loads issued before any is used."""
        for r in range(rows):
            q0, q1, q2, q3 = load_u32x4(w32, row_words[r] + off)
            dst[base + 4 * r] = q0
            dst[base + 4 * r + 1] = q1
            dst[base + 4 * r + 2] = q2
            dst[base + 4 * r + 3] = q3

    @device_fn
    def _dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7):
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

    @device_fn
    def _dot_row_slices(acc, w, base, xs, x_base, x_stride, n_tok, rows, toks):
        """``acc[r·toks + t] += Σ_j W_r[j] · xs[x_base + t·x_stride + 32·j]`` for ``r < rows``, ``t < n_tok``, where
        ``W_r[2q], W_r[2q+1]`` are the low / high bf16 of ``w[base + 4r + q]``.  (Unsigned shared-memory indices: no
        negative-index wraparound code.)"""
        for t in range(toks):
            if t < n_tok:
                xb = x_base + t * x_stride
                x0 = xs[uint64(xb)]
                x1 = xs[uint64(xb + 32)]
                x2 = xs[uint64(xb + 64)]
                x3 = xs[uint64(xb + 96)]
                x4 = xs[uint64(xb + 128)]
                x5 = xs[uint64(xb + 160)]
                x6 = xs[uint64(xb + 192)]
                x7 = xs[uint64(xb + 224)]
                _dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7)

    @device_fn
    def _load_x_words(x32, k_words, word, dst, base, n_tok, toks):
        """``dst[base+4t : base+4t+4] = x32[t·k_words + word : +4]`` for ``t < min(n_tok, toks)`` (16 bytes of each
        token)."""
        for t in range(toks):
            if t < n_tok:
                q0, q1, q2, q3 = load_u32x4(x32, t * k_words + word)
                dst[base + 4 * t] = q0
                dst[base + 4 * t + 1] = q1
                dst[base + 4 * t + 2] = q2
                dst[base + 4 * t + 3] = q3

    @device_fn
    def _dot_row_words(acc, w, base, xw, xbase, n_tok, rows, toks):
        """``acc[r·toks + t] += Σ_j W_r[j] · X_t[j]`` for ``r < rows``, ``t < n_tok``: 8 bf16 of each row in
        ``w[base+4r : +4]`` and of each token in ``xw[xbase+4t : +4]``."""
        for t in range(toks):
            if t < n_tok:
                b = xbase + 4 * t
                x0 = bf16x2_lo(xw[b])
                x1 = bf16x2_hi(xw[b])
                x2 = bf16x2_lo(xw[b + 1])
                x3 = bf16x2_hi(xw[b + 1])
                x4 = bf16x2_lo(xw[b + 2])
                x5 = bf16x2_hi(xw[b + 2])
                x6 = bf16x2_lo(xw[b + 3])
                x7 = bf16x2_hi(xw[b + 3])
                _dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7)

    @device_fn
    def _fma_tile(acc, a_s, b_s, i0, j0, tm, tn, bk):
        """``acc[i·tn + j] += Σ_kk a_s[kk, i0 + i] · b_s[kk, j0 + j]`` (one K step of a thread's micro-tile)."""
        for kk in range(bk):
            for i in range(tm):
                a = a_s[kk, i0 + i]
                for j in range(tn):
                    acc[i * tn + j] += a * b_s[kk, j0 + j]

    @device_fn
    def _stage_x_slice(x32, word, xs, base):
        """The 8 bf16 of ``x32[word:word+4]`` as f32 into ``xs[base + 32·j]``, j = 0..7 (the GEMV's x layout)."""
        v0, v1, v2, v3 = load_u32x4(x32, word)
        xs[uint64(base)] = bf16x2_lo(v0)
        xs[uint64(base + 32)] = bf16x2_hi(v0)
        xs[uint64(base + 64)] = bf16x2_lo(v1)
        xs[uint64(base + 96)] = bf16x2_hi(v1)
        xs[uint64(base + 128)] = bf16x2_lo(v2)
        xs[uint64(base + 160)] = bf16x2_hi(v2)
        xs[uint64(base + 192)] = bf16x2_lo(v3)
        xs[uint64(base + 224)] = bf16x2_hi(v3)

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


# ================================================================================================ norm prologue
NORM_THREADS = norm.BLOCK_THREADS
"""Block size of ``norm``'s kernels (256 on a GPU, 32 in the simulator).  The fused add + RMSNorm prologue runs in
blocks of exactly this size so that its sum of squares is added in the same order as ``norm.add_rms_norm``'s."""


# ================================================================================================ GEMV (decode)
@functools.cache
def _gemv_kernel(rows_per_warp: int, max_tokens: int, gated: bool, warps: int, stage_x: bool = True,
                 stages: int = 2):
    """Build the GEMV kernel for a register tile of ``rows_per_warp`` weight rows × ``max_tokens`` tokens and
    blocks of ``warps`` warps (compile-time constants: they size the per-lane register arrays, their loops unroll,
    and the block size sets the launch bounds).  ``stage_x=False``: no x staging (see the kernel docstring).
    ``stages``: depth
    of the per-lane load ring (``stages - 1`` steps of every row's 16-byte loads in flight while one is multiplied)."""
    R = rows_per_warp
    TT = max_tokens
    X4 = 4 * TT
    RT = R * TT                                    # (array sizes must be closure constants, not expressions)
    R4 = 4 * R
    S = stages
    SR4 = S * R4
    SX4 = S * X4
    nthreads = warps * WARP

    @_bounded_kernel(nthreads)
    def gemv(x32, w32, out, k, k_split, k_chunk):
        """``out[t, n] = bf16(Σ_k x[t, k] · W[row(n), k])`` for ``t < T <= max_tokens`` (or SwiGLU of column pairs
        when gated, see the module docstring).

        x32 ``[T · K/2]`` and w32 ``[rows · K/2]``: the bf16 tensors ``[T, K]`` / ``[rows, K]`` seen as flat uint32
        (two bf16 per word); out ``[T, n_out]`` bf16 bits; ``k`` = K; ``k_split`` warps share each row group;
        ``k_chunk`` (a multiple of 256) is how much of K is staged in shared memory at a time.

        Geometry: 1-D blocks of ``warps`` warps (a multiple of ``k_split``).  A block owns
        ``warps / k_split · rows_per_warp`` consecutive logical columns (a *tile*); blocks grid-stride over tiles.
        Lane l of a warp reads the 16-byte slices ``c ≡ l (mod 32)`` of each row (8 elements each): a warp covers 256
        contiguous elements per step.  Loads run ``stages - 1`` steps ahead of the arithmetic through a register ring
        (slot ``s`` of the unrolled inner loop holds step ``s mod stages``), so each lane keeps
        ``(stages - 1) · rows_per_warp`` 16-byte loads in flight: a decode GEMV reads cold weights from HBM, and a
        warp whose loads wait one after another is latency-bound, not bandwidth-bound.  Dynamic shared memory: ``4 · (max_tokens · k_chunk + warps · rows_per_warp ·
        max_tokens)`` bytes: x staged as f32, then the per-warp partial sums.  Within a token's chunk, element
        ``8c + j`` sits at ``256·(c // 32) + 32·j + c % 32``: the 32 lanes of a step read 32 consecutive words
        (no bank conflicts), and the 8 elements of a lane's slice are a constant 32 words apart.
        Built with ``stage_x=False`` the kernel stages nothing: ``k_chunk`` covers all of K, each lane loads the
        16 bytes of x of its slice for every token beside (and one step ahead with) its weight loads, and only the
        partial sums use shared memory (``4 · warps · rows_per_warp · max_tokens`` bytes).

        """
        pdl_prologue()
        T = out.shape[0]
        n_out = out.shape[1]
        n_cols = 2 * n_out if gated else n_out
        k_words = k // 2
        smem = cuda.shared.array(0, nbtypes.float32)  # dynamic; a numba type (the simulator needs its itemsize)
        red_base = TT * k_chunk if stage_x else 0
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        part = warp % k_split                      # which K slices this warp takes within its row group
        group = warp // k_split
        groups = warps // k_split
        cols_per_block = groups * R
        n_tiles = (n_cols + cols_per_block - 1) // cols_per_block
        step = WARP * k_split

        acc = cuda.local.array(RT, float32)        # acc[r · TT + t]: lane's partial dot of row r with token t
        wrow = cuda.local.array(R, int64)          # word offset of each of the warp's rows
        wbuf = cuda.local.array(SR4, uint32)       # ring of S steps × 16 bytes per row: S - 1 steps in flight
        xbuf = cuda.local.array(SX4, uint32)       # (stage_x=False) the same ring for 16 bytes of x per token
        staged = -1
        for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
            col0 = tile * cols_per_block + group * R
            for r in range(R):
                # rows past the end re-read the last row (keeps loads in bounds); their sums are never stored
                wrow[r] = _weight_row(min(col0 + r, n_cols - 1), n_out, gated) * k_words
            for i in range(RT):
                acc[i] = float32(0.0)
            for k0 in range(0, k, k_chunk):
                n_slices = min(k_chunk, k - k0) // 8
                w_off = k0 // 2
                c = part * WARP + lane
                # The first S - 1 steps' loads go out before x is staged: their latency overlaps the staging.
                for s in range(S - 1):
                    cs = c + s * step
                    if cs < n_slices:
                        _load_row_slices(w32, wrow, w_off + 4 * cs, wbuf, s * R4, R)
                        if not stage_x:
                            _load_x_words(x32, k_words, w_off + 4 * cs, xbuf, s * X4, T, TT)
                if stage_x and k0 != staged:       # the block-uniform test: every thread reaches the barriers
                    cuda.syncthreads()
                    for idx in range(tid, T * n_slices, nthreads):
                        t = idx // n_slices
                        sl = idx - t * n_slices
                        _stage_x_slice(x32, t * k_words + w_off + 4 * sl, smem,
                                       t * k_chunk + 256 * (sl >> 5) + (sl & 31))
                    cuda.syncthreads()
                    staged = k0
                while c < n_slices:
                    for s in range(S):             # unrolled: ring slot s holds slice c
                        c_pre = c + (S - 1) * step     # refill the slot the previous step freed, S - 1 steps ahead
                        if c_pre < n_slices:
                            _load_row_slices(w32, wrow, w_off + 4 * c_pre, wbuf, ((s + S - 1) % S) * R4, R)
                            if not stage_x:
                                _load_x_words(x32, k_words, w_off + 4 * c_pre, xbuf, ((s + S - 1) % S) * X4, T, TT)
                        if c < n_slices:
                            if stage_x:
                                # lane's x: 256·(c // 32) + c % 32 = 8c - 7·lane, as c ≡ lane (mod 32)
                                _dot_row_slices(acc, wbuf, s * R4, smem, 8 * c - 7 * lane, k_chunk, T, R, TT)
                            else:
                                _dot_row_words(acc, wbuf, s * R4, xbuf, s * X4, T, R, TT)
                        c += step
            # Reduce: lanes within each warp, then the k_split warps of a row group through shared memory.
            warp_sums_to_shared(acc, RT, smem, red_base + warp * RT, False)
            cuda.syncthreads()
            per_out = 2 if gated else 1            # logical columns per output value
            outs_per_group = (R // per_out) * TT
            for item in range(tid, groups * outs_per_group, nthreads):
                g_ = item // outs_per_group
                rem = item - g_ * outs_per_group
                r = (rem // TT) * per_out
                t = rem % TT
                col = tile * cols_per_block + g_ * R + r
                if t < T and col < n_cols:
                    v0 = float32(0.0)
                    v1 = float32(0.0)
                    for p in range(k_split):
                        w_ = (g_ * k_split + p) * RT
                        v0 += smem[red_base + w_ + r * TT + t]
                        if gated:
                            v1 += smem[red_base + w_ + (r + 1) * TT + t]
                    if gated:
                        out[t, col >> 1] = _silu_mul_bf16(v0, v1)
                    else:
                        out[t, col] = f32_to_bf16(v0)
            cuda.syncthreads()                     # partial sums read before the next tile overwrites them

    return gemv


@dataclass(frozen=True)
class GemvGeometry:
    """Launch parameters of the GEMV.

    rows_per_warp: weight rows a warp streams together (loads in flight per lane; x reuse).  Even when gated.
    warps: warps per block (a multiple of ``k_split``).
    k_split: warps that share one row group, each taking every ``k_split``-th 256-wide slice of K.
    max_tokens: tokens per pass (1, 2, 4 or 8; a compile-time register tile).
    k_chunk: elements of K staged in shared memory at a time (a multiple of 256); None: as many as fit.
    stage_x: stage x in shared memory (as f32, once per block and chunk: two barriers); False: every lane reads
      its 16 bytes of x per token beside its weight loads (L1 hits; no staging prologue, no barrier in the K loop).
    stages: depth of the load ring (``stages - 1`` steps of loads in flight per lane; 2 = one step ahead).
    persistent: launch at most one resident wave of blocks (``WARPS_PER_SM // warps`` per SM) that grid-stride over
      the tiles, instead of one block per tile (x is then staged once per block, and no block waits for a slot).
    """
    rows_per_warp: int
    warps: int
    k_split: int
    max_tokens: int
    k_chunk: int | None = None
    stage_x: bool = True
    stages: int = 2
    persistent: bool = False


def _tuned_t1(rows_per_warp: int, warps: int, k_split: int, stages: int) -> GemvGeometry:
    return GemvGeometry(rows_per_warp=rows_per_warp, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                        persistent=True)


GEMV_TUNED: dict[tuple[int, int, int, bool], GemvGeometry] = {
    # One-token kernel, measured on the H200 with cold weights (``benchmarks/bench_decode_stream.py --model M``: a
    # graph of one launch per layer, each on its own matrix; the first projection of a layer and gate_up with the
    # fused norm), then confirmed end to end with ``benchmarks/ab_bench.py`` (``benchmarks/RESULTS.md``, session 8).
    # µs per launch: this geometry / the one before session 8's sweep
    # Qwen3-4B
    # qkv: stages 4 measured +0.14 % in session 18; in session 22 −0.15 / −0.18 % on one machine, +0.37 % on the next
    (6144, 2560, 1, False): _tuned_t1(4, 8, 1, 3),     # qkv
    (2560, 4096, 1, False): _tuned_t1(2, 4, 4, 6),     # o         9.5 (also Qwen3.5's o and out_proj)
    (19456, 2560, 1, True): _tuned_t1(2, 8, 1, 6),     # gate_up  26.8 / 30.6
    (2560, 9728, 1, False): _tuned_t1(2, 8, 8, 6),     # down     14.9
    (151936, 2560, 1, False): _tuned_t1(4, 8, 1, 4),   # lm_head 182.5
    # Qwen3-8B (hidden 4096, q 4096, kv 1024, intermediate 12288); 4.513 vs 4.673 ms TPOT with the 4B analogues
    (6144, 4096, 1, False): _tuned_t1(2, 8, 2, 6),     # qkv      17.8 / 18.9
    (4096, 4096, 1, False): _tuned_t1(4, 8, 2, 3),     # o        10.4 / 10.6
    (24576, 4096, 1, True): _tuned_t1(4, 8, 1, 4),     # gate_up  50.7 / 51.7
    (4096, 12288, 1, False): _tuned_t1(4, 8, 4, 3),    # down     27.1 / 30.3
    (151936, 4096, 1, False): _tuned_t1(4, 8, 1, 4),   # lm_head (by analogy)
    # Qwen3.5-4B (hidden 2560, intermediate 9216; Gated DeltaNet in_proj 12352 rows, gated full-attention qkv 10240)
    (12352, 2560, 1, False): _tuned_t1(4, 8, 2, 4),    # in_proj  18.3 / 22.4 (stages 3 before session 18: −0.1 %)
    (10240, 2560, 1, False): _tuned_t1(2, 8, 1, 6),    # qkv      16.7 / 20.5
    (18432, 2560, 1, True): _tuned_t1(2, 8, 1, 6),     # gate_up  26.6 / 30.6
    (2560, 9216, 1, False): _tuned_t1(2, 8, 8, 6),     # down     14.9
}
"""Measured best geometries, ``(n_cols, K, max_tokens, gated) -> GemvGeometry``, overriding the heuristic in
``gemv_geometry`` (``benchmarks/bench_decode_stream.py`` prints entries in this form)."""

GEMV_TUNING_ENV = "PEGAINFER_GEMV_TUNING"
"""Environment variable naming a JSON file of measured geometries to merge into ``GEMV_TUNED`` at import (what
``benchmarks/bench_decode_stream.py --tuning-out FILE`` writes: tune on your GPU, then point this at the file)."""


def load_gemv_tuning(path: str) -> int:
    """Merge ``[{"n_cols", "k", "max_tokens", "gated", "geometry": {GemvGeometry fields}}, ...]`` from a JSON file
    into ``GEMV_TUNED`` and ``[{"n_cols", "k", "m_tiles", "gated", "geometry": {SkinnyGeometry fields}}, ...]``
    into ``SKINNY_TUNED``; returns the number of entries."""
    import json
    with open(path) as f:
        entries = json.load(f)
    for e in entries:
        if "m_tiles" in e:
            SKINNY_TUNED[int(e["n_cols"]), int(e["k"]), int(e["m_tiles"]), bool(e["gated"])] = \
                SkinnyGeometry(**e["geometry"])
        else:
            GEMV_TUNED[int(e["n_cols"]), int(e["k"]), int(e["max_tokens"]), bool(e["gated"])] = \
                GemvGeometry(**e["geometry"])
    return len(entries)


@functools.cache
def _sm_count() -> int:
    return 4 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _token_tile(n_tokens: int) -> int:
    for tt in (1, 2, 4):
        if n_tokens <= tt:
            return tt
    return GEMV_MAX_TOKENS


def gemv_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False) -> GemvGeometry:
    """Pick the GEMV split for a ``[n_cols, k]`` weight (n_cols logical columns: 2I when gated).

    Blocks of 8 warps, compiled for ``WARPS_PER_SM`` = 16 resident warps per SM.  Each warp streams 4 rows (2 when
    the 8-token register tile would not fit in 128 registers) through a load ring 3 steps deep for one token (2
    otherwise).  Then ``k_split`` doubles (while every warp keeps at least 4 steps of 256 elements) until there are
    enough warps to fill every SM once: tall matrices (gate_up, lm_head) need no split; on 132 SMs the Qwen3-4B
    qkv (6144×2560) gets k_split 2, o (2560×4096) and down (2560×9728) get 4.  A tall one-token matrix that needs
    no split and is not an LM head (under 65536 columns) takes 2 rows per warp and a ring 6 deep instead: on the
    H200 that was within 1.6 % of the best of each of the five such shapes swept (the gate_up of all three served
    models, Qwen3.5-4B's in_proj and qkv) and 2 % (K = 4096) to 12-19 % (K = 2560) faster than 4 rows × 3
    (``benchmarks/RESULTS.md``, session 8).  Shapes in ``GEMV_TUNED`` skip all this; ``benchmarks/bench_decode_stream.py`` measures more.
    """
    tt = _token_tile(n_tokens)
    if SIMULATOR:                                  # small blocks: one Python thread per CUDA thread
        return GemvGeometry(rows_per_warp=16, warps=1, k_split=1, max_tokens=tt)
    if (n_cols, k, tt, gated) in GEMV_TUNED:
        return GEMV_TUNED[n_cols, k, tt, gated]
    rows = 4 if tt <= 2 else 2
    slots = WARPS_PER_SM * _sm_count()
    k_split = 1
    while (n_cols // rows) * k_split < slots and k_split < 8 and k >= 2048 * k_split:
        k_split *= 2
    if tt == 1 and k_split == 1 and n_cols < 65536:
        return GemvGeometry(rows_per_warp=2, warps=8, k_split=1, max_tokens=1, stages=6, persistent=True)
    return GemvGeometry(rows_per_warp=rows, warps=8, k_split=k_split, max_tokens=tt, stages=3 if tt == 1 else 2,
                        persistent=tt == 1)


def _gemv_k_chunk(k: int, geo: GemvGeometry) -> int:
    """Largest multiple of 256 elements of K whose x (f32, ``max_tokens`` rows) fits in shared memory beside the
    partial sums; never more than K rounded up to 256."""
    if geo.k_chunk is not None:
        assert geo.k_chunk % 256 == 0, "k_chunk must be a multiple of 256"
        return geo.k_chunk
    red = geo.warps * geo.rows_per_warp * geo.max_tokens
    fit = (SMEM_BYTES // 4 - red) // geo.max_tokens // 256 * 256
    return max(256, min(fit, -(-k // 256) * 256))


def _is_contiguous(a) -> bool:
    f = getattr(a, "is_c_contiguous", None)
    return bool(f()) if callable(f) else bool(a.flags["C_CONTIGUOUS"])


def gemv(x, w, out, *, gated: bool = False, geometry: GemvGeometry | None = None) -> None:
    """GEMV path of ``linear`` / ``linear_silu_mul``.  Any T: passes of at most 8 tokens (``geometry.max_tokens``
    when given), each reading W once.  ``geometry`` overrides ``gemv_geometry`` (benchmarks and tests try splits)."""
    T, k = x.shape
    n_cols = w.shape[0]
    w32 = as_words(w)
    per_pass = geometry.max_tokens if geometry else GEMV_MAX_TOKENS
    for t0 in range(0, T, per_pass):
        t1 = min(T, t0 + per_pass)
        xp, outp = (x, out) if t1 - t0 == T else (x[t0:t1], out[t0:t1])
        geo = geometry or gemv_geometry(n_cols, k, t1 - t0, gated)
        assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
        assert not gated or geo.rows_per_warp % 2 == 0, f"the gated GEMV needs an even rows_per_warp: {geo}"
        if t1 - t0 == 1 and geo.max_tokens == 1 and geo.stage_x and geo.k_chunk is None:
            _gemv_decode(xp, None, None, None, 0.0, None, w, outp, gated, 0.0, True, geo)   # one token
            continue
        k_chunk = _gemv_k_chunk(k, geo) if geo.stage_x else -(-k // 256) * 256
        cols_per_block = geo.warps // geo.k_split * geo.rows_per_warp
        x_floats = geo.max_tokens * k_chunk if geo.stage_x else 0
        shared = 4 * (x_floats + geo.warps * geo.rows_per_warp * geo.max_tokens)
        kern = _gemv_kernel(geo.rows_per_warp, geo.max_tokens, gated, geo.warps, geo.stage_x, geo.stages)
        n_tiles = -(-n_cols // cols_per_block)
        blocks = _resident_blocks(n_tiles, geo) if geo.persistent else grid(n_cols, cols_per_block, sim_cap=8)
        launch(kern, blocks, geo.warps * WARP, as_words(xp), w32, outp, k, geo.k_split, k_chunk, shared=shared,
               name="gemv", pdl=True)


# ================================================================================================ GEMV, one token
@device_fn
def _x_word_index(c, j):
    """Shared-memory word of bf16 pair ``j`` (0..3) of 16-byte slice ``c`` of the one-token GEMV's staged x:
    ``128·(c // 32) + 32·j + c % 32``, so the 32 lanes of a step (consecutive c) read 32 consecutive words.  (Session
    22 measured groups of 160 words, which take the add + RMSNorm prologue's stores from 8 banks to 32: −0.13 % on
    the Qwen3-4B decode graph, +0.15 % on Qwen3.5-4B; dropped.)"""
    return 128 * (c >> 5) + 32 * j + (c & 31)


if SIMULATOR:
    def _dot_slices_x_words(acc, w, base, x0, x1, x2, x3, rows):
        """``acc[r] += Σ_j W_r[j] · X[j]``: 8 bf16 of row r in ``w[base+4r : +4]``, of x in the words x0..x3."""
        wf = _words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        acc[:rows] += wf @ _words_to_f32([x0, x1, x2, x3])
else:
    @device_fn
    def _dot_slices_x_words(acc, w, base, x0, x1, x2, x3, rows):
        """``acc[r] += Σ_j W_r[j] · X[j]``: 8 bf16 of row r in ``w[base+4r : +4]``, of x in the words x0..x3,
        multiplied and added in element order (``_dot_rows_8`` with one token)."""
        _dot_rows_8(acc, w, base, 0, rows, 1, bf16x2_lo(x0), bf16x2_hi(x0), bf16x2_lo(x1), bf16x2_hi(x1),
                    bf16x2_lo(x2), bf16x2_hi(x2), bf16x2_lo(x3), bf16x2_hi(x3))


@functools.cache
def _gemv_decode_kernel(rows_per_warp: int, stages: int, warps: int, gated: bool, norm_pairs: int,
                        trigger: str = "last_tile", gather: bool = False, argmax: bool = False,
                        stamps: bool = False, residual_early: bool = False, whole_pairs: bool = False,
                        x_slices: int = 0):
    """Build the one-token GEMV (batch-1 decode) for ``rows_per_warp`` rows per warp, a load ring ``stages`` deep,
    blocks of ``warps`` warps (all compile-time: they size the register arrays and set the launch bounds) and,
    when ``norm_pairs`` > 0, the add + RMSNorm prologue with that many element pairs per thread; ``gather``: that
    prologue reads row ``row_ids[0]`` of an embedding table as the residual (the first layer's embedding lookup);
    ``argmax``: the kernel also finds the greedy token of its one output row (``HeadArgmax``); ``stamps``: each
    block appends its ``timeline`` record; ``residual_early`` (with the prologue, not ``gather``): the residual is
    read before the PDL wait (``linear_add_rms_norm(residual_ready=True)``); ``whole_pairs``: K / 2 is exactly
    ``norm_pairs`` · threads, so the prologue needs no bounds checks; ``x_slices`` (without the prologue; 0: a
    loop): the 16-byte slices of x each thread stages, at most (all its loads then go out at once)."""
    GATHER = gather
    STAMPS = stamps
    RESIDUAL_EARLY = residual_early and norm_pairs > 0 and not gather
    KIND = 2 if norm_pairs > 0 else 1
    ARGMAX = argmax
    assert not (argmax and gated)
    R, S, U = rows_per_warp, stages, max(1, norm_pairs)
    assert trigger in GEMV_TRIGGERS, trigger
    LAST_TILE, LAST_STREAM = trigger == "last_tile", trigger == "last_stream"
    R4 = 4 * R
    SR4 = S * R4
    NORM = norm_pairs > 0
    nthreads = warps * WARP
    WHOLE = whole_pairs and NORM
    XS = x_slices if not NORM else 0
    XQ = 4 * max(1, XS)

    @_bounded_kernel(nthreads)
    def gemv_decode(x32, w32, out, k, k_split, residual_in32, delta32, norm_weight32, residual_out32, eps,
                    weight_offset, round_before_weight, has_delta, row_ids, head_max, head_index, head_token,
                    head_threshold, head_kept, stamp_buf):
        """``out[0, n] = bf16(Σ_k x[k] · W[row(n), k])`` for one token (or SwiGLU of column pairs when gated), the
        decode step's projection: a stream over W at memory bandwidth, nothing else.

        x32 ``[K/2]``, w32 ``[rows · K/2]`` uint32 (bf16 pairs of x ``[1, K]`` and W ``[rows, K]``), out ``[1, n_out]``
        bf16 bits, ``k`` = K (a multiple of 8), ``k_split`` warps per row group.

        1. *Stage x once per block*: x as bf16 pairs in shared memory (``_x_word_index`` order: no bank conflicts
           when a warp reads the 4 words of its 32 slices), ~``2K`` bytes, so even K = 12288 fits.  With the norm
           prologue (``norm_pairs`` > 0, blocks of ``NORM_THREADS``) x is not read: every block computes
           ``s = bf16(residual + delta)`` (``has_delta``; else ``s = residual``) and ``x = rms_norm(s)`` with weight
           ``norm_weight`` and the norm's ``eps`` / ``weight_offset`` / ``round_before_weight``, from the whole row
           (L2 hits): thread t holds pairs t, t + B, ... (``norm.SUM_ORDER``: bit-identical to ``norm``'s kernels),
           all its loads issued at once; block b writes pairs p with ``(p // B) % grid == b`` of ``residual_out``.
           With ``gather`` the residual is row ``row_ids[0]`` of ``residual_in`` (the embedding table ``[V, K]``;
           an id outside ``[0, V)`` reads as zeros, as ``embedding`` does): the first layer's lookup costs one more
           dependent load here instead of a launch of its own.
        2. *Stream W*: blocks grid-stride over tiles of ``warps / k_split · rows_per_warp`` logical columns (the
           grid is at most one resident wave: ``_resident_blocks``).  Warp ``group · k_split + part`` takes
           ``rows_per_warp`` rows and the 16-byte slices ``c ≡ part · 32 + lane (mod 32 · k_split)`` of each (a warp
           covers 256 contiguous elements of a row per step).  The loads run ``stages - 1`` steps ahead through a
           register ring (slot s of the unrolled inner loop holds step s mod stages): ``(stages - 1) · rows`` 16-byte
           loads in flight per lane, because cold weights come from HBM and a warp that waits on each load in turn
           is latency-bound.  The first tile's loads go out before x is staged, and each next tile's before the
           current tile's reduction barrier.  Launched with PDL (``launch``), the block issues those first loads
           *before* ``grid_dependency_wait``, i.e. while the previous kernel is still finishing: the weights do not
           depend on it, x does.  (Also moving the rest of the first tile into L2 there with ``prefetch.global.L2``
           was measured slower on the H200: +0.2 ms per Qwen3-4B token; so was copying two more steps of it into
           shared memory with ``cp.async``.  So were weight loads with an L2 ``evict_first`` policy, meant to keep
           the Gated DeltaNet state and the KV cache in L2 across steps (session 17:
           ``ld.global.nc.L1::no_allocate.L2::cache_hint``, and the preloaded GEMV's bulk copies likewise): TPOT
           +12.9 % on Qwen3.5-4B, +11.1 % on Qwen3-4B.  Session 20 measured what those first loads are worth:
           issuing 0, 1 or 2 of the ``stages - 1`` steps before the wait (the rest after x is staged) made the
           decode graph 15.0 / 9.6 / 5.3 % slower on Qwen3-4B; copying 2 or 4 more steps of every row of the
           first tile into shared memory with ``cp.async.bulk`` before the wait, the ring refilling from there,
           made it 5.6 / 8.2 % slower (Qwen3.5-4B 5.7 / 8.6 %).  Session 22 issued such copies (2, 3 or 5 steps)
           right *after* the wait instead, behind the prologue's reads or after its sum of squares: +1.7 to +4.8 %
           on Qwen3-4B, +1.4 to +4.9 % on Qwen3.5-4B; gate/up's prologue went from 3.0 to 5.2 µs, its reads of
           delta queued behind the copies.  Fetching delta itself with one ``cp.async.bulk`` after the wait: +0.86 /
           +0.44 %.  Session 23: the first steps split around the prologue's reads of delta -- some before the
           wait, the rest right after those reads are issued, so that the reads queue behind fewer bytes -- gate/up
           2 / 3 / 4 of 5 before: +0.34 / +0.03 / +0.05 %, qkv 1 of 2: +0.66 %.)  The block lets the next kernel launch (``launch_dependents``) when it
           starts its last tile (``GEMV_TRIGGER``), not at its start: blocks launched early wait on SM slots for
           the whole kernel, and doing so cost 0.2 ms per Qwen3-4B step.
           (Session 23 also copied the end of every row of a block's *last* tile into shared memory with
           ``cp.async.bulk`` once the block had finished the tile one to three before it, so that tile streams
           only the rest through the ring, aimed at gate/up's 5-8 µs spread of block ends: gate/up +3.0 to
           +4.2 %, down +0.6 / +2.4 % on the Qwen3-4B decode graph; the spread stayed.)
        3. *Reduce*: ``warp_sum`` per row, the ``k_split`` partial sums through shared memory, one thread per
           output writes ``bf16(sum)`` (gated: ``_silu_mul_bf16`` of the gate/up pair).
        4. With ``argmax`` (the LM head of a one-sequence step, ``HeadArgmax``): every thread keeps the largest
           output it wrote and its column (the first of equals; NaN never wins), the block reduces them
           (``block_argmax``: ties → the smaller column) into ``head_max[b]``, ``head_index[b]`` and counts itself
           on ``head_index[-1]``; the block that counts last merges the blocks' pairs the same way and writes the
           greedy token to ``head_token[0]`` (0 when no output beats -inf, as ``sampling.sample``), the max to
           ``head_threshold[0]``, 1 to ``head_kept[0]``, and zeroes the counter.  The sampler then has nothing left
           to do for a greedy row.
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

        n_w = cuda.local.array(U, uint32)           # the norm weights of the prologue's pairs
        s_w = cuda.local.array(U, uint32)           # ... its residual pairs (then the sums)
        if NORM:                                    # weights (no kernel writes them): before the wait
            for u in range(U):
                n_w[u] = norm_weight32[uint64(min(tid + u * nthreads, k_words - 1))]
        if RESIDUAL_EARLY:                          # written by a kernel that has completed (the caller's word)
            for u in range(U):
                s_w[u] = load_u32_l2(residual_in32, uint64(min(tid + u * nthreads, k_words - 1)))

        if trigger == "start":
            launch_dependents()                     # PDL (launch.py): the next kernel may take SMs as ours free
        tile = cuda.blockIdx.x
        if tile < n_tiles:                          # the first tile's loads fly while x is staged
            for r in range(R):
                wrow[r] = _weight_row(min(tile * cols_per_block + group * R + r, n_cols - 1), n_out, gated) * k_words
            for s in range(S - 1):
                cs = first + s * step
                if cs < n_slices:
                    _load_row_slices(w32, wrow, 4 * cs, wbuf, s * R4, R)
        # Weights only so far: from here on x / the residual, which the previous kernel writes.
        grid_dependency_wait()
        if STAMPS:
            t_wait = global_timer()

        if NORM:
            d_w = cuda.local.array(U, uint32)
            last = k_words - 1
            row0 = uint64(0)
            valid = True
            if GATHER:                              # (the ids are read after the wait, as the residual would be)
                token = row_ids[0]
                valid = token >= 0 and token < residual_in32.shape[0] // k_words
                row0 = uint64(token if valid else 0) * uint64(k_words)
            # Everything after the wait runs on every warp of the SM at once, so it is written for few instructions:
            # 32-bit unsigned indices (numba widens integer arithmetic to 64 bits: hence the casts; no
            # negative-index code either), and the owner of pair group u of residual_out (block u mod grid) kept
            # as a running count instead of a division per pair.
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
        elif XS:                                    # every thread's loads of x at once, then its stores
            xq = cuda.local.array(XQ, uint32)
            un_slices = uint32(n_slices)
            for i in range(XS):
                c = uint32(uint32(tid) + uint32(i * nthreads))
                if c < un_slices:
                    xq[4 * i], xq[4 * i + 1], xq[4 * i + 2], xq[4 * i + 3] = load_u32x4(x32, uint32(4) * c)
            for i in range(XS):
                c = uint32(uint32(tid) + uint32(i * nthreads))
                if c < un_slices:                   # _x_word_index(c, j), in 32 bits
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
        cuda.syncthreads()
        if STAMPS:
            t_ready = global_timer()

        red = 128 * ((n_slices + 31) // 32)         # partial sums follow x (padded to whole 32-slice groups)
        per_out = 2 if gated else 1
        t_best = float32(-math.inf)                 # argmax: this thread's largest output and its column
        t_col = int32(NO_INDEX)
        if LAST_TILE and tile + cuda.gridDim.x >= n_tiles:
            launch_dependents()                     # this block's only tile
        while tile < n_tiles:
            for r in range(R):
                acc[r] = float32(0.0)
            c = first
            while c < n_slices:
                for s in range(S):                  # unrolled: ring slot s holds slice c
                    c_pre = c + (S - 1) * step      # refill the slot the previous step freed
                    if c_pre < n_slices:
                        _load_row_slices(w32, wrow, 4 * c_pre, wbuf, ((s + S - 1) % S) * R4, R)
                    if c < n_slices:
                        xb = uint64(128 * (c >> 5) + (c & 31))
                        _dot_slices_x_words(acc, wbuf, s * R4, xs[xb], xs[xb + uint64(32)], xs[xb + uint64(64)],
                                            xs[xb + uint64(96)], R)
                    c += step
            if LAST_STREAM and tile + cuda.gridDim.x >= n_tiles:
                launch_dependents()                 # the last tile's weights are all read
            warp_sums_to_shared(acc, R, xs, red + warp * R, True)   # f32 bits (xs is uint32)
            this_tile = tile
            tile += cuda.gridDim.x
            if LAST_TILE and tile < n_tiles and tile + cuda.gridDim.x >= n_tiles:
                launch_dependents()                 # entering the last tile
            if tile < n_tiles:                      # the next tile's loads fly through the reduction
                for r in range(R):
                    wrow[r] = _weight_row(min(tile * cols_per_block + group * R + r, n_cols - 1), n_out,
                                          gated) * k_words
                for s in range(S - 1):
                    cs = first + s * step
                    if cs < n_slices:
                        _load_row_slices(w32, wrow, 4 * cs, wbuf, s * R4, R)
            cuda.syncthreads()
            for item in range(tid, groups * (R // per_out), nthreads):
                g_ = item // (R // per_out)
                r = (item - g_ * (R // per_out)) * per_out
                col = this_tile * cols_per_block + g_ * R + r
                if col < n_cols:
                    v0 = float32(0.0)
                    v1 = float32(0.0)
                    for p_ in range(k_split):
                        base = uint64(red + (g_ * k_split + p_) * R + r)
                        v0 += bits_f32(xs[base])
                        if gated:
                            v1 += bits_f32(xs[base + uint64(1)])
                    if gated:
                        out[uint64(0), uint64(col >> 1)] = _silu_mul_bf16(v0, v1)
                    else:
                        bits = f32_to_bf16(v0)
                        out[uint64(0), uint64(col)] = bits
                        if ARGMAX:
                            logit = bits_f32(uint32(bits) << uint32(16))
                            if logit > t_best:
                                t_best = logit
                                t_col = int32(col)
            cuda.syncthreads()                      # partial sums read before the next tile overwrites them

        if ARGMAX:
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
        if STAMPS and tid == 0:
            timeline.record(stamp_buf, KIND, t_entry, t_wait, t_ready, n_out)

    return gemv_decode


X_SLICES_AT_ONCE = 8
"""A one-token GEMV without the norm prologue stages x with every thread's loads issued at once when it has at most
this many 16-byte slices to stage (the down projection: 5 a thread); otherwise in a loop, which the compiler
splits into a remainder of single load-then-store trips and groups of four: two round trips where one does."""

RESIDUAL_EARLY = True
"""Whether a one-token GEMV whose caller passes ``residual_ready`` reads the residual before its PDL wait (ahead of
the ring's weight loads, at L2: ``load_u32_l2``), as it does the norm weights; only ``delta`` is read after the wait.
The step timeline (``benchmarks/step_timeline.py``, session 20) showed the add + RMSNorm prologue taking 2.7 µs (qkv)
and 3.7 µs (gate_up) per Qwen3-4B layer from the wait to x staged, against 1.0 µs for the down projection's plain x
read.  Measured on the H200 (``benchmarks/graph_sweep.py``, decode graphs, two pairs each): off +0.38 / +0.34 %
(Qwen3-4B), +0.59 / +0.60 % (Qwen3.5-4B).  The qkv prologue went to 2.3 µs; gate/up's stayed at 3.7 µs, whose blocks
enter ~0.5 µs before their wait and whose x reads return behind their own first ring loads."""

GEMV_TRIGGERS = ("start", "last_tile", "last_stream")
GEMV_TRIGGER = os.environ.get("PEGAINFER_GEMV_TRIGGER", "last_tile")
"""When a block of the one-token GEMV lets the next kernel launch (PDL, ``launch_dependents``): at its ``start``,
when it starts its ``last_tile`` (the default), or when it has read the last tile's weights (``last_stream``).
Blocks of the next kernel that launch early sit on SM slots waiting for this kernel to finish; measured on the
H200 (Qwen3-4B, ``benchmarks/RESULTS.md``) the projections of a step took 2.68 ms triggering at the start and
2.49 ms at the last tile."""

GEMV_TRIGGER_BEFORE_LATENCY_BOUND = os.environ.get("PEGAINFER_GEMV_TRIGGER_LB", GEMV_TRIGGER)
"""The trigger of a GEMV whose next kernel is latency-bound rather than another GEMV (``linear_add_rms_norm(...,
before_latency_bound=True)``: the qkv projection before qk-norm/RoPE, the LM head before the sampler).  The same as
``GEMV_TRIGGER`` unless set: not yet measured apart (``last_stream`` here together with PDL on qk-norm/RoPE,
``PEGAINFER_PDL``, would let that kernel's launch and early loads overlap only the projection's tail)."""


def _gemv_decode(x, residual_in, delta, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                 round_before_weight, geo: GemvGeometry, trigger: str | None = None, row_ids=None,
                 head=None, residual_early: bool = False) -> None:
    """Launch the one-token GEMV: ``x [1, K]`` given, or (``x=None``) the add + RMSNorm prologue over
    ``residual_in`` / ``delta`` / ``norm_weight`` writing ``residual_out`` (blocks of ``NORM_THREADS``);
    ``trigger``: ``GEMV_TRIGGERS`` entry (None: ``GEMV_TRIGGER``); ``row_ids`` (with the prologue): the residual is
    row ``row_ids[0]`` of the table ``residual_in``; ``head``: ``sampling.HeadArgmax`` (its arrays ``part_max``,
    ``part_index``, ``token``, ``threshold``, ``kept``) to write the greedy token of the output row into."""
    assert not gated or geo.rows_per_warp % 2 == 0, f"the gated GEMV needs an even rows_per_warp: {geo}"
    assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
    norm_pairs = 0
    if x is None:
        k = residual_in.shape[1]
        assert geo.warps * WARP == NORM_THREADS, f"the fused norm needs blocks of {NORM_THREADS} threads: {geo}"
        norm_pairs = pairs_per_thread(k)
        r32 = as_words(residual_in)
        d32 = r32 if delta is None else as_words(delta)
        args = (r32, as_words(w), out, k, geo.k_split, r32, d32, as_words(norm_weight), as_words(residual_out))
    else:
        k = x.shape[1]
        x32 = as_words(x)
        args = (x32, as_words(w), out, k, geo.k_split, x32, x32, x32, x32)
    assert k % 8 == 0, f"K must be a multiple of 8, got {k}"
    cols_per_block = geo.warps // geo.k_split * geo.rows_per_warp
    n_tiles = -(-w.shape[0] // cols_per_block)
    early = residual_early and RESIDUAL_EARLY and row_ids is None   # the residual read before the wait
    shared = 4 * (128 * -(-k // 256) + geo.warps * geo.rows_per_warp)
    trigger = trigger or GEMV_TRIGGER
    if trigger not in GEMV_TRIGGERS:
        raise PegainferError(f"GEMV trigger {trigger!r} (PEGAINFER_GEMV_TRIGGER / PEGAINFER_GEMV_TRIGGER_LB) is not "
                             f"one of {', '.join(GEMV_TRIGGERS)}: set one of those or unset the variable")
    x_slices = -(-k // (8 * geo.warps * WARP))     # the plain GEMV: 16-byte slices of x a thread stages
    kern = _gemv_decode_kernel(geo.rows_per_warp, geo.stages, geo.warps, gated, norm_pairs, trigger,
                               row_ids is not None, head is not None, timeline.ENABLED, early,
                               norm_pairs > 0 and k // 2 == norm_pairs * NORM_THREADS,
                               0 if norm_pairs or x_slices > X_SLICES_AT_ONCE else x_slices)
    # the fused norm prologue runs once per block, so that path is always persistent; a bare projection may take one
    # block per tile (``persistent=False``: the hardware scheduler balances blocks, e.g. when a kernel still
    # running holds some SMs that a persistent grid counts on)
    blocks = _resident_blocks(n_tiles, geo) if geo.persistent or x is None else grid(n_tiles, sim_cap=2)
    if head is None:
        head_args = (_unused(np.float32), _unused(np.int32), _unused(np.int32), _unused(np.float32), _unused(np.int32))
    else:
        assert not gated and out.shape[0] == 1 and blocks < head.part_index.shape[0], (out.shape, blocks)
        head_args = (head.part_max, head.part_index, head.token, head.threshold, head.kept)
    launch(kern, blocks, geo.warps * WARP, *args, np.float32(eps), np.float32(weight_offset),
           bool(round_before_weight), delta is not None, _unused(np.int32) if row_ids is None else row_ids,
           *head_args, timeline.stamps_arg(), shared=shared,
           name="gemv_add_rms_norm" if x is None else "gemv", pdl=True)


@functools.cache
def _unused(dtype):
    """A one-element device array for a one-token GEMV argument the launch does not use (``row_ids`` of a GEMV that
    gathers nothing, the argmax outputs of one that finds no token): never read or written."""
    return cuda.to_device(np.zeros(1, dtype))


# ============================================================================ GEMV, one token, weights preloaded
PRELOAD_THREADS = 512
"""Block size of the preloaded GEMV (16 warps; one block per SM, its shared memory holding the block's rows).
Swept on the H200 (session 16, ``benchmarks/ab_bench.py``, two alternating rounds, TPOT vs 256 threads):
128 threads +2.45 % (Qwen3.5-4B) / +3.06 % (Qwen3-4B), 512 +0.31 % / +0.57 % (one round), 1024 +1.22 % / +1.64 %
(one round).  The dot products after the wait matter (16 words a lane at 128 threads cost ~2 µs a launch).
Re-measured once attention released o right after its wait (session 19, ``benchmarks/graph_sweep.py``, decode
graphs at context 80): 512 against 256 −0.57 % (Qwen3-4B), −0.02 % / −0.00 % (Qwen3.5-4B, two pairs): 512 since."""

PRELOAD = True
"""Whether ``linear_preloaded`` preloads at all (False: it is ``linear``; for A/B runs)."""

PRELOAD_BULK = True
"""Copy the preloaded rows with the copy engine (``cp.async.bulk``: a few instructions from one thread) rather than
with every thread's 16-byte ``cp.async`` (40 per thread for a 160 KB slice, through the SM's load/store pipe, which
the kernel before shares while it finishes on the same SM)."""

PRELOAD_RELEASES = ("dots", "copies")
PRELOAD_RELEASE = "copies"
"""When a block of the preloaded GEMV lets the next kernel launch: as soon as its copies are issued (``copies``: the
next GEMV's blocks take the SM room the preloaded kernel leaves and issue their first weight loads while attention
finishes), or once its dot products are done (``dots``).  Measured on the H200 (Qwen3-4B, alternating in one call,
``benchmarks/RESULTS.md`` session 12): TPOT 2.639 ms with ``copies`` vs 2.676 with ``dots``."""

PRELOAD_ROW_SUMS = True
"""Whether the preloaded GEMV sums its rows' lane partials with ``warp_row_sums_to_shared`` (31 shuffles for up to
32 rows) rather than ``warp_sums_to_shared`` (5 a row: 100 for its 20 rows; sm_90 build 67 → 55 registers).
Measured on the H200 (session 16, two alternating rounds, ``benchmarks/RESULTS.md``): TPOT Qwen3.5-4B 2.544 vs
2.554 ms (−0.4 %), Qwen3-4B 2.522 vs 2.529 ms (−0.3 %)."""

BULK_CHUNK_BYTES = 16384
"""Bytes per ``cp.async.bulk`` instruction of the preloaded GEMV.  All of a block's copies go out at once: session 23
measured them paced (copy ``i + p`` issued once copy ``i`` had landed, one mbarrier per copy, so ~``p`` · 16 KB a
block in flight instead of a 21 MB queue in front of attention's dependent reads): Qwen3-4B decode graph +10.0 /
+6.0 / +5.0 / +2.0 % for p = 1 / 2 / 3 / 5, and two bursts (the first 2-6 copies, the rest once those had landed)
+2.1 to +2.3 % with attention releasing o at its start, +2.3 % without; the copies are o's critical path."""


@functools.cache
def _gemv_preloaded_kernel(rows: int, k: int, nthreads: int, bulk: bool = False, release: str = "copies",
                           stamps: bool = False):
    """Build the preloaded one-token GEMV for blocks of ``rows`` weight rows, ``K = k`` and ``nthreads`` threads
    (all compile-time: the copy and dot loops unroll, and ``K / 2`` must be a multiple of ``nthreads``); ``bulk``:
    copy with ``cp.async.bulk`` (``PRELOAD_BULK``); ``release``: ``PRELOAD_RELEASES``; ``stamps``: each block
    appends its ``timeline`` record."""
    STAMPS = stamps
    assert release in PRELOAD_RELEASES, release
    RELEASE_AT_COPIES = release == "copies"
    K_WORDS = k // 2
    XW = K_WORDS // nthreads                    # x words per lane (and weight words per lane and row)
    assert XW * nthreads == K_WORDS, (k, nthreads)
    SLICES = rows * (k // 8)                    # 16-byte pieces of the block's rows
    COPIES = -(-SLICES // nthreads)             # ... per thread
    WARPS = nthreads // WARP
    RED = rows * K_WORDS                        # partial sums follow the rows in shared memory
    BAR = RED + WARPS * rows + (WARPS * rows) % 2   # then the bulk copies' mbarrier (8-byte aligned)
    BULK_CHUNKS = -(-rows * k * 2 // BULK_CHUNK_BYTES)
    ROW_SUMS = PRELOAD_ROW_SUMS and rows <= WARP
    wait_copies = cp_async_wait_group(0)

    @_bounded_kernel(nthreads)
    def gemv_preloaded(x32, w32, out, n_rows, stamp_buf):
        """``out[0, n] = bf16(Σ_k x[k] · W[n, k])`` for one token, with the block's weight rows copied into shared
        memory *before* the kernel waits for x: the projection after a latency-bound kernel (attention, the Gated
        DeltaNet step), whose HBM traffic is otherwise idle while that kernel runs.

        x32 ``[K/2]``, w32 ``[N · K/2]`` uint32 (bf16 pairs of x ``[1, K]`` and W ``[N, K]``), out ``[1, N]`` bf16
        bits, ``n_rows`` = N.  Block b owns rows ``[b·rows, b·rows + rows)``: a contiguous run of ``rows · 2K``
        bytes, which fits in one SM's shared memory (``preload_rows``: N / #SMs rows, e.g. 20 × 4096 bf16 = 160 KB
        for the o projection of Qwen3-4B / Qwen3.5-4B: the whole 21 MB matrix sits in 128 SMs at once).

        1. Every thread starts ``cp.async`` copies of its 16-byte pieces of the rows (none waits for them) -- or,
           with ``bulk``, thread 0 starts ``cp.async.bulk`` copies of 16 KB runs, counted by an mbarrier -- then the
           block waits for the kernel before (PDL: ``launch`` starts this kernel as soon as that one lets it, so the
           copies stream while it still runs).
        2. Lane ``l`` of warp ``w`` reads its ``K / (2 · threads)`` words of x, at ``w · 32 · XW + l + 32 i``
           (coalesced), then waits for the rows: on the mbarrier (``bulk``), or for its own copies and then the
           block barrier.  (Session 21 measured one mbarrier per 3 rows or per row, the dots of landed rows
           overlapping the rest of the copies: +0.55 / +1.1 % on the Qwen3-4B decode graph; removed.)
        3. For every row r, ``acc[r] = Σ_i W_r[word] · x[word]`` over the same words (a warp reads 32 consecutive
           words of a row: no bank conflicts), in word order, low half first.
        4. ``warp_sums_to_shared``, then thread r sums the warps' partials in warp order and writes ``bf16``.
        The next kernel may launch once every block's copies are issued (``release="copies"``, the default), or
        once every block has its dot products (``"dots"``).
        """
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        ws = cuda.shared.array(0, nbtypes.uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid % uint32(WARP)
        warp = tid // uint32(WARP)
        row0 = cuda.blockIdx.x * rows
        n_here = min(rows, n_rows - row0)
        src = uint32(row0 * K_WORDS)
        if bulk:
            n_bytes = uint32(n_here * k * 2)
            if tid == 0:
                bulk_barrier_init(ws, BAR)
                bulk_expect_bytes(ws, BAR, n_bytes)
                for i in range(BULK_CHUNKS):
                    at = uint32(i * BULK_CHUNK_BYTES)
                    if at < n_bytes:
                        bulk_copy(ws, at // uint32(4), w32, src + at // uint32(4),
                                  min(uint32(BULK_CHUNK_BYTES), n_bytes - at), ws, BAR)
            cuda.syncthreads()                  # the barrier is initialised before anyone waits on it
        else:
            n_pieces = uint32(n_here * (k // 8))
            for i in range(COPIES):
                piece = tid + uint32(i * nthreads)
                if piece < n_pieces:
                    cp_async_16(ws, uint32(4) * piece, w32, src + uint32(4) * piece, 16)
            cp_async_commit()
        if RELEASE_AT_COPIES:
            launch_dependents()
        grid_dependency_wait()
        if STAMPS:
            t_wait = global_timer()

        base = warp * uint32(WARP * XW) + lane
        xlo = cuda.local.array(XW, float32)
        xhi = cuda.local.array(XW, float32)
        for i in range(XW):
            word = x32[base + uint32(32 * i)]
            xlo[i] = bf16x2_lo(word)
            xhi[i] = bf16x2_hi(word)
        if bulk:
            bulk_wait(ws, BAR)
        else:
            wait_copies()
            cuda.syncthreads()
        if STAMPS:
            t_ready = global_timer()

        acc = cuda.local.array(rows, float32)
        for r in range(rows):
            a = float32(0.0)
            for i in range(XW):
                word = ws[base + uint32(r * K_WORDS + 32 * i)]
                a += bf16x2_lo(word) * xlo[i]
                a += bf16x2_hi(word) * xhi[i]
            acc[r] = a
        if not RELEASE_AT_COPIES:
            launch_dependents()
        if ROW_SUMS:
            warp_row_sums_to_shared(acc, rows, ws, uint32(RED) + warp * uint32(rows), True)   # f32 bits
        else:
            warp_sums_to_shared(acc, rows, ws, uint32(RED) + warp * uint32(rows), True)
        cuda.syncthreads()
        if tid < n_here:
            v = float32(0.0)
            for w_ in range(WARPS):
                v += bits_f32(ws[uint32(RED + w_ * rows) + tid])
            out[0, row0 + tid] = f32_to_bf16(v)
        if STAMPS and tid == 0:
            timeline.record(stamp_buf, 3, t_entry, t_wait, t_ready, n_rows)

    return gemv_preloaded


@functools.cache
def _shared_optin() -> int:
    """Shared memory one block may opt in to (227 KB on the H200; a nominal 227 KB in the simulator)."""
    if SIMULATOR:
        return 227 * 1024
    return int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)


def _preload_shared(rows: int, k: int, nthreads: int) -> int:
    """Bytes of dynamic shared memory of the preloaded GEMV: the rows, the warps' partial sums, the mbarrier."""
    partials = rows * nthreads // WARP
    return 4 * (rows * k // 2 + partials + partials % 2 + 2)


def preload_rows(n_rows: int, k: int, busy_sms: int = 0) -> int:
    """Rows per block of the preloaded GEMV for a ``[n_rows, k]`` weight: the matrix spread over one block per SM
    (per SM but ``busy_sms``); 0 when that does not fit in shared memory (or K does not split evenly over the block's
    lanes)."""
    nthreads = threads(gpu=PRELOAD_THREADS, sim=WARP)
    if k % (2 * nthreads) or n_rows == 0 or busy_sms >= _sm_count():
        return 0
    rows = -(-n_rows // (_sm_count() - busy_sms))
    if rows > nthreads or _preload_shared(rows, k, nthreads) > _shared_optin():
        return 0
    return rows


PRELOAD_AROUND_BUSY_SMS = True
"""Whether ``linear_preloaded(busy_sms=n)`` spreads the matrix over all SMs but ``n`` (the decode attention's blocks
with work: ``n_kv_heads`` at contexts of one split), so that no block of it waits for an SM that the kernel before
still holds.  The step timeline (session 20, Qwen3-4B) showed the o kernel's blocks entering over 4.8 µs: attention
(210 registers × 256 threads) and an o block (40 × 512) do not fit one SM's registers together, so the o blocks of
the 8 SMs holding attention's working blocks started their copies only when those ended.  Measured on the H200
(session 21, ``benchmarks/graph_sweep.py``, decode graphs at context 80, one call): −0.61 % Qwen3-4B (122 blocks of
21 rows; its blocks now enter within 0.3 µs), +0.03 % Qwen3.5-4B (only its 8 full-attention layers take it).
gate/up still launches at attention's end, not during it: a block of it fits beside an o block, but the second of
its two per SM only once o ends.  (Session 14 measured the same idea for the Gated DeltaNet step's out_proj -- 99
blocks of 26 rows, whose sums then sat in local memory -- 8 % slower.  A register cap on attention so that it and
an o block share an SM instead, 176 registers, measured −0.02 %: removed.)"""


def linear_preloaded(x, w, out, busy_sms: int = 0, *, policy=None) -> None:
    """``linear(x, w, out)`` for a projection that follows a latency-bound kernel (whose working blocks hold
    ``busy_sms`` SMs: ``PRELOAD_AROUND_BUSY_SMS``).  For one token, when the whole
    matrix fits in the SMs' shared memory (``preload_rows``), it is the preloaded GEMV (``_gemv_preloaded_kernel``):
    launched with PDL, its blocks copy their weight rows in while the kernel before still runs, so only the dot
    products from shared memory are left once x is ready.  How early it starts is up to the kernel before: decode
    attention lets it launch right after its PDL wait (``attention.DECODE_RELEASE``: at its start slower, after
    its last K/V load 0.2–1 % slower, session 19), the Gated DeltaNet step once its dependent loads are in (at its
    start 0.8 % slower per token, session 12; ``benchmarks/RESULTS.md``).  It lets the next GEMV launch once its
    copies are issued (``PRELOAD_RELEASE``).  Otherwise, and when ``PRELOAD`` is off, it is ``linear``.

    Tried and dropped (session 14): spreading out_proj's rows over only the 100 SMs that the Gated DeltaNet step
    leaves free (26 rows, 208 KB a block, 99 blocks), so that no block waits for the step's SMs before it can start
    its copies.  Qwen3.5-4B's TPOT went from 2.550 to 2.755 ms (two alternating rounds on the H200).  The compiled
    26-row kernel also keeps its 26 sums in local memory (104-byte stack frame; 20 rows stay in registers).

    Tried and dropped (session 16): the Gated DeltaNet's gated RMSNorm in this kernel's prologue (every block
    normalising all 32 heads of x after its wait, bit-identical to ``gated_rms_norm``; GPU test passed), so that the
    decode step could leave it out and split each head over 1, 2 or 4 blocks.  Qwen3.5-4B TPOT +2.8 % with the
    step's geometry unchanged, +2.6 % with 4 column blocks per head (``benchmarks/RESULTS.md``): 16 gated-norm
    values a thread (an IEEE division each, in SiLU) on this kernel's post-wait path cost ~3 µs a layer, and the
    split won back only ~0.25 µs.

    Tried and dropped (session 17): the dot products on the tensor cores (commit 4ad2d03, ``PRELOAD_MMA``: rows
    ``K/2 + 8`` words apart in shared memory, x staged as ``mma.m16n8k16`` A fragments, one ``mma`` per 16-wide K
    chunk and 8-row tile, four accumulator sets; ~290 dot instructions a lane against ~800).  Correct on the GPU
    (``test_linear_preloaded_mma_qwen3_4b_o``), but TPOT +1.15 % on Qwen3.5-4B and +0.88 % on Qwen3-4B (two
    alternating rounds, ``benchmarks/RESULTS.md``).  Not profiled; what it adds to the post-wait path is x staged
    through shared memory and a block barrier, and the padded rows take 20 bulk copies instead of 10.  Removed.

    Tried and dropped (session 15): taking x through a counter handoff instead of the PDL wait.  Every block of
    decode attention or of the Gated DeltaNet step (before its state write-back) arrived at a counter once its
    outputs were written; this kernel spun on the count after issuing its copies and waited for the grid only at
    its end.  Correct on the GPU, but slower: Qwen3.5-4B TPOT +0.25 % (attention → o), +0.6 % (step → out_proj),
    +0.9 % both (``benchmarks/RESULTS.md``)."""
    _check(x, w, out, False, None)
    busy = busy_sms if PRELOAD_AROUND_BUSY_SMS else 0
    rows = (preload_rows(*w.shape, busy) or preload_rows(*w.shape)) if _preload_on(x.shape[0]) else 0
    if rows == 0:
        _run(x, w, out, False, None)
        return
    n_rows, k = w.shape
    nthreads = threads(gpu=PRELOAD_THREADS, sim=WARP)
    kern = _gemv_preloaded_kernel(rows, k, nthreads, PRELOAD_BULK, PRELOAD_RELEASE, timeline.ENABLED)
    launch(kern, -(-n_rows // rows), nthreads, as_words(x), as_words(w), out, n_rows, timeline.stamps_arg(),
           shared=_preload_shared(rows, k, nthreads), name="gemv_preloaded", pdl=True)


def _preload_on(x_tokens: int) -> bool:
    """One token, and its launch overlaps the kernel before (PDL: sm_90+, which the bulk copies
    need too; without the overlap there is nothing to gain).  The simulator runs the kernel anyway (tests)."""
    return PRELOAD and x_tokens == 1 and (SIMULATOR or (can_overlap() and DEFAULT_POLICY.overlaps("gemv_preloaded")))


def preloads(x_tokens: int, w) -> bool:
    """Whether ``linear_preloaded`` takes the preloaded GEMV for ``x_tokens`` tokens and weight ``w``."""
    return bool(_preload_on(x_tokens) and preload_rows(*w.shape))


# ================================================================================================ GEMM, FMA tiles
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
                        wr = _weight_row(min(col, n_cols - 1), n_out, gated)
                        _stage_transposed(w32, wr * k_words + kk // 2, col < n_cols and kk < k, b_s, row - bm, 8 * s)
                cuda.syncthreads()
                _fma_tile(acc, a_s, b_s, ty * tm, tx * tn, tm, tn, bk)
            for i in range(tm):
                tok = m0 + ty * tm + i
                if tok < T:
                    for j in range(0, tn, 2):
                        word = pack_bf16x2(acc[i * tn + j], acc[i * tn + j + 1])
                        _store_packed_pair(out, tok, n0 + tx * tn + j, word, gated)

    return gemm_fma


# Block tiles (bm, bn, bk, tm, tn): 256 threads of 4×4 outputs on a GPU; one warp of 4×4 in the simulator.
_FMA_TILE = (16, 32, 32, 4, 4) if SIMULATOR else (64, 64, 16, 4, 4)


def gemm_fma(x, w, out, *, gated: bool = False) -> None:
    """FMA-tiled GEMM path of ``linear`` / ``linear_silu_mul``."""
    bm, bn, bk, tm, tn = _FMA_TILE
    T, k = x.shape
    tiles = -(-T // bm) * -(-w.shape[0] // bn)
    launch(_gemm_fma_kernel(bm, bn, bk, tm, tn, gated), grid(tiles, sim_cap=16), (bm // tm) * (bn // tn),
           as_words(x), as_words(w), out, k, name="gemm_fma", pdl=True)


# ================================================================================================ GEMM, tensor cores
# ``mma_bf16_m16n8k16`` (one warp-wide ``mma.sync.m16n8k16``, bf16 in, f32 accumulate) and ``pack_bf16x2`` come from
# ``primitives``, which documents the fragment layout; in the simulator the mma is emulated from that layout, so the
# tensor-core kernels' indexing is tested without a GPU.

MMA_BK = 32                  # K per shared-memory stage: two m16n8k16 steps
MMA_ROW_WORDS = MMA_BK // 2
"""Shared-memory row of a stage, in uint32 words (bf16 pairs): 16 words = four 16-byte chunks, stored swizzled
(``_swizzled``) rather than padded, so that a stage of a 128 × 128 tile is 16 KB and three fit in 48 KB."""
MMA_SMEM_BYTES = 64 * 1024   # the stage ring of x and W tiles of one block (dynamic shared memory)
MMA_MAX_STAGES = 4
"""Ring depth, measured on the H200 at T = 2048 (``RESULTS.md``): 4 stages beat 3 by 1-1.5 % on every Qwen3 /
Qwen3.5 shape; 6-16 stages, or one block per SM with no spills (up to 12 stages), were slower (to -25 %)."""


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
    not gated; the weight tile: ``row0 = n0``, ``n_rows = n_cols`` logical columns, whose rows ``_weight_row``
    finds.  Slice ``idx`` of the tile is row ``idx // 4``, 16-byte chunk ``idx % 4``."""
    for p in range(per_thread):
        idx = tid + p * nthreads
        if idx < n_slices:
            r = idx >> 2
            c = idx & 3
            row = row0 + r
            kk = k0 + 8 * c
            inside = row < n_rows and kk < k
            src = _weight_row(min(row, n_rows - 1), n_out, gated) * k_words + min(kk, k - 8) // 2
            cp_async_16(dst, base + _swizzled(r, 4 * c), src32, src, 16 if inside else 0)


@device_fn
def _store_mma_tiles(out, acc, packed, mt, nt, tok0, col0, gated):
    """Write a warp's ``mt × nt`` m16n8 f32 accumulator tiles, rounded to bf16: tile (i, j) covers tokens
    ``tok0 + 16i ..`` and logical columns ``col0 + 8j ..``; its fragment ``acc[4(i·nt + j) : +4]`` holds (C/D layout)
    tokens g, g + 8 × columns 2t, 2t + 1 of the lane (g = lane >> 2, t = lane & 3).  Tokens past ``out``'s T and
    columns past the end are dropped; gated, each column pair becomes one SwiGLU output (``_store_packed_pair``).
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
                _store_packed_pair(out, tok, col, packed[2 * (i * nt + j)], gated)
            if tok + 8 < T:
                _store_packed_pair(out, tok + 8, col, packed[2 * (i * nt + j) + 1], gated)


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
    K tiles; registers for ``warps_per_sm`` resident warps (``_bounded_kernel``)."""
    bm, bn = 16 * warps_m * mt, 8 * warps_n * nt
    nthreads_c = WARP * warps_m * warps_n
    a_slices, b_slices = 4 * bm, 4 * bn                 # 16-byte slices per 32-wide K stage
    a_pt, b_pt = -(-a_slices // nthreads_c), -(-b_slices // nthreads_c)
    a_stage, b_stage = bm * MMA_ROW_WORDS, bn * MMA_ROW_WORDS
    a_smem, b_smem = stages * a_stage, stages * b_stage
    n_acc, a_frag, b_frag, n_packed = 4 * mt * nt, 4 * mt, 2 * nt, 2 * mt * nt
    wait_oldest = cp_async_wait_group(stages - 2)      # all but the newest stages - 2 copy groups have landed
    wait_all = cp_async_wait_group(0)

    @_bounded_kernel(nthreads_c, warps_per_sm)
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
                    # unsigned indices (``primitives``: no wraparound code per load; +34 % on the H200)
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
            _store_mma_tiles(out, acc, packed, mt, nt, m0 + wm * mt * 16, n0 + wn * nt * 8, gated)

    return gemm_mma


def mma_tile(n_tokens: int, n_cols: int = 0) -> tuple[int, int, int, int]:
    """(warps_m, warps_n, mt, nt) for T tokens and ``n_cols`` logical columns.  Prefill: 128×128 tiles of 8 warps
    (64×32 per warp) for wide weights (n_cols >= 6144: on the H200 at T = 2048, Qwen3-4B's gate_up runs at
    115 TFLOP/s against 96.5 for 64×128, although ptxas spills ~190 bytes at 128 registers) and for long prompts
    (T >= 1024: the 2560-column o / down projections at T = 2048, 93-96 TFLOP/s against 91-93); 64×128 tiles
    (32×32 per warp, no spill) for short prompts of narrow weights, where 128×128 tiles would leave SMs idle.  For
    few tokens one warp row of ``ceil(T/16)`` m16 tiles (up to 64 tokens) and 64-column tiles, so that short
    batches still spread the weight over many blocks."""
    if n_tokens > 64:
        wide = (n_cols >= 6144 and n_tokens >= 128) or n_tokens >= 1024
        return (2, 4, 4, 4) if wide else (2, 4, 2, 4)
    return (1, 4, -(-n_tokens // 16), 2)


def gemm_mma(x, w, out, *, gated: bool = False, tile: tuple[int, int, int, int] | None = None,
             stages: int | None = None, warps_per_sm: int = WARPS_PER_SM) -> None:
    """Tensor-core GEMM path of ``linear`` / ``linear_silu_mul`` (``tile``, ``stages``: ``mma_tile``'s and
    ``mma_stages``' choice unless given).  In the simulator ``mma.sync`` is emulated (slow; for testing the kernel's
    indexing: ``linear(impl=None)`` uses the FMA tiles there)."""
    warps_m, warps_n, mt, nt = tile or mma_tile(x.shape[0], w.shape[0])
    stages = stages or mma_stages(warps_m, warps_n, mt, nt)
    T, k = x.shape
    tiles = -(-T // (16 * warps_m * mt)) * -(-w.shape[0] // (8 * warps_n * nt))
    launch(_gemm_mma_kernel(warps_m, warps_n, mt, nt, gated, stages, warps_per_sm), grid(tiles, sim_cap=16),
           32 * warps_m * warps_n, as_words(x), as_words(w), out, k,
           shared=stages * mma_stage_bytes(warps_m, warps_n, mt, nt), name="gemm_mma", pdl=True)


# ================================================================================================ skinny tensor-core path
@dataclass(frozen=True)
class SkinnyGeometry:
    """Launch parameters of the skinny tensor-core kernel (few tokens, weights streamed into mma fragments).

    n_tiles: n8 tiles (8 logical columns each) per warp: weight rows a warp streams together.
    unroll: 32-wide K chunks whose loads a lane issues before the first mma (16 bytes per row per chunk).
    warps: warps per block (a multiple of ``k_split``).
    k_split: warps that share one row group, each taking every ``k_split``-th run of ``unroll`` chunks of K; their
      accumulators meet in shared memory.
    warps_per_sm: occupancy the kernel is compiled for (launch bounds: 65536 / (32 · warps_per_sm) registers).
    stages: iterations of loads held in a register ring: 1 = an iteration's loads, then its mma; S > 1 = the loads
      of the next S - 1 iterations are in flight while an iteration's mma runs (S times the registers).
    """
    n_tiles: int
    unroll: int
    warps: int
    k_split: int
    warps_per_sm: int = 16
    stages: int = 1


SKINNY_MAX_TOKENS = 64
"""Largest token count of the skinny path (four m16 tiles of tokens per warp)."""

SKINNY_TUNED: dict[tuple[int, int, int, bool], SkinnyGeometry] = {
    # Qwen3-4B gate_up at T <= 16, measured on the H200 with cold weights (``benchmarks/bench_decode_stream.py
    # --tokens 16``): 37.9 µs per launch against 44.6 for the heuristic's (2 tiles, 4 chunks, no ring, k_split 1).
    # For qkv, o and down (14.6, 12.2, 23.4 µs) no swept geometry beat the heuristic's by more than 0.1 µs.
    (19456, 2560, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
    # Qwen3-8B and Qwen3.5-4B gate_up: the same geometry by analogy (not swept)
    (24576, 4096, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
    (18432, 2560, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
}
"""Measured best skinny geometries, ``(n_cols, K, m16 tiles, gated) -> SkinnyGeometry``, overriding the heuristic
in ``skinny_geometry`` (``benchmarks/bench_decode_stream.py --tokens 16`` sweeps on cold weights and prints entries
in this form; ``benchmarks/bench_gemv.py --sweep`` on one L2-warm matrix)."""


@functools.cache
def _skinny_kernel(m_tiles: int, n_tiles: int, unroll: int, warps: int, gated: bool, warps_per_sm: int,
                   upper_rows: bool = True, stages: int = 1):
    """Build the skinny kernel for ``m_tiles`` m16 token tiles × ``n_tiles`` n8 column tiles per warp, ``unroll``
    K chunks per iteration, a register ring of ``stages`` iterations, blocks of ``warps`` warps (all compile-time:
    they size register arrays and unroll loops).  ``upper_rows=False`` (T <= 8, one tile): token rows g + 8 of the
    A fragment are known zeros, never loaded."""
    MT, NT, U, S = m_tiles, n_tiles, unroll, stages
    HALVES = 2 if upper_rows else 1
    XW = 8 * MT * U          # x words per lane per iteration: MT tiles × 2 token rows × 4 words × U chunks
    WW = 4 * NT * U          # weight words per lane per iteration: NT rows × 4 words × U chunks
    SXW, SWW = S * XW, S * WW
    NACC = 4 * MT * NT       # accumulator fragment values per lane
    NPK = 2 * MT * NT
    nthreads = warps * WARP

    @device_fn
    def load_iteration(w32, x32, wrow, wr, xr, wbase, xbase, c_first, k, k_words, t4, g, T):
        """One iteration's loads into ring slot (``wbase``, ``xbase``): ``unroll`` chunks from chunk ``c_first``,
        16 bytes of each of the warp's ``n_tiles`` weight rows and of x for tokens g, g + 8 of each m16 tile."""
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
            for i in range(MT):
                for h in range(2):                 # token rows g and g + 8 of m16 tile i
                    m = 16 * i + 8 * h + g
                    if h < HALVES and e < k and m < T:
                        v0, v1, v2, v3 = load_u32x4(x32, m * k_words + word)
                    else:
                        v0 = v1 = v2 = v3 = uint32(0)
                    o = xbase + 8 * (u * MT + i) + 4 * h
                    xr[o] = v0
                    xr[o + 1] = v1
                    xr[o + 2] = v2
                    xr[o + 3] = v3

    @device_fn
    def mma_iteration(acc, wr, xr, wbase, xbase):
        """The tensor-core steps of the iteration held in ring slot (``wbase``, ``xbase``)."""
        for u in range(U):
            for i in range(MT):
                xo = xbase + 8 * (u * MT + i)
                for j in range(NT):
                    wo = wbase + 4 * (u * NT + j)
                    o = 4 * (i * NT + j)
                    d0, d1, d2, d3 = mma_bf16_m16n8k16(xr[xo], xr[xo + 4], xr[xo + 1], xr[xo + 5],
                                                       wr[wo], wr[wo + 1],
                                                       acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                    d0, d1, d2, d3 = mma_bf16_m16n8k16(xr[xo + 2], xr[xo + 6], xr[xo + 3], xr[xo + 7],
                                                       wr[wo + 2], wr[wo + 3], d0, d1, d2, d3)
                    acc[o] = d0
                    acc[o + 1] = d1
                    acc[o + 2] = d2
                    acc[o + 3] = d3

    @_bounded_kernel(nthreads, warps_per_sm)
    def linear_skinny(x32, w32, out, k, k_split):
        """``out = x @ W.T`` (or SwiGLU of column pairs when gated) for T <= 16·m_tiles tokens on tensor cores,
        reading every weight byte once, straight from global memory into ``mma.sync.m16n8k16`` B fragments.

        x32 ``[T · K/2]``, w32 ``[rows · K/2]`` (flat uint32 views of the bf16 tensors), out ``[T, n_out]``;
        ``k`` = K; ``k_split`` warps share a row group.

        The sum over k does not care in which order k is visited, so the fragments use a permuted K: within a
        32-wide chunk, lane (g = lane >> 2, t = lane & 3) loads 16 bytes (elements 8t .. 8t+8) of weight row g of
        each n8 tile and the same 16 bytes of x for tokens g and g + 8 of each m16 tile.  Words 0, 1 are the
        (k 2t.., k 2t+8..) halves of the first m16n8k16 step, words 2, 3 those of the second, for A and B alike.
        So every load is 16 bytes (the 4 lanes of a row cover 64 contiguous bytes; ``unroll`` chunks make runs of
        64·unroll bytes), no shared memory stages the weights and no barrier stalls the stream.  x (at most
        64 × K bf16) is read through the L1 cache by every warp.  An iteration is ``unroll`` chunks: with
        ``stages`` = 1 a warp issues all of its loads, then its mma steps; with a ring of ``stages`` > 1 (slot s of
        the unrolled loop holds iteration s mod stages) the loads of the next ``stages - 1`` iterations are in
        flight while an iteration's mma steps wait on its own, so the warp never stops streaming.

        Geometry: 1-D blocks of ``warps`` warps.  A block owns ``warps / k_split · 8 · n_tiles`` consecutive
        logical columns (a tile); blocks grid-stride over tiles.  Warp ``group · k_split + part`` takes chunk runs
        ``part, part + k_split, ...``; every warp runs the same number of iterations (chunks past K load zeros), so
        the simulator's emulated mma sees every thread equally often.  Dynamic shared memory (``k_split`` > 1):
        ``4 · warps · 4 · m_tiles · n_tiles · 32`` bytes of partial accumulators, summed by the group's part-0 warp,
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
                wrow[j] = _weight_row(min(col0 + 8 * j + g, n_cols - 1), n_out, gated) * k_words
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
                _store_mma_tiles(out, acc, packed, MT, NT, 0, col0, gated)

    return linear_skinny


def skinny_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False) -> SkinnyGeometry:
    """Pick the skinny kernel's split for a ``[n_cols, k]`` weight (logical columns: 2I when gated) and T tokens.

    Per lane, as many 16-byte weight loads in flight as fit in the 128 registers of 16 warps/SM without spills
    (ptxas, sm_90): 2 n8 tiles × 4 chunks for one m16 tile of tokens (T <= 16); with more token tiles x's
    registers and the accumulators grow: 2 × 1 for two tiles, 1 × 1 for three or four (those spill 4-24 bytes).
    Then ``k_split`` doubles (up to 8, while every warp keeps >= 4 iterations of K) until the grid has a warp for
    each of the 16 slots of every SM: the short matrices (o, down: 2560 rows = 160 row groups) need k_split 8.
    A starting point: ``bench_gemv.py --sweep`` measures the alternatives and ``SKINNY_TUNED`` overrides it.
    """
    mt = -(-n_tokens // 16)
    if SIMULATOR:
        return SkinnyGeometry(n_tiles=2, unroll=1, warps=2, k_split=2 if k >= 128 else 1)
    if (n_cols, k, mt, gated) in SKINNY_TUNED:
        return SKINNY_TUNED[n_cols, k, mt, gated]
    nt, unroll = (2, 4) if mt == 1 else ((2, 1) if mt == 2 else (1, 1))
    target = 16 * _sm_count()
    groups = -(-n_cols // (8 * nt))
    k_split = 1
    while groups * k_split < target and k_split < 8 and k // (32 * unroll * 2 * k_split) >= 4:
        k_split *= 2
    return SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=8, k_split=k_split)


def linear_skinny(x, w, out, *, gated: bool = False, geometry: SkinnyGeometry | None = None) -> None:
    """Skinny tensor-core path of ``linear`` / ``linear_silu_mul`` for 1 <= T <= 64 (``SKINNY_MAX_TOKENS``): every
    weight byte read once, as in the GEMV, with the arithmetic on tensor cores.  In the simulator ``mma.sync`` is
    emulated (slow: tests use tiny shapes)."""
    T, k = x.shape
    if T > SKINNY_MAX_TOKENS:
        raise ValueError(f"the skinny path takes at most {SKINNY_MAX_TOKENS} tokens, got {T}")
    n_cols = w.shape[0]
    geo = geometry or skinny_geometry(n_cols, k, T, gated)
    assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
    mt = -(-T // 16)
    cols_per_block = geo.warps // geo.k_split * 8 * geo.n_tiles
    shared = 4 * geo.warps * 4 * mt * geo.n_tiles * WARP if geo.k_split > 1 else 0
    kern = _skinny_kernel(mt, geo.n_tiles, geo.unroll, geo.warps, gated, geo.warps_per_sm, T > 8, geo.stages)
    launch(kern, grid(n_cols, cols_per_block, sim_cap=8), geo.warps * WARP,
           as_words(x), as_words(w), out, k, geo.k_split, shared=shared, name="linear_skinny", pdl=True)


# ================================================================================================ public API
def _check(x, w, out, gated: bool, impl):
    for name, a in (("x", x), ("w", w), ("out", out)):
        if a.ndim != 2 or a.dtype != np.uint16:
            raise ValueError(f"{name} must be a 2-D uint16 (bf16 bits) array, got shape {a.shape} dtype {a.dtype}")
        if not _is_contiguous(a):
            raise ValueError(f"{name} must be C-contiguous (shape {a.shape})")
    T, k = x.shape
    if k % 8 != 0:
        raise ValueError(f"K = {k} must be a multiple of 8 (the kernels read 16-byte runs of 8 bf16)")
    if w.shape[1] != k:
        raise ValueError(f"weight {w.shape} does not match x {x.shape}: both need K = {k} columns")
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    if gated and w.shape[0] % 2:
        raise ValueError(f"w_gate_up {w.shape} must have an even number of rows (gate rows then up rows)")
    if out.shape != (T, n_out):
        raise ValueError(f"out {out.shape} must be {(T, n_out)} for x {x.shape} and weight {w.shape}")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")


def default_impl(n_tokens: int) -> str:
    """The path ``linear(impl=None)`` takes for T tokens.  GPU: the GEMV for T = 1, the skinny tensor-core kernel
    for 2 <= T <= 64 (both stream the weight once), the tiled tensor-core GEMM above.  Simulator: the GEMV up to
    ``GEMV_MAX_TOKENS``, the FMA tiles above (cheap to emulate; the tensor-core kernels have their own tests)."""
    if SIMULATOR:
        return "gemv" if n_tokens <= GEMV_MAX_TOKENS else "gemm_fma"
    if n_tokens <= 1:
        return "gemv"
    return "skinny" if n_tokens <= SKINNY_MAX_TOKENS else "gemm_mma"


def _run(x, w, out, gated: bool, impl) -> None:
    _check(x, w, out, gated, impl)
    if x.shape[0] == 0 or out.shape[1] == 0:
        return
    if impl is None:
        impl = default_impl(x.shape[0])
    if impl == "gemv":
        gemv(x, w, out, gated=gated)
    elif impl == "skinny":
        linear_skinny(x, w, out, gated=gated)
    elif impl == "gemm_fma":
        gemm_fma(x, w, out, gated=gated)
    else:
        gemm_mma(x, w, out, gated=gated)


def linear(x, w, out, impl: str | None = None, *, policy=None) -> None:
    """``out = bf16(x @ w.T)`` with f32 accumulation.

    x ``[T, K]``, w ``[N, K]``, out ``[T, N]``: contiguous uint16 bf16 bits; K a multiple of 8.
    ``impl``: ``None`` picks the GEMV for ``T <= GEMV_MAX_TOKENS`` and the GEMM above (tensor cores on a GPU, FMA
    tiles in the simulator); ``"gemv"``, ``"gemm_fma"``, ``"gemm_mma"`` force a path (tests compare them all).
    """
    _run(x, w, out, False, impl)


def linear_silu_mul(x, w_gate_up, out, impl: str | None = None, *, policy=None) -> None:
    """The MLP's fused gate/up projection + SwiGLU: ``out = bf16(bf16(silu(g)) · u)`` with ``g = bf16(x @ Wg.T)``,
    ``u = bf16(x @ Wu.T)``.

    x ``[T, K]``, w_gate_up ``[2I, K]`` (gate rows ``[0, I)`` then up rows ``[I, 2I)``), out ``[T, I]``; ``impl`` as
    in ``linear``.  Neither g nor u is ever written to memory.
    """
    _run(x, w_gate_up, out, True, impl)


# ================================================================================================ add + RMSNorm + linear
def fused_norm_geometry(n_cols: int, k: int, gated: bool = False) -> GemvGeometry:
    """GEMV geometry of the fused add + RMSNorm path (one token): ``gemv_geometry``'s rows per warp, split and load
    ring depth, in blocks of ``NORM_THREADS`` (the prologue's sum of squares then runs in norm's order), x staged
    (the prologue writes it), ``k_split`` reduced until it divides the block's warps.  (Until session 4 the ring
    depth was dropped here, so the fused projections ran a ring of 2 where ``GEMV_TUNED`` says 3-4 measured best.)"""
    geo = gemv_geometry(n_cols, k, 1, gated)
    warps = NORM_THREADS // WARP
    k_split = geo.k_split
    while warps % k_split:
        k_split //= 2
    return GemvGeometry(rows_per_warp=geo.rows_per_warp, warps=warps, k_split=k_split, max_tokens=1,
                        stages=geo.stages, persistent=True)


def _resident_blocks(n_tiles: int, geo: GemvGeometry) -> int:
    """Grid of a persistent GEMV: at most one resident wave of blocks (``WARPS_PER_SM // warps`` per SM), which then
    grid-stride over the tiles.  The fused GEMV always launches so, so that the norm prologue (a whole-row pass and
    a block reduction) runs once per block rather than once per tile.  (Session 21 measured handing tiles after a
    block's first two out from a counter, over the whole resident wave, for gate/up's 5-10 µs spread of block ends:
    +0.69 % on the Qwen3-4B decode graph, +0.11 % Qwen3.5-4B; removed.)"""
    resident = _sm_count() * max(1, WARPS_PER_SM // geo.warps)
    # every block the same number of tiles: 608 tiles on 264 resident blocks would leave 80 blocks a third tile to
    # stream alone (a tail at a third of the bandwidth); 203 blocks of 3 tiles finish together (H200, Qwen3-4B:
    # the step's projections 2.769 -> 2.743 ms)
    resident = -(-n_tiles // -(-n_tiles // resident))
    return grid(min(n_tiles, resident), sim_cap=2)


def _fusable(n_tokens: int, k: int, impl, geo: GemvGeometry) -> bool:
    return (n_tokens == 1 and impl in (None, "gemv") and default_impl(1) == "gemv"
            and geo.warps * WARP == NORM_THREADS and geo.warps % geo.k_split == 0 and geo.max_tokens == 1
            and geo.stage_x and _gemv_k_chunk(k, geo) >= k)


def fuses_add_rms_norm(n_tokens: int, w, gated: bool = False) -> bool:
    """Whether ``linear_add_rms_norm`` over ``n_tokens`` tokens and weight ``w`` is one launch (the one-token GEMV
    with the norm as its prologue), which is also when it takes ``row_ids``."""
    n, k = w.shape
    return n > 0 and _fusable(n_tokens, k, None, fused_norm_geometry(n, k, gated))


def linear_add_rms_norm(residual_in, delta, norm_weight, eps: float, residual_out, w, out, *, gated: bool = False,
                        weight_offset: float = 0.0, round_before_weight: bool = True, normed_out=None,
                        impl: str | None = None, geometry: GemvGeometry | None = None,
                        before_latency_bound: bool = False, row_ids=None, head=None,
                        residual_ready: bool = False, policy=None) -> None:
    """The decoder's residual add and RMSNorm followed by a projection:

        s = bf16(residual_in + delta)       (delta=None: s = residual_in)      -> residual_out
        n = rms_norm(s) · norm_weight       (``norm``'s two roundings: ``weight_offset``, ``round_before_weight``)
        out = linear(n, w)                  (gated: linear_silu_mul(n, w))

    residual_in, delta, residual_out ``[T, H]``, norm_weight ``[H]``, w ``[N, H]`` (``[2I, H]`` gated), out
    ``[T, N]`` (``[T, I]``): uint16 bf16 bits.  ``residual_in`` is never written; ``residual_out`` must be another
    buffer (a model ping-pongs two).  Results are bit-identical to ``norm.add_rms_norm`` (or ``norm.rms_norm``)
    followed by ``linear`` / ``linear_silu_mul``, on every path.

    One token (T = 1, the GEMV path): a single launch; the norm is the GEMV's x-staging prologue, computed by every
    block from the whole row (``_stage_add_rms_norm``); n is never written to memory and ``normed_out`` is not
    touched.  (Tried and dropped, session 15: the MLP's down projection in the gate/up launch -- each block
    streaming the rows of ``W_downᵀ`` its SwiGLU outputs meet, then a grid barrier and a reduction of the blocks'
    partial rows.  Correct on the GPU, but Qwen3.5-4B TPOT +4.8 %; with no down rows read at all it was only 6.7 %
    faster than two launches that do read them, less than their 1.5 GB take at full bandwidth:
    ``benchmarks/RESULTS.md``.)  ``geometry`` (tests, benchmarks) overrides ``fused_norm_geometry`` and must keep
    its block size.
    ``before_latency_bound``: the next kernel is not a weight-streaming one (``GEMV_TRIGGER_BEFORE_LATENCY_BOUND``).
    ``row_ids`` ``[1]`` int32 (one-token path only, ``fuses_add_rms_norm``; ``delta`` None): ``residual_in`` is an
    embedding table ``[V, H]`` and the residual its row ``row_ids[0]`` -- the first layer's embedding lookup, done
    by the GEMV's prologue instead of a launch of its own (bit-identical to ``embedding`` first).
    ``head`` (``sampling.HeadArgmax``; one-token path only, not gated): the launch is the LM head of a one-sequence
    step, and also writes the greedy token of its logits row (``_gemv_decode_kernel``'s step 4), which the sampler
    then takes as it is (``sampling.sample(head=)``).
    ``residual_ready`` (one-token path): ``residual_in`` was written by a kernel that has completed by the time this
    launch starts -- two or more launches back, with a kernel between that lets its dependents launch only after
    its own PDL wait (the decoder's ping-ponged residual: the MLP's gate/up reads what the layer's first projection
    wrote, the next layer's first projection what gate/up wrote) -- so the prologue reads it before its PDL wait
    (``RESIDUAL_EARLY``), leaving only ``delta`` for after it.
    Otherwise: ``add_rms_norm_into`` into ``normed_out`` (required then: a ``[T, H]`` scratch), then ``linear`` with
    ``impl``.  Nothing is allocated; every launch can be captured in a CUDA graph.
    """
    if row_ids is not None:
        if delta is not None or row_ids.shape != (1,) or row_ids.dtype != np.int32 or not fuses_add_rms_norm(
                1, w, gated) or impl not in (None, "gemv") or geometry is not None:
            raise ValueError("row_ids: one token, no delta, the one-token GEMV path (fuses_add_rms_norm)")
        _check(residual_out, w, out, gated, impl)                 # residual_out [1, H] as the x of the GEMV
        if (residual_in.ndim != 2 or residual_in.dtype != np.uint16 or not _is_contiguous(residual_in)
                or residual_in.shape[1] != residual_out.shape[1]):
            raise ValueError(f"with row_ids, residual_in is the embedding table: a contiguous [V, "
                             f"{residual_out.shape[1]}] uint16 array, got {residual_in.shape} {residual_in.dtype}")
        if norm_weight.shape != (residual_out.shape[1],) or norm_weight.dtype != np.uint16:
            raise ValueError(f"norm_weight {norm_weight.shape} {norm_weight.dtype} must be [{residual_out.shape[1]}] "
                             "uint16")
        _gemv_decode(None, residual_in, None, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                     round_before_weight, fused_norm_geometry(*w.shape, gated),
                     GEMV_TRIGGER_BEFORE_LATENCY_BOUND if before_latency_bound else None, row_ids, head)
        return
    check_residual_buffers(residual_in, delta, norm_weight, residual_out)
    _check(residual_in, w, out, gated, impl)
    T, k = residual_in.shape
    if T == 0:
        return
    geo = geometry or fused_norm_geometry(w.shape[0], k, gated)
    fused = _fusable(T, k, impl, geo)
    if geometry is not None and not fused:
        raise ValueError(f"geometry {geometry} does not give the fused one-token path (T = {T}, impl = {impl!r})")
    if fused and out.shape[1] > 0:         # (no columns: no blocks, which would leave residual_out unwritten)
        _gemv_decode(None, residual_in, delta, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                     round_before_weight, geo, GEMV_TRIGGER_BEFORE_LATENCY_BOUND if before_latency_bound else None,
                     head=head, residual_early=residual_ready)
        return
    if head is not None:
        raise ValueError(f"head: the one-token path only (fuses_add_rms_norm), got T = {T}")
    if normed_out is None:
        raise ValueError(f"normed_out (a [{T}, {k}] scratch) is needed: T = {T} takes the unfused path")
    add_rms_norm_into(residual_in, delta, norm_weight, residual_out, normed_out, eps, weight_offset,
                      round_before_weight)
    _run(normed_out, w, out, gated, impl)
