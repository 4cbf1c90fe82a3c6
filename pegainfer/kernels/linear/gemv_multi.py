"""The GEMV: ``out = x @ W.T`` for a few tokens, streaming every weight byte exactly once.

Memory-bound: the kernel is built to stream W at the GPU's read bandwidth.  Each warp owns ``rows_per_warp``
weight rows; a lane reads 16 bytes (8 bf16) of each of them per step with ``load_u32x4``, all rows' loads issued
before any is used, and the next steps' loads issued before the current step's arithmetic (a register ring).  The
tokens' x rows are staged once per block in shared memory as f32 and reused by every row of the block; each weight
row is dotted with all T tokens while it is in registers (T > 1 costs arithmetic, not bandwidth).  A warp's partial
dot products are summed with ``warp_sum``; when rows are few (short-and-wide matrices such as ``o_proj`` and
``down_proj``: 2560 rows), ``k_split`` warps share a row group, each taking every ``k_split``-th 256-wide slice of
K, and their partial sums meet in shared memory, so that all SMs are busy.  ``geometry.gemv_geometry`` picks these
parameters per shape.  Above 8 tokens the register tile (8 accumulators per row) and the shared-memory x traffic
make the multiply-adds, not the weight stream, the bottleneck: the GEMM takes over.

One token takes ``gemv_decode`` (its own kernel, x staged as bf16 pairs) unless the geometry asks for what only
this kernel does (K in chunks, x read beside the weights).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import launch
from pegainfer.kernels.linear.common import bounded_kernel, load_row_slices, silu_mul_bf16, weight_row
from pegainfer.kernels.linear.gemv_decode import gemv_decode
from pegainfer.kernels.linear.geometry import (GEMV_MAX_TOKENS, GemvGeometry, gemv_geometry, gemv_k_chunk,
                                               resident_blocks)
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, bf16x2_hi, bf16x2_lo, cuda, device_fn, f32_to_bf16,
                                          float32, grid, load_u32x4, pdl_prologue, uint32, warp_sums_to_shared)

int64, uint64 = np.int64, np.uint64

if SIMULATOR:
    from pegainfer.kernels.linear.common import words_to_f32

    def _dot_row_slices(acc, w, base, xs, x_base, x_stride, n_tok, rows, toks):
        """``acc[r·toks + t] += Σ_j W_r[j] · xs[x_base + t·x_stride + 32·j]`` for ``r < rows``, ``t < n_tok``, where
        ``W_r[2q], W_r[2q+1]`` are the low / high bf16 of ``w[base + 4r + q]``."""
        wf = words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        nt = min(int(n_tok), toks)
        xv = xs[x_base + x_stride * np.arange(nt)[:, None] + 32 * np.arange(8)]
        acc.reshape(rows, toks)[:, :nt] += wf @ xv.T

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
        wf = words_to_f32(w[base:base + 4 * rows]).reshape(rows, 8)
        xf = words_to_f32(xw[xbase:xbase + 4 * nt]).reshape(nt, 8)
        acc.reshape(rows, toks)[:, :nt] += wf @ xf.T

    def _stage_x_slice(x32, word, xs, base):
        """The 8 bf16 of ``x32[word:word+4]`` as f32 into ``xs[base + 32·j]``, j = 0..7 (the GEMV's x layout)."""
        xs[base:base + 256:32] = words_to_f32(x32[word:word + 4])
else:
    from pegainfer.kernels.linear.common import dot_rows_8

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
                dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7)

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
                dot_rows_8(acc, w, base, t, rows, toks, x0, x1, x2, x3, x4, x5, x6, x7)

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


