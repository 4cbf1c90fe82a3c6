"""The preloaded one-token GEMV: a projection that follows a latency-bound kernel (the o projection after decode
attention, out_proj after the Gated DeltaNet step) copies its weight rows into the SMs' shared memory *before* its
PDL wait, while the kernel before still runs, and only multiplies once x is ready.

The whole matrix must fit in the SMs' shared memory at once (``preload_rows``: e.g. 2560 × 4096 bf16 = 21 MB over
128 blocks of 160 KB), the launch must overlap the kernel before (PDL, sm_90+; without the overlap there is nothing
to gain) and the launch policy must ask for it (``LaunchPolicy.preload_o``); otherwise ``linear_preloaded`` is
``linear``.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels import timeline
from pegainfer.kernels.launch import can_overlap, launch
from pegainfer.kernels.linear.api import check_shapes, run_linear
from pegainfer.kernels.linear.common import bounded_kernel, shared_optin, sm_count
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, as_words, bf16x2_hi, bf16x2_lo, bits_f32, bulk_barrier_init,
                                          bulk_copy, bulk_expect_bytes, bulk_wait, cuda, f32_to_bf16, float32,
                                          global_timer, grid_dependency_wait, launch_dependents, reads_before_wait,
                                          threads, uint32, warp_row_sums_to_shared, warp_sums_to_shared)

uint64 = np.uint64

PRELOAD_THREADS = 512
"""Block size of the preloaded GEMV (16 warps; one block per SM, its shared memory holding the block's rows; the
fastest of 128-1024 on the H200: docs/perf/linear.md)."""

BULK_CHUNK_BYTES = 16384
"""Bytes per ``cp.async.bulk`` instruction of the preloaded GEMV.  All of a block's copies go out at once (pacing
them was slower on the H200: docs/perf/linear.md)."""


@functools.cache
def _gemv_preloaded_kernel(rows: int, k: int, nthreads: int, stamps: bool = False):
    """Build the preloaded one-token GEMV for blocks of ``rows`` weight rows, ``K = k`` and ``nthreads`` threads
    (all compile-time: the copy and dot loops unroll, and ``K / 2`` must be a multiple of ``nthreads``);
    ``stamps``: each block appends its ``timeline`` record."""
    STAMPS = stamps
    K_WORDS = k // 2
    XW = K_WORDS // nthreads                    # x words per lane (and weight words per lane and row)
    assert XW * nthreads == K_WORDS, (k, nthreads)
    WARPS = nthreads // WARP
    RED = rows * K_WORDS                        # partial sums follow the rows in shared memory
    BAR = RED + WARPS * rows + (WARPS * rows) % 2   # then the bulk copies' mbarrier (8-byte aligned)
    BULK_CHUNKS = -(-rows * k * 2 // BULK_CHUNK_BYTES)
    ROW_SUMS = rows <= WARP

    @reads_before_wait("w32")
    @bounded_kernel(nthreads)
    def gemv_preloaded(x32, w32, out, n_rows, stamp_buf):
        """``out[0, n] = bf16(Σ_k x[k] · W[n, k])`` for one token, with the block's weight rows copied into shared
        memory before the kernel waits for x.

        x32 ``[K/2]``, w32 ``[N · K/2]`` uint32 (bf16 pairs of x ``[1, K]`` and W ``[N, K]``), out ``[1, N]`` bf16
        bits, ``n_rows`` = N.  Block b owns rows ``[b·rows, b·rows + rows)``: a contiguous run of ``rows · 2K``
        bytes, which fits in one SM's shared memory (``preload_rows``).

        1. Thread 0 starts ``cp.async.bulk`` copies of ``BULK_CHUNK_BYTES`` runs of the rows (the copy engine: a
           few instructions from one thread, not the load/store pipe that the kernel before shares while it
           finishes on the same SM), counted by an mbarrier; the block lets the next kernel launch; then it waits
           for the kernel before (PDL: the copies stream while that one still runs).
        2. Lane ``l`` of warp ``w`` reads its ``K / (2 · threads)`` words of x, at ``w · 32 · XW + l + 32 i``
           (coalesced), then waits on the mbarrier for the rows.
        3. For every row r, ``acc[r] = Σ_i W_r[word] · x[word]`` over the same words (a warp reads 32 consecutive
           words of a row: no bank conflicts), in word order, low half first.
        4. The lanes' partials summed per row (``warp_row_sums_to_shared``, 31 shuffles for up to 32 rows; else
           ``warp_sums_to_shared``), then thread r sums the warps' partials in warp order and writes ``bf16``.
        Shared memory (dynamic, uint32 words): the rows, the warps' partial sums, the mbarrier (``preload_shared``).
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
        n_bytes = uint32(n_here * k * 2)
        if tid == 0:
            bulk_barrier_init(ws, BAR)
            bulk_expect_bytes(ws, BAR, n_bytes)
            for i in range(BULK_CHUNKS):
                at = uint32(i * BULK_CHUNK_BYTES)
                if at < n_bytes:
                    bulk_copy(ws, at // uint32(4), w32, src + at // uint32(4),
                              min(uint32(BULK_CHUNK_BYTES), n_bytes - at), ws, BAR)
        cuda.syncthreads()                      # the barrier is initialised before anyone waits on it
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
        bulk_wait(ws, BAR)
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


