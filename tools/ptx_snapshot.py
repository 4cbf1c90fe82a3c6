"""Which compiled kernels do the served models launch, and did a change to the kernel code change any of them?

Without a GPU: builds Qwen3-4B, Qwen3-8B and Qwen3.5-4B at their real shapes on a stand-in H200 (compute
capability 9.0, 132 SMs, 227 KB of opt-in shared memory), runs the engine's own ``ModelRunner.forward_and_sample``
for decode steps and prompt chunks, records every ``launch(...)`` instead of running it, and compiles each
distinct (kernel, argument types) to sm_90a PTX the way numba does for the launch (``_Kernel`` with the
dispatcher's target options).  The output is a JSON map from a launch description to the sha256 of its PTX::

    PYTHONPATH=OLD_TREE python tools/ptx_snapshot.py --out base.json
    PYTHONPATH=NEW_TREE python tools/ptx_snapshot.py --out new.json
    python tools/ptx_snapshot.py --diff base.json new.json             # exit status 1 if anything differs

(the ``pegainfer`` first on the import path is the one snapshotted; the summary line names its folder).

How the stand-in works: ``numba.cuda``'s context is replaced by one whose allocations hand out distinct, 512-byte
aligned fake addresses, so device arrays are real ``DeviceNDArray`` objects (slices, views, reshapes and the
argument types numba infers from them are those of a GPU run, alignment checks see GPU-like addresses) and copies
do nothing.  Weights are zeros of the checkpoint's shapes; kernels never run, so values do not matter.

A description is ``model/case name grid=.. block=.. shared=.. pdl=.. (argument types)``; identical launches within
a case count once (a kernel launched once, when a buffer is first made, shows in the first case that makes it).
The hash covers the PTX and the dispatcher's target options (launch bounds, register cap, fastmath, ...); the PTX
loses its header comments (compiler version), numba's generated names (mangled symbols, which carry the module path,
and shared arrays, numbered by a per-process counter) are renamed by first use, and module-scope declarations are
sorted (NVVM's order of them varies from run to run): the same code compiled in another process, order or module
hashes alike.  ``--ptx-dir`` keeps the normalized PTX, to diff a kernel that changed.

Fixed: the engine's limits (``MAX_MODEL_LEN`` 4096, ``MAX_PREFILL_TOKENS`` 2048, ``MAX_BATCH`` 64, 16-token
pages) and the default launch policy (``LaunchPolicy``: kernel variants only another policy selects are not
compiled).  Not covered: kernels no engine step launches (``sampling.argmax`` / ``logsumexp``, ``kernels.memory``,
the paths tests and benchmarks force).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["PEGAINFER_DEVICE"] = "gpu"

import pegainfer  # noqa: E402,F401  (decides the device before numba is imported)
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402
from numba.cuda import api as _api  # noqa: E402
from numba.cuda.cudadrv import devices as _devices, driver as _driver  # noqa: E402

MODELS = {
    "4b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
               vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000, max_position_embeddings=40960),
    "8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
               vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000, max_position_embeddings=40960),
    "3.5-4b": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=2560,
                   num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                   intermediate_size=9216, vocab_size=248320, tie_word_embeddings=True,
                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                   max_position_embeddings=262144, rope_parameters={"rope_type": "default",
                                                                    "rope_theta": 10000000,
                                                                    "partial_rotary_factor": 0.25}),
}
MODELS["3.5-4b-bf16-state"] = {**MODELS["3.5-4b"], "mamba_ssm_dtype": "bfloat16"}   # --mamba-ssm-cache-dtype bfloat16
# between them these launch every distinct kernel that ``--cases all`` does (57 when written)
DEFAULT_CASES = ("decode1", "decode4", "decode32", "decode48", "decode64", "prefill16", "prefill128", "prefill512",
                 "prefill2048", "score1", "score16")
MAX_MODEL_LEN, MAX_PREFILL_TOKENS, MAX_BATCH = 4096, 2048, 64


def case_shape(case: str) -> tuple[int, int, bool]:
    """(tokens T, logits rows B, decode) of a case: ``decodeB`` (B sequences, one token each), ``prefillT`` (a
    prompt chunk of T tokens, one logits row) or ``scoreT`` (T prompt tokens, every one a logits row, as
    ``Engine.score`` runs them)."""
    m = re.fullmatch(r"(decode|prefill|score)(\d+)", case)
    kind, n = (m.group(1), int(m.group(2))) if m else ("", 0)
    limit = {"decode": MAX_BATCH, "prefill": MAX_PREFILL_TOKENS, "score": SCORE_ROWS}.get(kind, 0)
    if not 1 <= n <= limit:
        raise ValueError(f"case {case!r}: decodeB (B <= {MAX_BATCH}), prefillT (T <= {MAX_PREFILL_TOKENS}) or "
                         f"scoreT (T <= {SCORE_ROWS})")
    return (n, n, True) if kind == "decode" else (n, 1 if kind == "prefill" else n, False)


def every_engine_case() -> list[str]:
    """The step shapes the engine captures or runs: decode of 1 .. MAX_BATCH sequences, prompt chunks of every
    graph bucket and of MAX_PREFILL_TOKENS, scoring of 1 .. SCORE_ROWS tokens."""
    return ([f"decode{b}" for b in range(1, MAX_BATCH + 1)]
            + [f"prefill{t}" for t in prefill_buckets(MAX_PREFILL_TOKENS) + [MAX_PREFILL_TOKENS]]
            + [f"score{t}" for t in range(1, SCORE_ROWS + 1)])


# ------------------------------------------------------------------------------------------------ the stand-in GPU
class _FakeDevice:
    id = 0
    name = b"NVIDIA H200 (offline stand-in)"
    compute_capability = (9, 0)
    MULTIPROCESSOR_COUNT = 132
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 232448


class _Inert:
    """A stream or event: every method does nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: None


