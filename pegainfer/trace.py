"""Chrome Trace Event output (open the JSON in https://ui.perfetto.dev or chrome://tracing).

Two kinds of spans:
* per request (track "requests"): queue → prefill → each decode step, from host timestamps;
* per kernel (track "GPU kernels"): the GPU time of every kernel of one eager (non-graph) prefill and decode step,
  measured with CUDA events around each launch. Steps replayed from a CUDA graph appear as one span each, since a
  graph cannot be timed kernel by kernel.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

from pegainfer.device import SIMULATOR

SPIN_US = 100_000   # 100 ms: longer than the host needs to enqueue one eager step


class ChromeTracer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self._pending: list[tuple[str, object, object, float]] = []
        self._spin_out = None

    def _us(self, t: float) -> float:
        return (t - self.t0) * 1e6

    def span(self, name: str, start: float, end: float, track: str, **args) -> None:
        self.events.append({"name": name, "ph": "X", "ts": self._us(start), "dur": max(0.0, (end - start) * 1e6),
                            "pid": 1, "tid": track, "args": args})

    # -- per-kernel GPU timing (used as launch.traced(tracer.kernel))
    @contextlib.contextmanager
    def kernel(self, name: str):
        if SIMULATOR:
            t = time.perf_counter()
            yield
            self.span(name, t, time.perf_counter(), "kernels (simulator, host time)")
            return
        from numba import cuda
        from pegainfer.kernels.launch import current_stream
        s = current_stream()
        if not self._pending:   # first kernel of the step: hold the GPU while the host enqueues the rest
            from pegainfer.kernels.memory import spin_wait
            if self._spin_out is None:
                self._spin_out = cuda.device_array(1, dtype=np.int64)
            spin_wait[1, 1, s](np.int64(SPIN_US), self._spin_out)
        start, end = cuda.event(), cuda.event()
        start.record(s)
        yield
        end.record(s)
        self._pending.append((name, start, end, time.perf_counter()))

    def flush_kernels(self, step: str = "") -> None:
        """Resolve the CUDA events of the last traced step into back-to-back kernel spans."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        t = self._pending[0][3]
        for name, start, end, _ in self._pending:
            ms = start.elapsed_time(end)
            self.span(name, t, t + ms * 1e-3, "GPU kernels (eager step, CUDA events)", gpu_us=round(ms * 1e3, 2),
                      step=step)
            t += ms * 1e-3
        self._pending.clear()

    def write(self, folder: str) -> Path:
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / f"pegainfer-trace-{os.getpid()}-{int(time.time())}.json"
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        return path


@contextlib.contextmanager
def maybe_trace(folder, engine):
    """If ``folder`` is set, trace the engine's steps while the block runs and write the trace at the end."""
    if not folder:
        yield None
        return
    import sys
    tracer = ChromeTracer()
    engine.tracer = tracer
    try:
        yield tracer
    finally:
        engine.tracer = None
        path = tracer.write(folder)
        print(f"[pegainfer] wrote Chrome trace {path} (open it in https://ui.perfetto.dev)", file=sys.stderr)