def preload_shared(rows: int, k: int, nthreads: int) -> int:
    """Bytes of dynamic shared memory of the preloaded GEMV: the rows, the warps' partial sums, the mbarrier."""
    partials = rows * nthreads // WARP
    return 4 * (rows * k // 2 + partials + partials % 2 + 2)


def preload_rows(n_rows: int, k: int, busy_sms: int = 0) -> int:
    """Rows per block of the preloaded GEMV for a ``[n_rows, k]`` weight: the matrix spread over one block per SM
    (per SM but ``busy_sms``); 0 when that does not fit in shared memory (or K does not split evenly over the
    block's lanes)."""
    nthreads = threads(gpu=PRELOAD_THREADS, sim=WARP)
    if k % (2 * nthreads) or n_rows == 0 or busy_sms >= sm_count():
        return 0
    rows = -(-n_rows // (sm_count() - busy_sms))
    if rows > nthreads or preload_shared(rows, k, nthreads) > shared_optin():
        return 0
    return rows


def _preload_on(x_tokens: int, policy: LaunchPolicy) -> bool:
    """The policy preloads, one token, and the launch overlaps the kernel before (PDL: sm_90+, which the bulk
    copies need too).  The simulator runs the kernel anyway (tests)."""
    return policy.preload_o and x_tokens == 1 and (SIMULATOR or (can_overlap() and policy.overlaps("gemv_preloaded")))


def preloads(x_tokens: int, w, policy: LaunchPolicy = DEFAULT_POLICY) -> bool:
    """Whether ``linear_preloaded`` takes the preloaded GEMV for ``x_tokens`` tokens and weight ``w``."""
    return bool(_preload_on(x_tokens, policy) and preload_rows(*w.shape))


def linear_preloaded(x, w, out, busy_sms: int = 0, *, workspace=None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``linear(x, w, out)`` for a projection that follows a latency-bound kernel whose working blocks hold
    ``busy_sms`` SMs (decode attention: one per KV head at contexts of one split).  For one token, when the whole
    matrix fits in the SMs' shared memory (``preload_rows``), it is the preloaded GEMV: launched with PDL, its
    blocks copy their weight rows in while the kernel before still runs, so only the dot products from shared
    memory are left once x is ready.  The matrix is spread over all SMs but ``busy_sms`` (over all of them when it
    does not fit so), so that no block waits for an SM that the kernel before still holds (docs/perf/linear.md).
    How early it starts is up to the kernel before (decode attention lets it launch right after its PDL wait);
    it lets the next kernel launch once its copies are issued.  Otherwise, and when the policy does not preload
    (``preload_o``), it is ``linear`` (with ``workspace``, the tensor-core GEMM's split-K scratch)."""
    check_shapes(x, w, out, False, None)
    rows = (preload_rows(*w.shape, busy_sms) or preload_rows(*w.shape)) if _preload_on(x.shape[0], policy) else 0
    if rows == 0:
        run_linear(x, w, out, False, None, policy, workspace)
        return
    n_rows, k = w.shape
    nthreads = threads(gpu=PRELOAD_THREADS, sim=WARP)
    kern = _gemv_preloaded_kernel(rows, k, nthreads, policy.timeline)
    stamps = timeline.buffer() if policy.timeline else timeline.unused()
    launch(kern, -(-n_rows // rows), nthreads, as_words(x), as_words(w), out, n_rows, stamps,
           shared=preload_shared(rows, k, nthreads), name="gemv_preloaded", policy=policy)