class _FakeContext:
    """numba's CUDA context for a GPU that is not there: allocations get distinct 512-byte aligned addresses and no
    memory; pinned host buffers are ordinary numpy memory."""

    device = _FakeDevice()

    def __init__(self):
        self.next_address = 1 << 40

    def memalloc(self, size):
        address, self.next_address = self.next_address, self.next_address + -(-max(size, 1) // 512) * 512
        return _driver.MemoryPointer(None, _driver.binding.CUdeviceptr(address), size)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        return np.zeros(size, np.uint8)

    def create_stream(self):
        return _Inert()

    def create_event(self, timing=True):
        return _Inert()


def install_fake_gpu() -> None:
    """Route numba's context, device queries and copies to ``_FakeContext`` (before pegainfer's kernels import)."""
    ctx = _FakeContext()
    _devices.get_context = _api.current_context = lambda devnum=None: ctx
    _devices._runtime.ensure_context = contextlib.nullcontext
    for name in ("host_to_device", "device_to_device", "device_to_host", "device_memset"):
        setattr(_driver, name, lambda *a, **k: None)


install_fake_gpu()
from numba.cuda.dispatcher import _Kernel  # noqa: E402

from pegainfer.config import load_model_config  # noqa: E402
from pegainfer.engine.cuda_graph import prefill_buckets  # noqa: E402
from pegainfer.engine.engine import PAGE_SIZE, SCORE_ROWS  # noqa: E402
from pegainfer.engine.kv_cache import PagePool  # noqa: E402
from pegainfer.engine.runner import ModelRunner  # noqa: E402
from pegainfer.kernels import launch as _launch_module  # noqa: E402
from pegainfer.models import model_class  # noqa: E402


def launch_policy():
    """The tree's ``LaunchPolicy`` for the stand-in H200, or None in a tree without ``pegainfer.kernels.policy``."""
    try:
        from pegainfer.kernels.policy import LaunchPolicy
    except ImportError:
        return None
    for_device = getattr(LaunchPolicy, "for_device", None)
    for args in ((cuda.get_current_device(),), ()):
        try:
            return for_device(*args)
        except TypeError:
            continue
    return LaunchPolicy()


POLICY = launch_policy()


def with_policy(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, plus ``policy=POLICY`` where the tree has a policy and ``fn`` takes one."""
    if POLICY is not None and "policy" in inspect.signature(fn).parameters:
        kwargs["policy"] = POLICY
    return fn(*args, **kwargs)


class ZeroWeights:
    """A ``WeightReader`` whose every tensor exists and is zeros of the shape asked for (bf16 bits)."""

    prefix = "model."

    def has(self, name):
        return True

    def host_bf16(self, name, expected_shape=None):
        return np.zeros(expected_shape, np.uint16)

    def upload(self, name, expected_shape=None, dest=None):
        return dest if dest is not None else cuda.device_array(expected_shape, np.uint16)


# ------------------------------------------------------------------------------------------------ recording
class Recorder:
    """Stands in for ``launch._launch``: keeps each launch as (case, description, kernel fingerprint)."""

    def __init__(self):
        self.case = "setup"
        self.launches: list[tuple[str, str, tuple]] = []
        self.kernels: dict[tuple, tuple] = {}       # fingerprint -> (dispatcher, argument types)

    def __call__(self, kernel, grid, block, args, shared=0, policy=None, name=None, *more, **options):
        pdl = policy is not None and policy.overlaps(name)      # as ``launch._launch`` decides on an sm_90 GPU
        types = tuple(kernel.typeof_pyval(a) for a in args)
        fp = fingerprint(kernel, types)
        self.kernels.setdefault(fp, (kernel, types))
        label = name or kernel.py_func.__name__
        desc = (f"{label} grid={grid} block={block} shared={shared} pdl={int(bool(pdl))} "
                f"({', '.join(map(str, types))})")
        self.launches.append((self.case, desc, fp))


def _stable(value):
    """A hashable stand-in for a closure value: the value itself when it is a plain constant, else its identity."""
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool, type(None))) for v in value):
        return value
    return ("id", id(value))


def _cell(cell):
    """A closure cell's value; an empty cell (a name the closure binds later) as a marker."""
    try:
        return cell.cell_contents
    except ValueError:
        return ("empty cell",)


def _options(kernel) -> str:
    return repr(sorted((k, v) for k, v in kernel.targetoptions.items() if k != "extensions"))


def fingerprint(kernel, types) -> tuple:
    """What makes two launched kernels compile alike: the Python function (module, name, closure constants), the
    target options and the argument types."""
    f = kernel.py_func
    cells = tuple(_stable(_cell(c)) for c in (f.__closure__ or ()))
    return f.__module__, f.__qualname__, hash(f.__code__), cells, _options(kernel), types


def record(model_names, case_names, recorder: Recorder):
    """Build each model and run the asked cases through ``ModelRunner.forward_and_sample``."""
    home = sys.modules[_launch_module.launch.__module__]     # where ``launch`` looks ``_launch`` up
    home._launch = recorder
    from pegainfer.kernels.primitives import tma
    tma._encode = lambda a, box_rows: np.zeros(tma.MAP_WORDS, np.uint64)   # the driver's encoder needs a driver
    tma.TensorMapTable._write = lambda self, dst, src: dst.copy_to_device(src)   # ... and so does its stream
    if getattr(home, "_launch_pdl", 0) is None:
        home._launch_pdl = object()    # the H200 has PDL, and ``overlaps()`` picks kernel variants
    for model in model_names:
        recorder.case = f"{model}/setup"
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(json.dumps(MODELS[model]))
            cfg = load_model_config(folder)
        Model = model_class(cfg.arch)
        m = with_policy(Model, cfg, MAX_MODEL_LEN, MAX_PREFILL_TOKENS, max(MAX_BATCH, SCORE_ROWS))
        m.load_weights(ZeroWeights())
        pages = MAX_BATCH * -(-MAX_MODEL_LEN // PAGE_SIZE)
        m.allocate(pages, PAGE_SIZE)
        pool = PagePool(pages, PAGE_SIZE, MAX_BATCH, MAX_MODEL_LEN)
        runner = with_policy(ModelRunner, m, pool, MAX_BATCH, use_cuda_graph=False)
        m.reset_slot(0)
        for case in case_names:
            recorder.case = f"{model}/{case}"
            T, B, decode = case_shape(case)
            runner.forward_and_sample(T, B, decode=decode)


# ------------------------------------------------------------------------------------------------ PTX
_SYMBOL = re.compile(r"_Z\w+|_cudapy_smem_\d+")
_DECLARATION = re.compile(r"(\.visible |\.extern |\.common )?\.(shared|global|const) ")


def normalized_ptx(ptx: str) -> str:
    """The PTX without its header comments (compiler build and version), with numba's generated names (mangled
    symbols, which carry the module path and a per-process counter, and shared arrays, numbered by a per-process
    counter) renamed ``SYM<n>`` by first use in the code (``SYM?``: declared, never used), and each run of
    module-scope variable declarations sorted (NVVM emits them in an order that varies from run to run)."""
    lines = ptx.splitlines()
    while lines and (lines[0].startswith("//") or not lines[0].strip()):
        lines.pop(0)
    names: dict[str, str] = {}
    for line in lines:
        if not _DECLARATION.match(line):
            for m in _SYMBOL.finditer(line):
                names.setdefault(m.group(0), f"SYM{len(names)}")
    lines = [_SYMBOL.sub(lambda m: names.get(m.group(0), "SYM?"), line) for line in lines]
    out, run = [], []
    for line in lines + [""]:
        if _DECLARATION.match(line):
            run.append(line)
        else:
            out += sorted(run) + [line]
            run = []
    return "\n".join(out[:-1])


def compile_all(kernels: dict, ptx_dir: Path | None) -> dict:
    """fingerprint -> sha256 of the normalized sm_90a PTX and the target options."""
    out = {}
    for i, (fp, (kernel, types)) in enumerate(kernels.items(), 1):
        t = time.perf_counter()
        ptx = normalized_ptx(_Kernel(kernel.py_func, types, **kernel.targetoptions).inspect_asm(None))
        text = f"// target options {_options(kernel)}\n{ptx}"
        out[fp] = hashlib.sha256(text.encode()).hexdigest()
        if ptx_dir is not None:
            (ptx_dir / f"{out[fp][:16]}.ptx").write_text(text)
        print(f"[{i}/{len(kernels)}] {fp[1]} {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return out


def snapshot(recorder: Recorder, hashes: dict) -> dict:
    """``{"model/case description": sha256}``; a description shared by different kernels in one case gets
    ``#2``, ``#3`` ... in launch order."""
    result, seen = {}, {}
    for case, desc, fp in recorder.launches:
        variants = seen.setdefault((case, desc), [])
        if fp not in variants:
            variants.append(fp)
            suffix = f" #{len(variants)}" if len(variants) > 1 else ""
            result[f"{case} {desc}{suffix}"] = hashes[fp]
    return dict(sorted(result.items()))


def diff(a_path, b_path) -> int:
    """Print the keys only in A, only in B, and those whose hash differs; 1 if any differs or is missing."""
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    removed, added = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    for title, keys in (("removed", removed), ("added", added), ("changed", changed)):
        for k in keys:
            print(f"{title}: {k}")
    same = len(a.keys() & b.keys()) - len(changed)
    print(f"{same} same, {len(changed)} changed, {len(removed)} removed, {len(added)} added")
    return 1 if changed or removed or added else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the JSON snapshot here (default: stdout)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help="comma-separated decodeB, prefillT, scoreT (default: %(default)s); 'all': every step shape "
                        "the engine captures or runs (decode1..64, the prefill buckets and 2048, score1..16)")
    p.add_argument("--ptx-dir", help="also write each normalized PTX here, named by its hash's first 16 digits")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two snapshots; exit 1 if they differ")
    args = p.parse_args(argv)
    if args.diff:
        return diff(*args.diff)
    models = args.models.split(",")
    cases = every_engine_case() if args.cases == "all" else args.cases.split(",")
    if any(m not in MODELS for m in models):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    try:
        [case_shape(c) for c in cases]
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    recorder = Recorder()
    record(models, cases, recorder)
    t_record = time.perf_counter() - t0
    ptx_dir = Path(args.ptx_dir) if args.ptx_dir else None
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
    snap = snapshot(recorder, compile_all(recorder.kernels, ptx_dir))
    text = json.dumps(snap, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    print(f"pegainfer from {Path(pegainfer.__file__).parent.parent}: {len(recorder.launches)} launches, "
          f"{len(snap)} distinct launches, {len(recorder.kernels)} distinct kernels, "
          f"{time.perf_counter() - t0:.0f} s ({t_record:.0f} s recording)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
