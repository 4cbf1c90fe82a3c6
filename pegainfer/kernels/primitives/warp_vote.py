"""``warp_any(pred)``: whether ``pred`` holds in any lane of the warp, in every lane -- one ``vote.any`` on the GPU.

A warp-uniform answer lets a warp skip work that only some lanes would need (the prefill kernel's rescale of its O
accumulator when no row's running max moved enough).  In the simulator it is emulated with block-shared scratch and
the block barrier, so, as for the warp reductions, *every thread of the block must call it the same number of
times*.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn
from pegainfer.kernels.primitives.reductions import FULL_MASK, WARP

if SIMULATOR:
    @device_fn
    def warp_any(pred):
        votes = cuda.shared.array(1024, np.int32)
        t = int(cuda.threadIdx.x)
        votes[t] = 1 if pred else 0
        cuda.syncthreads()
        lo = t - t % WARP
        result = bool(votes[lo:lo + WARP].any())
        cuda.syncthreads()
        return result
else:
    @device_fn
    def warp_any(pred):
        return cuda.any_sync(FULL_MASK, pred)
