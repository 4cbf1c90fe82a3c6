"""How a kernel is declared and sized, with the same code on a GPU and in the simulator: ``@kernel`` (``cuda.jit``,
cached on disk on the GPU), ``@device_fn`` (inlined on the GPU), the scalar types kernels are written with, and block
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
