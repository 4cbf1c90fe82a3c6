"""What the benchmarks share: time GPU work as CUDA-graph replays (a numba launch costs ~20 µs of host time, more
than most kernels, so eager timing would measure Python), build a warmed-up engine whose decode graph can be
captured again, and refuse GPU-only work in the simulator with one line.

Kernel modules are imported inside the functions, so a script's ``--help`` does not pay for compiling them.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:        # run from a checkout without installing; after PYTHONPATH (A/B against a tree)
    sys.path.append(str(ROOT))


def on_gpu() -> bool:
    """Whether kernels run on a GPU (not in Numba's CUDA simulator)."""
    from pegainfer.device import SIMULATOR
    return not SIMULATOR


def require_gpu(what: str, why: str = "the simulator has no CUDA graphs") -> None:
    """Exit with a one-line message (status 2) when kernels would run in the simulator."""
    if not on_gpu():
        print(f"error: {what} needs a GPU ({why})", file=sys.stderr)
        raise SystemExit(2)


def check_cuda(result):
    """The value of a ``cuda.bindings.driver`` call; raises on an error code."""
    from cuda.bindings import driver as drv
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


@contextlib.contextmanager
def captured(calls):
    """A CUDA graph that runs every function of ``calls`` once, in order (each launches kernels through
    ``pegainfer.kernels.launch``); yields ``replay()``, which launches it on its stream and waits for it.  The first
    two calls run once outside the capture (compile, warm up)."""
    from cuda.bindings import driver as drv
    from numba import cuda

    from pegainfer.kernels.launch import on_stream
    stream = cuda.stream()
    with on_stream(stream):
        for fn in calls[:2]:
            fn()
    stream.synchronize()
    cs = drv.CUstream(int(stream.handle))
    with cuda.defer_cleanup(), on_stream(stream):
        check_cuda(drv.cuStreamBeginCapture(cs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            for fn in calls:
                fn()
        finally:
            graph = check_cuda(drv.cuStreamEndCapture(cs))
    exe = check_cuda(drv.cuGraphInstantiate(graph, 0))

    def replay():
        check_cuda(drv.cuGraphLaunch(exe, cs))
        stream.synchronize()

    replay.stream, replay.exe, replay.cu_stream = stream, exe, cs
    try:
        yield replay
    finally:
        check_cuda(drv.cuGraphExecDestroy(exe))
        check_cuda(drv.cuGraphDestroy(graph))


def time_calls(calls, reps: int = 5) -> float:
    """Seconds per call: median over ``reps`` replays of a CUDA graph that runs every function of ``calls`` once,
    in order (``captured``).  Simulator: each distinct call once, wall clock (a smoke run)."""
    if not on_gpu():
        distinct = list(dict.fromkeys(calls))
        t0 = time.perf_counter()
        for fn in distinct:
            fn()
        return (time.perf_counter() - t0) / len(distinct)
    from cuda.bindings import driver as drv
    from numba import cuda
    with captured(calls) as replay:
        replay()
        times = []
        for _ in range(reps):
            start, end = cuda.event(), cuda.event()
            start.record(replay.stream)
            check_cuda(drv.cuGraphLaunch(replay.exe, replay.cu_stream))
            end.record(replay.stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / len(calls))
        return statistics.median(times)


def time_eager(fn, launches: int, reps: int = 5) -> float:
    """Seconds per call of ``fn`` launched eagerly ``launches`` times in a row (host launch cost included)."""
    if not on_gpu():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    from numba import cuda

    from pegainfer.kernels.launch import on_stream
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


def replay_graph_ms(runner, exe, replays: int, warmup: int = 0) -> float:
    """Milliseconds per replay of the instantiated graph ``exe`` on the runner's stream: ``warmup`` unmeasured
    launches, then ``replays`` launches between two CUDA events."""
    from cuda.bindings import driver as drv
    from numba import cuda
    stream = drv.CUstream(int(runner.stream.handle))
    for _ in range(warmup):
        check_cuda(drv.cuGraphLaunch(exe, stream))
    start, end = cuda.event(), cuda.event()
    start.record(runner.stream)
    for _ in range(replays):
        check_cuda(drv.cuGraphLaunch(exe, stream))
    end.record(runner.stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / replays


def warmed_engine(model_path, max_model_len: int = 4096, prompt_len: int = 16, output_len: int = 64, policy=None,
                  batch: int = 1):
    """An engine on ``model_path`` (with ``policy``, else the engine's default) whose decode graph of ``batch``
    sequences is captured and was last replayed at a context of about ``prompt_len + output_len`` tokens: batch 1
    generates ``output_len`` tokens after a random ``prompt_len``-token prompt; a batch decodes ``batch`` random
    prompts together for ``output_len`` steps (``bench.time_batch_decode``).  Replaying the decode graph reruns the
    last step from the inputs still in the runner's buffers (the same positions, the sampled ids fed back); timing
    does not depend on those values."""
    import numpy as np

    from pegainfer.bench import time_batch_decode, time_generation
    from pegainfer.engine.engine import Engine
    engine = Engine.from_folder(model_path, max_model_len, max_batch=batch, policy=policy)
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    if batch == 1:
        time_generation(engine, rng.integers(0, vocab, size=prompt_len).tolist(), output_len)
    else:
        time_batch_decode(engine, rng.integers(0, vocab, size=(batch, prompt_len)).tolist(), output_len)
    engine.runner.stream.synchronize()
    return engine


def fit_linear_workspace(engine, policies) -> None:
    """Grow the model's split-K workspace to what the largest of ``policies`` needs (a tuned geometry may split
    more than the defaults the model sized it for), before graphs are captured under them.  The old buffer is kept
    alive: graphs captured earlier still point at it."""
    import numpy as np
    from numba import cuda
    from pegainfer.kernels import linear
    model = engine.model
    need = max(int(linear.linear_workspace_size(model.max_tokens, model.projection_shapes(), p)) for p in policies)
    if need > model.linear_workspace.size:
        engine.replaced_workspaces = getattr(engine, "replaced_workspaces", []) + [model.linear_workspace]
        model.linear_workspace = cuda.to_device(np.zeros(need, np.float32))
        model._linear_workspace_size = need


def capture_decode_graph(engine, policy=None, batch: int = 1):
    """Capture the engine's decode graph of ``batch`` sequences (padded to the runner's graph size) again, its model
    holding ``policy`` while the step is captured (None: the model's own), and return the instantiated graph.  The
    model's policy is put back afterwards; the runner keeps the new graph as its entry until the next capture."""
    runner, model = engine.runner, engine.model
    B = runner.padded_batch(batch)
    own = model.policy
    if policy is not None:
        model.policy = policy
    try:
        runner.graphs.capture(B, B, decode=True)
        runner.stream.synchronize()
    finally:
        model.policy = own
    return runner.graphs.execs[(B, B)]


def last_decode_step(model_path: str, context: int, batch: int = 1):
    """``(engine, step)``: a warmed engine (``warmed_engine``) that has prefilled ``context`` tokens (each of
    ``batch`` sequences) and decoded 4 more, and ``step()``, which runs its last decode step again (forward +
    sampler, the batch padded to its graph's size) from the inputs still in the runner's buffers, ready to be
    captured into a graph of its own (``captured``) and timed."""
    engine = warmed_engine(model_path, 4096, prompt_len=context, output_len=4, batch=batch)
    runner = engine.runner
    B = runner.padded_batch(batch)
    return engine, lambda: runner.forward_and_sample(B, B, decode=True)


def kernel_name(package: str, *names: str):
    """The first of ``names`` (in that order of preference) found in kernel package ``package`` (e.g.
    ``"pegainfer.kernels.linear"``) or, when the package does not re-export it, in one of its modules.  Benchmarks
    reach the names beyond a package's core API (geometry pickers, forced-geometry launchers) through this one
    function, so a name that moves between modules, or loses its underscore, is found wherever it lives."""
    import importlib
    import pkgutil
    mod = importlib.import_module(package)
    subs = None
    for name in names:
        if hasattr(mod, name):
            return getattr(mod, name)
        if subs is None:
            subs = [importlib.import_module(f"{package}.{info.name}")
                    for info in pkgutil.iter_modules(getattr(mod, "__path__", []))]
        for sub in subs:
            if hasattr(sub, name):
                return getattr(sub, name)
    raise AttributeError(f"{package} has none of {', '.join(names)}")
