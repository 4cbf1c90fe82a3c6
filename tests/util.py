"""Helpers shared by tests: error metrics, bf16 rounding and random bf16 data."""
import contextlib
import inspect
from typing import Any, NamedTuple, Optional

import numpy as np

import pegainfer  # noqa: F401  (must come before numba)
from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits

SIMULATOR = pegainfer.SIMULATOR


def rel_l2(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bf16_round(x):
    """Round float64 values to the nearest bf16 (ties to even), returned as float64."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.round(np.ldexp(m, 8)), e - 8)


def bf16_randn(shape, rng, scale=1.0):
    """Random bf16 values: returns (uint16 bits, the same values as float64)."""
    bits = to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))
    return bits, from_bf16_bits(bits).astype(np.float64)


def greedy_decode(engine, prompt, steps, request_id="greedy"):
    """Run one greedy request (``steps`` new tokens, EOS ignored) through ``engine`` until it finishes:
    (the new token ids, the logits row of each step that produced a token, as float32 arrays)."""
    from pegainfer.engine.types import SamplingParams

    engine.runner.keep_logits = True      # logits_host below, also while a step launched ahead is unread
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    tokens, step_logits = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                tokens.extend(out.new_token_ids)
                step_logits.append(engine.runner.logits_host(1)[0].copy())
    return tokens, step_logits


def hf_logits_on_gpu(model_class, folder, ids, attn: str, dtype=None):
    """Hugging Face logits (teacher forcing) of one sequence from ``model_class.from_pretrained(folder)`` on the GPU
    in ``dtype`` (default bf16) with attention implementation ``attn``: float32 numpy ``[T, V]``."""
    import torch

    ref = model_class.from_pretrained(folder, dtype=dtype or torch.bfloat16, attn_implementation=attn).cuda().eval()
    with torch.inference_mode():
        out = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del ref
    torch.cuda.empty_cache()
    return out


class LaunchRecord(NamedTuple):
    """One launch through ``launch``: the kernel, the launch's ``name``, its 1-D grid and block, its dynamic shared
    bytes, the arguments passed to the kernel, and whether it declared the PDL contract (launched with a policy)."""
    kernel: Any
    name: Optional[str]
    grid: int
    block: int
    shared: int
    args: tuple
    pdl: bool

    def arg(self, param: str):
        """The value passed for the kernel's parameter named ``param``."""
        names = list(inspect.signature(kernel_function(self.kernel)).parameters)
        return self.args[names.index(param)]


def kernel_function(kernel):
    """The Python function a numba kernel (or the simulator's stand-in) was built from."""
    return getattr(kernel, "py_func", None) or getattr(kernel, "fn")


def launch_records_during(fn) -> list[LaunchRecord]:
    """Run ``fn()`` and return a ``LaunchRecord`` of every kernel it launched through ``launch``, in launch order
    (a launch that raised included)."""
    from pegainfer.kernels import launch as launch_module

    seen, real = [], launch_module._launch

    def record(kernel, grid, block, args, shared, policy, name):
        seen.append(LaunchRecord(kernel, name, grid, block, shared, tuple(args), policy is not None))
        real(kernel, grid, block, args, shared, policy, name)

    launch_module._launch = record
    try:
        fn()
    finally:
        launch_module._launch = real
    return seen


def launches_during(fn):
    """Run ``fn()`` and return ``[(kernel, pdl), ...]``: every kernel it launched through ``launch`` and whether
    the launch declared the PDL contract (launched with a policy, so it may overlap the kernel before it)."""
    return [(r.kernel, r.pdl) for r in launch_records_during(fn)]


def assert_pdl_contract(launched):
    """Every launch of an engine step is a PDL launch (so no kernel boundary is left unoverlapped), and every
    PDL-launched kernel waits for the previous kernel (``pdl_prologue()`` or ``grid_dependency_wait()`` in its
    source): a kernel without the wait would race with the kernel before it on the GPU.  And every launched
    kernel's closure is complete: numba's disk cache (GPU only) pickles each cell, and an empty one fails there."""
    assert launched, "nothing was launched"
    for kernel, pdl in launched:
        fn = kernel_function(kernel)
        name = fn.__name__
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cell.cell_contents
            except ValueError:   # numba's disk cache pickles every closure cell: this kernel fails on a GPU only
                raise AssertionError(f"{name}: closure variable {var!r} is never bound") from None
        assert pdl, f"{name} was launched without a policy (outside the PDL contract)"
        src = inspect.getsource(fn)
        assert "pdl_prologue()" in src or "grid_dependency_wait()" in src, f"{name} never waits for its inputs"


@contextlib.contextmanager
def recorded_step_kinds(engine):
    """The kinds of the steps ``engine`` runs, appended to the yielded list as they are planned: those the scheduler
    plans, and the mixed steps the engine plans itself beside decodes launched ahead of a read
    (``Scheduler.chunks_beside``)."""
    kinds = []
    schedule, chunks_beside = engine.scheduler.schedule, engine.scheduler.chunks_beside

    def recording():
        sched = schedule()
        if sched is not None:
            kinds.append(sched.kind)
        return sched

    def recording_beside(num_decodes):
        chunks = chunks_beside(num_decodes)
        if chunks:
            kinds.append("mixed")
        return chunks
    engine.scheduler.schedule, engine.scheduler.chunks_beside = recording, recording_beside
    try:
        yield kinds
    finally:
        del engine.scheduler.schedule, engine.scheduler.chunks_beside


def streams_with_a_late_arrival(engine, first, second, steps, after=2):
    """Greedy streams (``steps`` tokens each) of prompt ``first`` and prompt ``second``, the second added once the
    first has ``after`` tokens, so its prompt is prefilled in mixed steps beside the first's decodes.  Returns
    ({"first": ids, "second": ids}, the kinds of the steps run: those the scheduler plans, and the mixed steps
    the engine plans itself beside decodes launched ahead of a read, ``Scheduler.chunks_beside``)."""
    from pegainfer.engine.types import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    got = {"first": [], "second": []}
    with recorded_step_kinds(engine) as kinds:
        engine.add_request("first", first, params)
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            if len(got["first"]) == after and "second" not in engine._seqs and not got["second"]:
                engine.add_request("second", second, params)
    return got, kinds


def emulated_graphs(runner):
    """``runner``'s ``StepGraphs`` (same keys, lazy capture and cap) with capture and replay emulated for the
    simulator: a capture keeps the step's launch function, whose shape is baked in as in a graph, and a replay
    calls it (the capturing step's T, B and row counts with the replaying step's inputs, as a graph replays).
    ``replayed`` lists the keys replayed."""
    from pegainfer.engine.cuda_graph import StepGraphs

    class EmulatedGraphs(StepGraphs):
        def capture_fn(self, key, run):
            self.execs[key] = run

        def replay(self, *key):
            self.replayed.append(key)
            self.execs[key]()

    graphs = EmulatedGraphs(runner)
    graphs.replayed = []
    return graphs


def record_gpu_result(entry: dict) -> None:
    """Print a GPU test's ``entry`` as one JSON line; append it to $PEGAINFER_GPU_RESULTS when set (the file
    ``benchmarks/run_all.sh`` collects)."""
    import json
    import os
    print(json.dumps(entry))
    path = os.environ.get("PEGAINFER_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")

