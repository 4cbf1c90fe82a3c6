"""Warp and block reductions.

Warp reductions (``warp_sum``, ``warp_max``, ``warp_argmax``; ``lane_group_sum`` / ``lane_group_max`` over aligned
groups of 2..32 lanes) are butterfly reductions: every lane gets the result.  ``warp_sums_to_shared`` reduces n values
per lane at once into shared memory (lane 0 writes).  In the simulator they are emulated with block-shared scratch
and the block barrier, so *every thread of the block must call them the same number of times* (keep loop trip
counts uniform across the block and guard the work inside the loop, not the reduction).  ``block_sum`` /
``block_max`` / ``block_argmax`` reduce over the whole block (same rule: every thread calls them).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.bf16 import f32_bits
from pegainfer.kernels.primitives.launch_shape import device_fn, float32, int32, uint32

WARP = 32
FULL_MASK = 0xFFFFFFFF
NO_INDEX = 2**31 - 1      # "no index yet" in an argmax state (``block_argmax``, the sampler, the LM head's argmax)

if SIMULATOR:
    def _lane_group(width):
        """(this thread's index, first and one-past-last thread of its aligned group of ``width`` lanes)."""
        t = int(cuda.threadIdx.x)
        lo = t - t % int(width)
        return t, lo, min(lo + int(width), int(cuda.blockDim.x))

    def _group_values(v, width):
        """Every lane's ``v`` in this thread's aligned group of ``width`` lanes (float64): one exchange through
        block-shared scratch between two block barriers, which is why every thread of the block must take part."""
        buf = cuda.shared.array(1024, np.float64)
        t, lo, hi = _lane_group(width)
        buf[t] = v
        cuda.syncthreads()
        vals = buf[lo:hi].copy()
        cuda.syncthreads()
        return vals

    def _f32_sum(vals):
        return np.float32(np.sum(vals.astype(np.float32), dtype=np.float32))

    @device_fn
    def warp_sum(v):
        s = _f32_sum(_group_values(v, WARP))
        return type(v)(s) if isinstance(v, (np.floating, float)) else s

    @device_fn
    def warp_max(v):
        m = _group_values(v, WARP).max()
        return type(v)(m) if isinstance(v, (np.floating, float)) else np.float32(m)

    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32); every lane of the group gets
        it."""
        return _f32_sum(_group_values(v, width))

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32)."""
        return np.float32(_group_values(v, width).max())

    # Blocks run one after another in the simulator, so one host array can serve as the block's exchange buffer
    # (a ``cuda.shared.array`` here would walk the Python stack on every call to find its allocation).
    _sim_exchange = np.zeros(1 << 16, np.float32)

    @device_fn
    def warp_sums_to_shared(vals, n, dst, base, as_bits):
        """``dst[base + i] = Σ_lanes vals[i]`` for ``i < n`` (its f32 bits when ``as_bits``: ``dst`` a uint32
        array), written by lane 0 of the calling warp; ``dst`` is shared memory, visible to the block after the
        caller's next ``syncthreads``.  Every thread of the block must call it (same n).  Emulated with one
        exchange for all n values (an emulated ``warp_sum`` costs two block barriers)."""
        tid = int(cuda.threadIdx.x)
        _sim_exchange[tid * n:(tid + 1) * n] = vals[:n]
        cuda.syncthreads()
        if tid % WARP == 0:
            hi = min(tid + WARP, int(cuda.blockDim.x))
            for i in range(n):
                v = np.sum(_sim_exchange[tid * n + i:hi * n:n], dtype=np.float32)
                dst[base + i] = v.view(np.uint32) if as_bits else v

    @device_fn
    def warp_argmax(v, i):
        """(max value, its index) over the warp; ties go to the smaller index."""
        vals = cuda.shared.array(1024, np.float64)
        idxs = cuda.shared.array(1025, np.int64)  # different size only so the two allocations are distinct
        t, lo, hi = _lane_group(WARP)
        vals[t] = v
        idxs[t] = i
        cuda.syncthreads()
        best_v, best_i = vals[lo], idxs[lo]
        for j in range(lo + 1, hi):
            if vals[j] > best_v or (vals[j] == best_v and idxs[j] < best_i):
                best_v, best_i = vals[j], idxs[j]
        cuda.syncthreads()
        return np.float32(best_v), np.int32(best_i)

    warp_row_sums_to_shared = warp_sums_to_shared   # the emulation has one order for both
