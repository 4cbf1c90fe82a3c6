"""GPU timing shared by the kernel microbenchmarks: capture calls into one CUDA graph and time its replays, so the
~20 µs host cost of each numba launch is not what gets measured."""
from __future__ import annotations

import contextlib
import statistics
import time

from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.engine.cuda_graph import _check
from pegainfer.kernels.launch import on_stream


@contextlib.contextmanager
def captured(calls):
    """A CUDA graph that runs every function of ``calls`` once, in order (each launches kernels through
    ``pegainfer.kernels.launch``); yields ``replay()``, which launches it on its stream and waits for it.  The first
    two calls run once outside the capture (compile, warm up)."""
    from cuda.bindings import driver as drv
    stream = cuda.stream()
    with on_stream(stream):
        for fn in calls[:2]:
            fn()
    stream.synchronize()
    cs = drv.CUstream(int(stream.handle))
    with cuda.defer_cleanup(), on_stream(stream):
        _check(drv.cuStreamBeginCapture(cs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            for fn in calls:
                fn()
        finally:
            graph = _check(drv.cuStreamEndCapture(cs))
    exe = _check(drv.cuGraphInstantiate(graph, 0))

    def replay():
        _check(drv.cuGraphLaunch(exe, cs))
        stream.synchronize()

    replay.stream, replay.exe, replay.cu_stream = stream, exe, cs
    try:
        yield replay
    finally:
        _check(drv.cuGraphExecDestroy(exe))
        _check(drv.cuGraphDestroy(graph))


def time_calls(calls, reps: int = 5) -> float:
    """Seconds per call: median over ``reps`` replays of a CUDA graph that runs every function of ``calls`` once,
    in order (``captured``).  Simulator: each distinct call once."""
    if SIMULATOR:   # a smoke run: each distinct call once
        distinct = list(dict.fromkeys(calls))
        t0 = time.perf_counter()
        for fn in distinct:
            fn()
        return (time.perf_counter() - t0) / len(distinct)
    from cuda.bindings import driver as drv
    with captured(calls) as replay:
        replay()
        times = []
        for _ in range(reps):
            start, end = cuda.event(), cuda.event()
            start.record(replay.stream)
            _check(drv.cuGraphLaunch(replay.exe, replay.cu_stream))
            end.record(replay.stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / len(calls))
        return statistics.median(times)


def time_eager(fn, launches: int, reps: int = 5) -> float:
    """Seconds per call of ``fn`` launched eagerly ``launches`` times in a row (host launch cost included)."""
    if SIMULATOR:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    stream = cuda.stream()
    with on_stream(stream):
        fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        with on_stream(stream):
            for _ in range(launches):
                fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / launches)
    return statistics.median(times)


def last_decode_step(model_path: str, context: int):
    """``(engine, step)``: an engine on ``model_path`` that has prefilled ``context`` random tokens and decoded a few
    more, and ``step()``, which runs its last decode step again (forward + sampler) from the inputs still in the
    runner's buffers: one token at position ~``context``, ready to be captured into a graph and timed."""
    import numpy as np

    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    engine = Engine.from_folder(model_path, 4096, max_batch=1)
    prompt = np.random.default_rng(0).integers(0, min(engine.model.V, 10000), size=context).tolist()
    engine.add_request("last_decode_step", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    runner = engine.runner
    return engine, lambda: runner.forward_and_sample(1, 1, decode=True)
