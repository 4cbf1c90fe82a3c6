"""How a kernel is declared and sized, with the same code on a GPU and in the simulator: ``@kernel`` (``cuda.jit``,
cached on disk on the GPU), ``@launch_bounded(threads, blocks)`` (the same, register-bounded), ``@device_fn`` (inlined on the GPU), the scalar types kernels are written with, and block
and grid sizes that shrink in the simulator (``threads``, ``grid``)."""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR

float32, int32, uint16, uint32 = np.float32, np.int32, np.uint16, np.uint32

if SIMULATOR:
    kernel = cuda.jit
    device_fn = cuda.jit(device=True)
else:
    kernel = cuda.jit(cache=True)
    device_fn = cuda.jit(device=True, forceinline=True)


def launch_bounded(threads_per_block: int, min_blocks: int = 1):
    """``@kernel`` compiled for blocks of ``threads_per_block`` threads, at least ``min_blocks`` of them resident an
    SM (``launch_bounds``: ptxas keeps to ``65536 / (threads_per_block · min_blocks)`` registers a thread), cached on
    disk under a key that includes the bounds.  In the simulator, which rejects ``launch_bounds``, ``kernel``."""
    if SIMULATOR:
        return kernel

    def compile_bounded(fn):
        from pegainfer.kernels.numba_internals import key_cache_on
        bounds = (threads_per_block, min_blocks)
        return key_cache_on(cuda.jit(cache=True, launch_bounds=bounds)(fn), ("launch_bounds",) + bounds)
    return compile_bounded


def threads(gpu: int = 256, sim: int = 32) -> int:
    """Block size for a launch: ``gpu`` on hardware, ``sim`` (default one warp) in the simulator."""
    return sim if SIMULATOR else gpu


@functools.cache
def sm_count() -> int:
    """SMs of the GPU (4 in the simulator)."""
    return 4 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def grid(n: int, per_block: int = 1, sim_cap: int = 64) -> int:
    """Number of blocks to cover ``n`` work items at ``per_block`` each (capped in the simulator, where kernels
    must then use grid-stride loops)."""
    blocks = max(1, -(-n // per_block))
    return min(blocks, sim_cap) if SIMULATOR else blocks
