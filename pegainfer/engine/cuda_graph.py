"""CUDA-graph capture and replay of the decode step.

A numba launch costs ~20 µs of host time and a Qwen3-4B decode step has hundreds of kernels, so launching them one
by one would cost more than the GPU work. Instead, the whole step (forward pass + sampler) for a batch of B
sequences is captured once into a CUDA graph per B and replayed each token. Everything that changes per step —
token ids, positions, slots, block tables, sampling parameters — lives in device buffers that the runner refreshes
with asynchronous copies on the same stream before ``cuGraphLaunch``, so the captured graph never changes.
"""
from __future__ import annotations

from pegainfer.kernels.launch import on_stream


def _check(result):
    from cuda.bindings import driver as drv
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA graph call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class DecodeGraphs:
    """One instantiated graph per decode batch size 1..max_batch."""

    def __init__(self, runner):
        self.runner = runner
        self.execs: dict[int, object] = {}
        self._graphs: list = []

    def can_run(self, B: int) -> bool:
        return B in self.execs

    def _cu_stream(self):
        from cuda.bindings import driver as drv
        return drv.CUstream(int(self.runner.stream.handle))

    def capture(self, B: int) -> None:
        from cuda.bindings import driver as drv
        from numba import cuda

        s = self._cu_stream()
        with cuda.defer_cleanup(), on_stream(self.runner.stream):
            _check(drv.cuStreamBeginCapture(s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
            try:
                self.runner.forward_and_sample(B, B)
            finally:
                graph = _check(drv.cuStreamEndCapture(s))
        self._graphs.append(graph)
        self.execs[B] = _check(drv.cuGraphInstantiate(graph, 0))

    def capture_all(self) -> None:
        for B in range(1, self.runner.max_batch + 1):
            if B not in self.execs:
                self.capture(B)
        self.runner.stream.synchronize()

    def replay(self, B: int) -> None:
        from cuda.bindings import driver as drv
        _check(drv.cuGraphLaunch(self.execs[B], self._cu_stream()))
