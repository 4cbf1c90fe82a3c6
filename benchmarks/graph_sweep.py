"""Many launch-time variants timed on one engine: each variant's batch-1 decode graph is captured once, then all of
them are replayed in interleaved rounds.

``ab_bench.py`` starts a fresh process per variant and round (~40 s each: weights, kernels, graphs), which is what
a change to the engine's code needs.  A variant that changes only how the step's kernels are launched -- a GEMV
geometry in ``linear.GEMV_TUNED``, a PDL trigger, a knob that a kernel builder takes as an argument -- needs none
of that: patch it, capture the decode graph again, keep the instantiated graph.  A token costs what its decode
graph replayed back to back costs (``step_gap.py``: TPOT 2.518 ms, graph 2.521 ms on Qwen3.5-4B), so the graph's
replay time is the figure compared.  Every round replays every variant's graph (``--replays`` launches between two
CUDA events, after two unmeasured ones), in an order rotated each round, so drift of the GPU's clocks spreads over
all variants alike.

Replays reuse the last step's inputs: the same position, the sampled id fed back as the next input, a recurrent
state that keeps evolving. Timing does not depend on those values.  A variant is ``LABEL=STATEMENTS`` as in
``ab_bench.py``; every module-level name of ``pegainfer``'s modules is put back before the next variant's statements
run (upper-case tables such as ``linear.GEMV_TUNED`` by their contents, everything else -- settings, a patched
function -- by rebinding), so variants do not add up.  Confirm a winner with ``ab_bench.py``, whose TPOT is the
engine's own.

Usage (GPU):
    python benchmarks/graph_sweep.py --model-path DIR --rounds 8 --variant base= \\
        --variant 'gu_r4s4=import pegainfer.kernels.linear as l; l.GEMV_TUNED[18432, 2560, 1, True] = l._tuned_t1(4, 8, 1, 4)'
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))   # (after PYTHONPATH: A/B against another tree)
sys.path.append(str(Path(__file__).resolve().parent))


def settings_snapshot() -> list[tuple[object, str, object, object]]:
    """(module, name, value, contents) of every module-level name of the loaded ``pegainfer`` modules; ``contents``
    is a copy of an upper-case dict (a table such as ``GEMV_TUNED``, patched in place by variants), else None."""
    out = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("pegainfer") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            contents = copy.copy(val) if attr.isupper() and isinstance(val, dict) else None
            out.append((mod, attr, val, contents))
    return out


def restore(snapshot) -> None:
    for mod, attr, val, contents in snapshot:
        if getattr(mod, attr, None) is not val:
            setattr(mod, attr, val)
        if contents is not None and val != contents:
            val.clear()
            val.update(contents)


def warmed_engine(args, tool: str):
    """A batch-1 engine on ``args.model_path`` that has generated ``args.output_len`` tokens after a random
    ``args.prompt_len``-token prompt (kernels compiled, decode graph captured, context at that length); None in the
    simulator, which has no CUDA graphs (``tool`` names the script in the message)."""
    import numpy as np

    from pegainfer.bench import time_generation
    from pegainfer.device import SIMULATOR
    from pegainfer.engine.engine import Engine
    if SIMULATOR:
        print(f"{tool} needs a GPU (the simulator has no CUDA graphs)")
        return None
    engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=1)
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    time_generation(engine, rng.integers(0, vocab, size=args.prompt_len).tolist(), args.output_len)
    engine.runner.stream.synchronize()
    return engine


def main(argv=None) -> int:
    from ab_bench import parse_variant

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated before capture (context length)")
    ap.add_argument("--variant", action="append", required=True, metavar="LABEL=STATEMENTS")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--replays", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({label for label, _ in variants}) != len(variants):
        raise SystemExit("error: two --variant share a label; give each its own")

    from cuda.bindings import driver as drv
    from numba import cuda

    engine = warmed_engine(args, "graph_sweep")
    if engine is None:
        return 0
    runner = engine.runner

    import pegainfer.kernels  # noqa: F401  (every kernel module loaded before the snapshot)
    snapshot = settings_snapshot()
    execs, failed = {}, {}
    for label, code in variants:
        restore(snapshot)
        try:
            exec(compile(code, f"<variant {label}>", "exec"), {"__name__": "variant"})
            runner.graphs.capture(1, 1, decode=True)
            runner.stream.synchronize()
            execs[label] = runner.graphs.execs[(1, 1)]
        except Exception as e:          # a variant that does not compile or launch: report it, time the others
            failed[label] = f"{type(e).__name__}: {e}"
            print(f"{label}: failed: {failed[label]}", flush=True)
    restore(snapshot)
    runner.graphs.capture(1, 1, decode=True)    # the engine's own graph back
    runner.stream.synchronize()

    stream = drv.CUstream(int(runner.stream.handle))
    labels = list(execs)
    times: dict[str, list[float]] = {label: [] for label in labels}
    start, end = cuda.event(), cuda.event()
    for rnd in range(args.rounds):
        k = rnd % len(labels)
        for label in labels[k:] + labels[:k]:
            for _ in range(2):
                drv.cuGraphLaunch(execs[label], stream)
            start.record(runner.stream)
            for _ in range(args.replays):
                drv.cuGraphLaunch(execs[label], stream)
            end.record(runner.stream)
            end.synchronize()
            times[label].append(cuda.event_elapsed_time(start, end) / args.replays)

    ref = statistics.median(times[labels[0]]) if labels else 0.0
    print(f"\n{'variant':24s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'vs ' + labels[0]:>10s}")
    rows = []
    for label in labels:
        med = statistics.median(times[label])
        rows.append({"label": label, "median_ms": med, "min_ms": min(times[label]), "max_ms": max(times[label]),
                     "change": med / ref - 1.0, "rounds_ms": times[label]})
        print(f"{label:24s} {med:10.4f} {min(times[label]):9.4f} {max(times[label]):9.4f} "
              f"{100 * (med / ref - 1):+9.2f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": rows, "failed": failed, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
