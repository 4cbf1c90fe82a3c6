"""Memory-bandwidth probe: the ceiling that decode speed is compared against."""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR as SIM
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import grid, kernel, load_u32x4, threads


@kernel
def read_sum_u32x4(a, out):
    """Read every 16 bytes of ``a`` once (``a`` is ``[n]`` uint32, n a multiple of 4) and xor-fold them, so the
    compiler cannot drop the loads; one word per block is written to ``out[block]``.

    Geometry: grid-stride over the n/4 vectors, any grid; the number a decode step can hope for is n*4 bytes /
    kernel time."""
    acc = np.uint32(0)
    nvec = a.shape[0] // 4
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    while i < nvec:
        x0, x1, x2, x3 = load_u32x4(a, i * 4)
        acc ^= x0 ^ x1 ^ x2 ^ x3
        i += stride
    if acc == np.uint32(0x12345678):  # practically never: keeps the loads alive without a store per thread
        out[cuda.blockIdx.x] = acc


def measure_read_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes per second that a 16-byte-load read kernel achieves over ``nbytes`` (median of ``iters``)."""
    a = cuda.device_array(nbytes // 4, dtype=np.uint32)
    blocks = grid(132 * 8, 1)
    out = cuda.device_array(blocks, dtype=np.uint32)
    tb = threads(512)
    launch(read_sum_u32x4, blocks, tb, a, out)
    cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = cuda.event(), cuda.event()
        s.record()
        launch(read_sum_u32x4, blocks, tb, a, out)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return nbytes / float(np.median(times))


@kernel
def spin_wait(microseconds, out):
    """Keep the GPU busy for about ``microseconds`` µs (one thread sleeping 1 µs at a time; ``out[0]`` counts).

    Used by the tracer: launched first in a traced eager step, it holds the stream while the host enqueues every
    kernel of the step with its CUDA events, so the kernels then run back to back and each event pair measures the
    kernel's own GPU time rather than the host's launch latency."""
    n = 0
    for _ in range(microseconds):
        if not SIM:
            cuda.nanosleep(np.uint32(1000))
        n += 1
    out[0] = n
