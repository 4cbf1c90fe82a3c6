"""Block-wide helpers of the sampling kernels: every thread of the block calls them equally often and gets the same
result.  On the GPU they use warp shuffles; in the simulator, where each barrier costs milliseconds, the same results
come from numpy over a shared buffer with two barriers."""
from __future__ import annotations

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives import (FULL_MASK, WARP, block_argmax, block_sum, cuda, device_fn, float32, int32,
                                          warp_sum)
from pegainfer.kernels.sampling.threshold import BUCKETS, _key_of

CANDIDATE_CAPACITY = 4096          # tokens a sampling block can hold in shared memory (logit f32 + index i32)
_TOTAL_ROWS = 2 * BUCKETS          # bucket counts then masses, in the block-total scratch

if SIMULATOR:
    @device_fn
    def _candidate_buffers():
        """The sampling block's shared candidate arrays: logits (f32) and indices (i32), CANDIDATE_CAPACITY each."""
        cand_x = cuda.shared.array(CANDIDATE_CAPACITY, float32)
        cand_j = cuda.shared.array(CANDIDATE_CAPACITY, int32)
        return cand_x, cand_j

    @device_fn
    def _block_argmax(v, i):
        """(max of ``v``, its index ``i``) over the block, ties → the smaller index."""
        vals = cuda.shared.array(1024, np.float64)
        idxs = cuda.shared.array(1024, np.int64)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        vals[t] = v
        idxs[t] = i
        cuda.syncthreads()
        best = vals[:nt].max()
        best_i = idxs[:nt][vals[:nt] == best].min()
        cuda.syncthreads()
        return float32(best), int32(best_i)

    @device_fn
    def _block_sum(v):
        """Sum of the f32 ``v`` over the block."""
        buf = cuda.shared.array(1024, np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t] = v
        cuda.syncthreads()
        s = buf[:nt].sum(dtype=np.float32)
        cuda.syncthreads()
        return float32(s)

    @device_fn
    def _block_sum3(a, b, c):
        """Sums of three f32 values over the block."""
        buf = cuda.shared.array((1024, 3), np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t, 0] = a
        buf[t, 1] = b
        buf[t, 2] = c
        cuda.syncthreads()
        s = buf[:nt].sum(axis=0, dtype=np.float32)
        cuda.syncthreads()
        return float32(s[0]), float32(s[1]), float32(s[2])

    @device_fn
    def _block_exclusive_scan(v):
        """Exclusive prefix sum of the int ``v`` in thread order."""
        buf = cuda.shared.array(1024, np.int64)
        t = cuda.threadIdx.x
        buf[t] = v
        cuda.syncthreads()
        s = buf[:t].sum()
        cuda.syncthreads()
        return int32(s)

    @device_fn
    def _block_bucket_totals(counts, masses, tot_counts, tot_masses):
        """Block-wide totals of the per-thread bucket histograms, into every thread's ``tot_*`` (f32)."""
        buf = cuda.shared.array((1024, 2 * BUCKETS), np.float64)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t, :BUCKETS] = counts[:BUCKETS]
        buf[t, BUCKETS:] = masses[:BUCKETS]
        cuda.syncthreads()
        tot = buf[:nt].sum(axis=0)
        cuda.syncthreads()
        tot_counts[:BUCKETS] = tot[:BUCKETS]
        tot_masses[:BUCKETS] = tot[BUCKETS:]

    @device_fn
    def _block_kth_largest_key(v, k):
        """Ordered key of the k-th largest (1 ≤ k ≤ threads) of the threads' values ``v``."""
        buf = cuda.shared.array(1024, np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t] = v
        cuda.syncthreads()
        kth = np.sort(buf[:nt])[nt - k]
        cuda.syncthreads()
        return _key_of(float32(kth))
else:
    @device_fn
    def _candidate_buffers():
        """The sampling block's shared candidate arrays: logits (f32) and indices (i32), CANDIDATE_CAPACITY each."""
        return cuda.shared.array(CANDIDATE_CAPACITY, float32), cuda.shared.array(CANDIDATE_CAPACITY, int32)

    _block_argmax = block_argmax

    @device_fn
    def _block_sum(v):
        """Sum of the f32 ``v`` over the block."""
        return block_sum(v)

    @device_fn
    def _block_sum3(a, b, c):
        """Sums of three f32 values over the block (one shared round for the three)."""
        part = cuda.shared.array((3, 32), float32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        a = warp_sum(float32(a))
        b = warp_sum(float32(b))
        c = warp_sum(float32(c))
        cuda.syncthreads()
        if lane == 0:
            part[0, wid] = a
            part[1, wid] = b
            part[2, wid] = c
        cuda.syncthreads()
        a = float32(0.0)
        b = float32(0.0)
        c = float32(0.0)
        if lane < (cuda.blockDim.x + WARP - 1) // WARP:
            a = part[0, lane]
            b = part[1, lane]
            c = part[2, lane]
        return warp_sum(a), warp_sum(b), warp_sum(c)

    @device_fn
    def _block_exclusive_scan(v):
        """Exclusive prefix sum of the int ``v`` in thread order: a shuffle scan per warp, then the warp totals."""
        warp_total = cuda.shared.array(32, int32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        s = int32(v)
        for d in (1, 2, 4, 8, 16):
            other = cuda.shfl_up_sync(FULL_MASK, s, d)
            if lane >= d:
                s += other
        cuda.syncthreads()
        if lane == WARP - 1:
            warp_total[wid] = s
        cuda.syncthreads()
        for w in range(wid):
            s += warp_total[w]
        return int32(s - v)

    @device_fn
    def _block_bucket_totals(counts, masses, tot_counts, tot_masses):
        """Block-wide totals of the per-thread bucket histograms, into every thread's ``tot_*`` (f32)."""
        part = cuda.shared.array((_TOTAL_ROWS, 32), float32)
        totals = cuda.shared.array(_TOTAL_ROWS, float32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        for b in range(BUCKETS):
            c = warp_sum(float32(counts[b]))
            m = warp_sum(masses[b])
            if lane == 0:
                part[b, wid] = c
                part[BUCKETS + b, wid] = m
        cuda.syncthreads()
        if cuda.threadIdx.x < _TOTAL_ROWS:
            t = float32(0.0)
            for w in range((cuda.blockDim.x + WARP - 1) // WARP):
                t += part[cuda.threadIdx.x, w]
            totals[cuda.threadIdx.x] = t
        cuda.syncthreads()
        for b in range(BUCKETS):
            tot_counts[b] = totals[b]
            tot_masses[b] = totals[BUCKETS + b]

    @device_fn
    def _block_kth_largest_key(v, k):
        """Ordered key of the k-th largest (1 ≤ k ≤ threads) of the threads' values ``v``: a bisection on the key,
        counting the threads at or above each probe with warp ballots (16 steps)."""
        warp_counts = cuda.shared.array(32, int32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        key = _key_of(v)
        lo = 0               # count(key ≥ lo) ≥ k
        hi = 0x10000         # count(key ≥ hi) = 0 < k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            c = cuda.popc(cuda.ballot_sync(FULL_MASK, key >= mid))
            cuda.syncthreads()
            if lane == 0:
                warp_counts[wid] = c
            cuda.syncthreads()
            total = 0
            for w in range((cuda.blockDim.x + WARP - 1) // WARP):
                total += warp_counts[w]
            if total >= k:
                lo = mid
            else:
                hi = mid
        return int32(lo)