@functools.cache
def _gemv_kernel(rows_per_warp: int, max_tokens: int, gated: bool, warps: int, stage_x: bool = True,
                 stages: int = 2):
    """Build the GEMV kernel for a register tile of ``rows_per_warp`` weight rows × ``max_tokens`` tokens and
    blocks of ``warps`` warps (compile-time constants: they size the per-lane register arrays, their loops unroll,
    and the block size sets the launch bounds).  ``stage_x=False``: no x staging (see the kernel docstring).
    ``stages``: depth of the per-lane load ring (``stages - 1`` steps of every row's 16-byte loads in flight while
    one is multiplied)."""
    R = rows_per_warp
    TT = max_tokens
    X4 = 4 * TT
    RT = R * TT                                    # (array sizes must be closure constants, not expressions)
    R4 = 4 * R
    S = stages
    SR4 = S * R4
    SX4 = S * X4
    nthreads = warps * WARP

    @bounded_kernel(nthreads)
    def gemv(x32, w32, out, k, k_split, k_chunk):
        """``out[t, n] = bf16(Σ_k x[t, k] · W[row(n), k])`` for ``t < T <= max_tokens`` (or SwiGLU of column pairs
        when gated: ``common.weight_row``).

        x32 ``[T · K/2]`` and w32 ``[rows · K/2]``: the bf16 tensors ``[T, K]`` / ``[rows, K]`` seen as flat uint32
        (two bf16 per word); out ``[T, n_out]`` bf16 bits; ``k`` = K; ``k_split`` warps share each row group;
        ``k_chunk`` (a multiple of 256) is how much of K is staged in shared memory at a time.

        Geometry: 1-D blocks of ``warps`` warps (a multiple of ``k_split``).  A block owns
        ``warps / k_split · rows_per_warp`` consecutive logical columns (a *tile*); blocks grid-stride over tiles.
        Lane l of a warp reads the 16-byte slices ``c ≡ l (mod 32)`` of each row (8 elements each): a warp covers
        256 contiguous elements per step.  Loads run ``stages - 1`` steps ahead of the arithmetic through a register
        ring (slot ``s`` of the unrolled inner loop holds step ``s mod stages``), so each lane keeps
        ``(stages - 1) · rows_per_warp`` 16-byte loads in flight: a decode GEMV reads cold weights from HBM, and a
        warp whose loads wait one after another is latency-bound, not bandwidth-bound.  Dynamic shared memory:
        ``4 · (max_tokens · k_chunk + warps · rows_per_warp · max_tokens)`` bytes: x staged as f32, then the
        per-warp partial sums.  Within a token's chunk, element ``8c + j`` sits at ``256·(c // 32) + 32·j + c % 32``:
        the 32 lanes of a step read 32 consecutive words (no bank conflicts), and the 8 elements of a lane's slice
        are a constant 32 words apart.
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
                wrow[r] = weight_row(min(col0 + r, n_cols - 1), n_out, gated) * k_words
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
                        load_row_slices(w32, wrow, w_off + 4 * cs, wbuf, s * R4, R)
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
                            load_row_slices(w32, wrow, w_off + 4 * c_pre, wbuf, ((s + S - 1) % S) * R4, R)
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
                        out[t, col >> 1] = silu_mul_bf16(v0, v1)
                    else:
                        out[t, col] = f32_to_bf16(v0)
            cuda.syncthreads()                     # partial sums read before the next tile overwrites them

    return gemv


def gemv(x, w, out, *, gated: bool = False, geometry: GemvGeometry | None = None,
         policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """GEMV path of ``linear`` / ``linear_silu_mul``.  Any T: passes of at most 8 tokens (``geometry.max_tokens``
    when given), each reading W once.  ``geometry`` overrides ``gemv_geometry`` (benchmarks and tests try
    splits)."""
    T, k = x.shape
    n_cols = w.shape[0]
    w32 = as_words(w)
    per_pass = geometry.max_tokens if geometry else GEMV_MAX_TOKENS
    for t0 in range(0, T, per_pass):
        t1 = min(T, t0 + per_pass)
        xp, outp = (x, out) if t1 - t0 == T else (x[t0:t1], out[t0:t1])
        geo = geometry or gemv_geometry(n_cols, k, t1 - t0, gated, policy)
        assert geo.warps % geo.k_split == 0, f"warps must be a multiple of k_split: {geo}"
        assert not gated or geo.rows_per_warp % 2 == 0, f"the gated GEMV needs an even rows_per_warp: {geo}"
        if t1 - t0 == 1 and geo.max_tokens == 1 and geo.stage_x and geo.k_chunk is None:
            gemv_decode(xp, w, outp, gated, geo, policy)                # one token
            continue
        k_chunk = gemv_k_chunk(k, geo) if geo.stage_x else -(-k // 256) * 256
        cols_per_block = geo.warps // geo.k_split * geo.rows_per_warp
        x_floats = geo.max_tokens * k_chunk if geo.stage_x else 0
        shared = 4 * (x_floats + geo.warps * geo.rows_per_warp * geo.max_tokens)
        kern = _gemv_kernel(geo.rows_per_warp, geo.max_tokens, gated, geo.warps, geo.stage_x, geo.stages)
        n_tiles = -(-n_cols // cols_per_block)
        blocks = resident_blocks(n_tiles, geo) if geo.persistent else grid(n_cols, cols_per_block, sim_cap=8)
        launch(kern, blocks, geo.warps * WARP, as_words(xp), w32, outp, k, geo.k_split, k_chunk, shared=shared,
               name="gemv", policy=policy)
