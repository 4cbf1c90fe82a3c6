"""CUDA-graph capture and replay of whole engine steps.

A numba launch costs ~20 µs of host time and a Qwen3-4B step has hundreds of kernels, so launching them one by
one would cost more than the GPU work. Instead, each step shape is captured once into a CUDA graph and replayed:

* decode steps of B sequences for B in ``decode_graph_sizes`` (1, 2, 4, 8, then steps of 8, 16, 32 up to
  ``max_batch``): T = B tokens, B logits rows; a batch between two sizes runs as the larger, padded with empty rows
  (slot -1), as vLLM does;
* prefill chunks padded up to a bucket of T tokens (16, 32, ... 512, 768, 1024, 1536, 2048: ``prefill_buckets``),
  one logits row.
  Padding tokens carry slot -1: their K/V are not written and their attention output is ignored.

Everything that changes per step — token ids, positions, slots, block tables, sampling parameters — lives in
device buffers that the runner refreshes with asynchronous copies on the same stream before ``cuGraphLaunch``, so
a captured graph never changes.
"""
from __future__ import annotations

from pegainfer.kernels.launch import on_stream

PREFILL_GRAPH_MAX = 2048
"""Largest prompt chunk replayed from a graph (the default token budget): an eager chunk pays the host cost of its
~500 launches (tens of µs each), which a 2048-token Qwen3-4B chunk measured at about as much as its GPU time."""


def decode_graph_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes that get a graph: every size up to 8, then steps of 8 to 64, 16 to 128, 32 beyond,
    and ``max_batch`` itself (padding wastes at most a few rows' work; each graph costs capture time and memory)."""
    sizes, b = [], 1
    while b <= max_batch:
        sizes.append(b)
        b += 1 if b < 8 else 8 if b < 64 else 16 if b < 128 else 32
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def prefill_buckets(max_tokens: int) -> list[int]:
    """The padded prompt-chunk sizes that get a graph: powers of two from 16 to 512, then 768, 1024, 1536, 2048 (half
    steps: above 512 a chunk pads by less than half), up to ``max_tokens``."""
    out, t = [], 16
    while t <= min(PREFILL_GRAPH_MAX, max_tokens):
        out.append(t)
        t = t * 2 if t < 512 else t + t // 2 if t & (t - 1) == 0 else t + t // 3    # 512 768 1024 1536 2048
    return out


def prefill_bucket(length: int, max_tokens: int):
    """The padded size of a prefill chunk of ``length`` tokens, or None when it is run unpadded (too long)."""
    for t in prefill_buckets(max_tokens):
        if length <= t:
            return t
    return None


def _check(result):
    from cuda.bindings import driver as drv
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA graph call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class StepGraphs:
    """Instantiated graphs keyed by (tokens T, logits rows B)."""

    def __init__(self, runner):
        self.runner = runner
        self.execs: dict[tuple[int, int], object] = {}
        self._graphs: list = []
        pads = getattr(runner.model, "pads_prefill", False)
        self.prefill_buckets = prefill_buckets(runner.model.max_tokens) if pads else []

    def has(self, T, B: int) -> bool:
        return (T, B) in self.execs

    def _cu_stream(self):
        from cuda.bindings import driver as drv
        return drv.CUstream(int(self.runner.stream.handle))

    def capture(self, T: int, B: int, decode: bool = False) -> None:
        """Capture a whole step (forward pass, grammar mask, sampler) of T tokens and B logits rows."""
        self.capture_fn((T, B), lambda: self.runner.forward_and_sample(T, B, decode=decode))

    def capture_fn(self, key: tuple, run) -> None:
        """Capture the launches of ``run()`` under ``key`` (also the two halves of a decode step launched ahead
        with grammar masks: ``("forward", B)`` and ``("sample", B)``, captured at their first use)."""
        from cuda.bindings import driver as drv
        from numba import cuda

        s = self._cu_stream()
        with cuda.defer_cleanup(), on_stream(self.runner.stream):
            _check(drv.cuStreamBeginCapture(s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
            try:
                run()
            finally:
                graph = _check(drv.cuStreamEndCapture(s))
        self._graphs.append(graph)
        self.execs[key] = _check(drv.cuGraphInstantiate(graph, 0))

    def capture_all(self) -> None:
        for B in self.runner.decode_sizes:
            if not self.has(B, B):
                self.capture(B, B, decode=True)
        for T in self.prefill_buckets:
            if not self.has(T, 1):
                self.capture(T, 1)
        self.runner.stream.synchronize()

    def replay(self, T, B: int) -> None:
        from cuda.bindings import driver as drv
        _check(drv.cuGraphLaunch(self.execs[(T, B)], self._cu_stream()))