else:
    @device_fn
    def warp_sum(v):
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
        return v

    @device_fn
    def warp_max(v):
        for off in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
        return v

    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32): an xor butterfly that stays
        inside the group; every lane of the group gets the sum."""
        off = width >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        return v

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes."""
        off = width >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        return v

    @device_fn
    def warp_sums_to_shared(vals, n, dst, base, as_bits):
        """``dst[base + i] = Σ_lanes vals[i]`` for ``i < n`` (its f32 bits when ``as_bits``: ``dst`` a uint32
        array), written by lane 0 of the calling warp; ``dst`` is shared memory, visible to the block after the
        caller's next ``syncthreads``.  Every thread of the block must call it (same n)."""
        for i in range(n):
            s = warp_sum(vals[i])
            if cuda.threadIdx.x % WARP == 0:
                if as_bits:
                    dst[base + i] = f32_bits(s)
                else:
                    dst[base + i] = s

    @device_fn
    def _halve_rows(t, h, o, upper):
        """One level of ``warp_row_sums_to_shared``: rows ``[0, 2h)`` of ``t`` → ``[0, h)``, this lane keeping the
        upper half (``upper``) or the lower one and adding its xor-``o`` partner's copy of it."""
        for j in range(h):
            a = t[j]
            b = t[j + h]
            t[j] = (b if upper else a) + cuda.shfl_xor_sync(FULL_MASK, a if upper else b, o)

    @device_fn
    def warp_row_sums_to_shared(vals, n, dst, base, as_bits):
        """``warp_sums_to_shared`` for ``n <= 32`` values a lane, by recursive halving: at each of five levels a
        lane keeps half of its rows and adds its partner's copies of them, so 31 shuffles sum 32 rows (against 5 a
        row) and lane ``i`` ends with row ``i``'s sum, which it writes.  A different f32 summation order."""
        lane = cuda.threadIdx.x % WARP
        t = cuda.local.array(WARP, float32)
        for r in range(WARP):
            t[r] = vals[r] if r < n else float32(0.0)
        _halve_rows(t, 16, 16, (lane & 16) != 0)
        _halve_rows(t, 8, 8, (lane & 8) != 0)
        _halve_rows(t, 4, 4, (lane & 4) != 0)
        _halve_rows(t, 2, 2, (lane & 2) != 0)
        _halve_rows(t, 1, 1, (lane & 1) != 0)
        if lane < n:
            if as_bits:
                dst[base + lane] = f32_bits(t[0])
            else:
                dst[base + lane] = t[0]

    @device_fn
    def warp_argmax(v, i):
        """(max value, its index) over the warp; ties go to the smaller index."""
        for off in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
        return v, i

@device_fn
def block_sum(v):
    """Sum of ``v`` over every thread of the (1-D, multiple-of-32) block; every thread gets the total."""
    partial = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    s = warp_sum(float32(v))
    cuda.syncthreads()
    if lane == 0:
        partial[uint32(wid)] = s            # (unsigned: no negative-index wraparound code)
    cuda.syncthreads()
    t = partial[uint32(lane)] if lane < nwarps else float32(0.0)
    t = warp_sum(t)
    return t


@device_fn
def block_max(v):
    """Max of ``v`` over every thread of the block; every thread gets it."""
    partial = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    m = warp_max(float32(v))
    cuda.syncthreads()
    if lane == 0:
        partial[uint32(wid)] = m
    cuda.syncthreads()
    t = partial[uint32(lane)] if lane < nwarps else float32(-math.inf)
    t = warp_max(t)
    return t


@device_fn
def block_argmax(v, i):
    """(max of ``v``, its int32 index ``i``) over every thread of the block, ties → the smaller index (NaN never
    wins; no candidate at all gives (-inf, ``NO_INDEX``)); every thread gets the result."""
    part_v = cuda.shared.array(32, float32)
    part_i = cuda.shared.array(32, int32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    v, i = warp_argmax(float32(v), int32(i))
    cuda.syncthreads()
    if lane == 0:
        part_v[uint32(wid)] = v
        part_i[uint32(wid)] = i
    cuda.syncthreads()
    v = float32(-math.inf)
    i = int32(NO_INDEX)
    if lane < (cuda.blockDim.x + WARP - 1) // WARP:
        v = part_v[uint32(lane)]
        i = part_i[uint32(lane)]
    return warp_argmax(v, i)
