"""Where does a decode step's time go (one sequence, or a batch: ``--batch`` of ``kernels`` and ``ablation``)?  Five
views of the same step:

  timeline  block by block inside the CUDA graph: the decode kernels built with ``%globaltimer`` stamps
            (``LaunchPolicy.timeline``), per kernel its wall, the PDL handoff, how long its blocks ran before their
            wait, its prologue and its tail; ``--save`` keeps the raw records, ``--load`` prints them (no GPU)
  ablation  the step's graph time with whole kernel families replaced by nothing: what each family costs inside
            the graph, kernel and boundary together
  gaps      a token's time (TPOT, async scheduling) against its decode graph replayed back to back: what the copies
            and host work between two graphs cost
  kernels   every kernel of the replayed graph from the CUDA profiling interface (CUPTI through torch.profiler;
            torch only traces, it runs nothing): per family how long it runs and how far it moves the step's end
  trace     a Chrome trace written with ``--trace-output-path``: GPU time per kernel of the traced eager steps (no
            GPU needed)

    python benchmarks/step_profile.py timeline --model-path DIR [--output-len 64] [--save t.npy] [--policy pdl=none]
    python benchmarks/step_profile.py timeline --load t.npy
    python benchmarks/step_profile.py ablation --model-path DIR [--context 128] [--batch 64]
    python benchmarks/step_profile.py gaps --model-path DIR [--runs 3]
    python benchmarks/step_profile.py kernels --model-path DIR [--context 128] [--batch 64] [--steps 20] [--trace out.json]
    python benchmarks/step_profile.py trace TRACE.json [...]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)

import numpy as np  # noqa: E402

QUESTIONS = {
    "timeline": "Where does the time between a decode step's kernels go, block by block, inside the CUDA graph?",
    "ablation": "What does each kernel family cost inside the decode step's CUDA graph?",
    "gaps": "How much of a decode token's time is spent outside its CUDA graph?",
    "kernels": "How long does each kernel of the decode step run inside the CUDA graph, and how far does it move "
               "the step's end?",
    "trace": "How much GPU time does each kernel take in the eager steps of a Chrome trace?",
}


def _dump(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=float)


# ================================================================================================ timeline
def timeline_module():
    """The stamping module (``pegainfer.kernels.timeline``: ``buffer``, ``reset``, ``records``, ``KINDS``)."""
    from pegainfer.kernels import timeline
    return timeline


def stamped(policy):
    """``policy`` with the decode kernels built to stamp their blocks."""
    import dataclasses
    return dataclasses.replace(policy, timeline=True)


def launches(rec: np.ndarray) -> list[np.ndarray]:
    """The records grouped into launches (same kind, output size and grid; blocks of one launch are ``grid``
    consecutive records in entry order), in completion order (each kernel waits for the one before)."""
    groups = defaultdict(list)
    for r in np.sort(rec, order="t_entry"):
        groups[int(r["kind"]), int(r["extra"]), int(r["grid"])].append(r)
    out = []
    for (_, _, grid), rows in groups.items():
        for i in range(0, len(rows) - grid + 1, grid):
            out.append(np.array(rows[i:i + grid], dtype=rec.dtype))
    out.sort(key=lambda blocks: int(blocks["t_end"].max()))
    return out


def label(blocks: np.ndarray) -> str:
    kinds = timeline_module().KINDS
    kind, extra = kinds.get(int(blocks["kind"][0]), f"kind{int(blocks['kind'][0])}"), int(blocks["extra"][0])
    return f"{kind}[{extra}]x{int(blocks['grid'][0])}" if extra else f"{kind}x{int(blocks['grid'][0])}"


def _waited(blocks):
    waited = blocks[blocks["t_wait"] > 0]       # (a decode attention block without work never waits)
    return waited if len(waited) else blocks


def summarize(rec: np.ndarray) -> list[dict]:
    """Per launch (µs): ``wall`` (its last block's end minus the previous launch's), ``wait`` (its first wait
    return after the previous launch's end), ``early`` (median time its blocks ran before their wait),
    ``prologue`` (median wait → inputs staged) and ``tail`` (last minus median block end)."""
    rows, prev_end = [], None
    for blocks in launches(rec):
        end = int(blocks["t_end"].max())
        waited = _waited(blocks)
        first_wait = int(waited["t_wait"].min())
        rows.append({"label": label(blocks), "end": end,
                     "early": float(np.median(waited["t_wait"] - waited["t_entry"])) / 1e3,
                     "prologue": float(np.median(waited["t_ready"] - waited["t_wait"])) / 1e3,
                     "tail": (end - float(np.median(blocks["t_end"]))) / 1e3,
                     "wall": None if prev_end is None else (end - prev_end) / 1e3,
                     "wait": None if prev_end is None else (first_wait - prev_end) / 1e3})
        prev_end = end
    return rows


def moments(rec: np.ndarray) -> dict[str, dict[str, float]]:
    """Per kernel label, medians over its launches of its moments (µs) after the previous launch's last block end:
    ``enter``, ``enter_last``, ``wait`` (first wait return), ``ready`` (median block), ``end_first``, ``end``
    (median block), ``end_last``.  (Differences are taken in integer nanoseconds before any float arithmetic.)"""
    per = defaultdict(lambda: defaultdict(list))
    order = []
    blocks_list = launches(rec)
    for prev, blocks in zip(blocks_list, blocks_list[1:]):
        lab = label(blocks)
        if lab not in per:
            order.append(lab)
        t0 = int(prev["t_end"].max())
        rel = lambda a: (np.asarray(a, np.int64) - t0) / 1e3  # noqa: E731
        waited = _waited(blocks)
        m = per[lab]
        m["enter"].append(rel(blocks["t_entry"].min()))
        m["enter_last"].append(rel(blocks["t_entry"].max()))
        m["wait"].append(rel(waited["t_wait"].min()))
        m["ready"].append(float(np.median(rel(waited["t_ready"]))))
        m["end_first"].append(rel(blocks["t_end"].min()))
        m["end"].append(float(np.median(rel(blocks["t_end"]))))
        m["end_last"].append(rel(blocks["t_end"].max()))
    return {lab: {k: float(np.median(v)) for k, v in per[lab].items()} for lab in order}


def report_timeline(rows: list[dict]) -> None:
    by, order = defaultdict(list), []
    for r in rows:
        if r["label"] not in by:
            order.append(r["label"])
        by[r["label"]].append(r)
    print(f"{'kernel':40s} {'n':>3s} {'wall µs':>8s} {'wait':>6s} {'early':>6s} {'prologue':>8s} {'tail':>6s}")
    total = 0.0
    for lab in order:
        rs = by[lab]
        med = lambda key: statistics.median([r[key] for r in rs if r[key] is not None] or [float("nan")])  # noqa
        total += sum(r["wall"] for r in rs if r["wall"] is not None)
        print(f"{lab:40s} {len(rs):3d} {med('wall'):8.2f} {med('wait'):6.2f} {med('early'):6.2f} "
              f"{med('prologue'):8.2f} {med('tail'):6.2f}")
    print(f"sum of walls (first kernel's excluded): {total:.1f} µs")


def report_moments(table: dict[str, dict[str, float]]) -> None:
    keys = ("enter", "enter_last", "wait", "ready", "end_first", "end", "end_last")
    print(f"\n{'µs after the previous kernel ended':40s} " + " ".join(f"{k:>10s}" for k in keys))
    for lab, m in table.items():
        print(f"{lab:40s} " + " ".join(f"{m[k]:10.2f}" for k in keys))


def cmd_timeline(args) -> int:
    if args.load:
        rec = np.load(args.load)
        report_timeline(summarize(rec))
        report_moments(moments(rec))
        return 0
    if not args.model_path:
        print("error: timeline needs --model-path (or --load FILE.npy)", file=sys.stderr)
        return 2
    graph_timing.require_gpu("step_profile.py timeline")
    from ab_policy import parse_fields, policy_with
    from pegainfer.kernels.policy import LaunchPolicy
    policy = policy_with(LaunchPolicy(), parse_fields(args.policy))
    engine = graph_timing.warmed_engine(args.model_path, args.max_model_len, args.prompt_len, args.output_len,
                                        policy=policy)
    runner, timeline = engine.runner, timeline_module()
    plain = graph_timing.replay_graph_ms(runner, runner.graphs.execs[(1, 1)], args.replays)
    timeline.buffer()                   # allocated outside the capture
    exe = graph_timing.capture_decode_graph(engine, stamped(engine.model.policy))
    with_stamps = graph_timing.replay_graph_ms(runner, exe, args.replays)
    timeline.reset()
    graph_timing.replay_graph_ms(runner, exe, 1)
    rec = timeline.records()
    graph_timing.capture_decode_graph(engine)
    print(f"decode graph: {plain:.4f} ms plain, {with_stamps:.4f} ms stamped; {len(rec)} block records")
    ticks = np.diff(np.unique(np.concatenate([rec["t_entry"], rec["t_end"]])))
    print(f"globaltimer: smallest step between distinct stamps {int(ticks.min()) if len(ticks) else 0} ns")
    if len(rec):
        print(f"first block entry to last block end: {(int(rec['t_end'].max()) - int(rec['t_entry'].min())) / 1e3:.1f} µs")
    rows = summarize(rec)
    report_timeline(rows)
    report_moments(moments(rec))
    if args.save:
        np.save(args.save, rec)
        print(f"records saved to {args.save}")
    _dump(args.json, {"plain_ms": plain, "stamped_ms": with_stamps, "launches": rows, "moments": moments(rec)})
    return 0


# ================================================================================================ ablation
def ablation_families():
    """``{family: (module, name)}`` of the launch wrappers the ablation replaces; the models and the runner call
    them through these modules, so a replaced wrapper launches nothing."""
    from pegainfer.kernels import attention, gated_delta, rope, sampling
    return {"qk_norm_rope": (rope, "qk_norm_rope_store"), "attention": (attention, "paged_attention"),
            "gated_delta_step": (gated_delta, "gated_delta_decode_step"), "sampling": (sampling, "sample")}


@contextlib.contextmanager
def without(families: dict, names):
    """The named families' launch wrappers replaced by no-ops while the block runs (timing only: their outputs go
    stale, which does not change the time of what remains)."""
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in (families[n] for n in names)]
    try:
        for mod, attr, _ in saved:
            setattr(mod, attr, lambda *a, **k: None)
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def cmd_ablation(args) -> int:
    graph_timing.require_gpu("step_profile.py ablation")
    from pegainfer.kernels.launch import on_stream
    from pegainfer.kernels.memory import measure_read_bandwidth
    engine, step = graph_timing.last_decode_step(args.model_path, args.context, args.batch)
    families = ablation_families()
    bound = ("qk_norm_rope", "attention") + (("gated_delta_step",) if engine.model_config.arch == "qwen3_5" else ())
    variants = [("full step", ())] + [(f"- {n}", (n,)) for n in bound] + [
        ("- " + " - ".join(bound), bound), ("projections + norms only", bound + ("sampling",))]
    res = {}
    with on_stream(engine.runner.stream):
        for name, dropped in variants:
            with without(families, dropped):
                res[name] = 1e3 * graph_timing.time_calls([step] * 20, reps=5)
    full, wb, bw = res["full step"], engine.model.weight_bytes(), measure_read_bandwidth()
    print(f"\n{engine.model_name}: batch {args.batch}, context {args.context}, weight bytes {wb / 1e9:.3f} GB, read "
          f"bw {bw / 1e9:.0f} GB/s, weights' floor {1e3 * wb / bw:.3f} ms")
    print(f"{'variant':40s} {'ms/step':>9s} {'saved':>8s}")
    for name, ms in res.items():
        print(f"{name:40s} {ms:9.3f} {full - ms:8.3f}")
    _dump(args.json, dict(model=engine.model_name, batch=args.batch, context=args.context, weight_bytes=wb,
                          read_bw=bw, ms=res))
    return 0


# ================================================================================================ gaps
def cmd_gaps(args) -> int:
    graph_timing.require_gpu("step_profile.py gaps")
    from pegainfer.bench import time_generation
    engine = graph_timing.warmed_engine(args.model_path, args.max_model_len, args.prompt_len, 2)
    rng = np.random.default_rng(1)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    runner, rows = engine.runner, []
    for run in range(args.runs + 1):
        _, gaps = time_generation(engine, rng.integers(0, vocab, size=args.prompt_len).tolist(), args.output_len)
        graph_ms = graph_timing.replay_graph_ms(runner, runner.graphs.execs[(1, 1)], args.replays)
        if run > 0:     # run 0 warms up
            tpot = 1e3 * statistics.median(gaps)
            rows.append({"tpot_ms": tpot, "graph_ms": graph_ms, "gap_us": 1e3 * (tpot - graph_ms)})
    print(f"{'run':>4} {'tpot ms':>9} {'graph ms':>9} {'gap µs':>8}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['tpot_ms']:>9.4f} {r['graph_ms']:>9.4f} {r['gap_us']:>8.1f}")
    _dump(args.json, rows)
    return 0


# ================================================================================================ kernels
def short_name(name: str) -> str:
    """The Python function name of a numba kernel as the profiler shows it, demangled
    (``pegainfer::kernels::linear::_gemv_decode_kernel::_3clocals_3e::gemv_decode[abi:..](Array<..>, ..)`` ->
    ``gemv_decode``) or mangled (``_ZN6cudapy9pegainfer..11gemv_decode..``)."""
    if name.startswith("_ZN"):
        parts, i = [], 3
        while (m := re.match(r"(\d+)", name[i:])):
            n = int(m.group(1))
            i += len(m.group(1))
            parts.append(name[i:i + n])
            i += n
    else:
        parts = name.split("(")[0].split("[")[0].split("::")
    names = [p for p in parts if p and not p.startswith("_3c")]
    return names[-1] if names else name[-48:]


def kernel_events(trace: dict) -> list[tuple[str, float, float]]:
    """(short name + grid x block, start µs, end µs) of every GPU kernel of a profiler Chrome trace, in start
    order."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        geo = f" {a['grid'][0]}x{a['block'][0]}" if "grid" in a and "block" in a else ""
        out.append((short_name(e["name"]) + geo, float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    out.sort(key=lambda r: r[1])
    return out


def attribute(kernels):
    """Per kernel: (name, start, dur, gap before it, wall = end - previous end)."""
    rows, prev_end = [], None
    for name, s, e in kernels:
        gap = 0.0 if prev_end is None else s - prev_end
        wall = e - s if prev_end is None else e - prev_end
        rows.append((name, s, e - s, gap, wall))
        prev_end = e if prev_end is None else max(prev_end, e)
    return rows


def cmd_kernels(args) -> int:
    graph_timing.require_gpu("step_profile.py kernels", "it reads the CUDA profiling interface's kernel records")
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from pegainfer.kernels.launch import on_stream
    engine, step = graph_timing.last_decode_step(args.model_path, args.context, args.batch)
    with on_stream(engine.runner.stream), graph_timing.captured([step] * args.steps) as replay:
        replay()
        replay()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
    path = args.trace or tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        kernels = kernel_events(json.load(f))
    if not kernels:
        print("error: no kernel events recorded (CUPTI unavailable?)", file=sys.stderr)
        return 1
    n, per_step = args.steps, len(kernels) // args.steps
    rows = attribute(kernels)
    total = (kernels[-1][2] - kernels[0][1]) / n
    fam = collections.OrderedDict()
    for name, _, dur, gap, wall in rows:
        f = fam.setdefault(name, [0, 0.0, 0.0, 0.0])
        f[0] += 1
        f[1] += dur
        f[2] += gap
        f[3] += wall
    print(f"\n{engine.model_name}: batch {args.batch}, context {args.context}, {per_step} kernels per step, "
          f"step {total:.1f} us "
          f"(graph of {n} steps, CUPTI)")
    print(f"{'kernel':34s} {'per step':>8s} {'dur us':>8s} {'gap us':>8s} {'wall us':>8s} {'wall/step':>10s}")
    for name, (c, d, g, w) in sorted(fam.items(), key=lambda kv: -kv[1][3]):
        print(f"{name[:34]:34s} {c / n:8.1f} {d / c:8.2f} {g / c:8.2f} {w / c:8.2f} {w / n:10.1f}")
    # two layers' worth of kernels, one by one, from the middle of the second profiled step
    step2 = rows[per_step:2 * per_step] if n > 1 else rows
    n_layers = int(getattr(engine.model, "L", 0) or 1)
    k = max(1, round(per_step / n_layers))
    li = args.layer if args.layer is not None else n_layers // 2
    lo = min(len(step2) - 1, 1 + li * k)
    print(f"\nstep 2, kernels {lo}..{lo + 2 * k - 1} (~layer {li}): start, dur, gap before, wall (us)")
    t0 = step2[lo][1]
    for name, s, dur, gap, wall in step2[lo:lo + 2 * k]:
        print(f"  {name[:34]:34s} {s - t0:8.2f} {dur:8.2f} {gap:8.2f} {wall:8.2f}")
    print("step 2, last kernels:")
    for name, s, dur, gap, wall in step2[-6:]:
        print(f"  {name[:34]:34s} {s - t0:8.2f} {dur:8.2f} {gap:8.2f} {wall:8.2f}")
    _dump(args.json, {"batch": args.batch, "context": args.context, "step_us": total, "per_step": per_step,
                      "families": {k: dict(zip(("launches", "dur_us", "gap_us", "wall_us"), v)) for k, v in fam.items()}})
    return 0


# ================================================================================================ trace
def trace_summary(events: list[dict]) -> dict:
    """Per ``step: kernel`` of the kernel tracks, ``[launches, GPU µs]``; per engine step kind, its durations."""
    per = defaultdict(lambda: [0, 0.0])
    steps = defaultdict(list)
    for e in events:
        track = str(e.get("tid", ""))
        if "kernels" in track:
            key = f'{e.get("args", {}).get("step", "")}: {e["name"]}'
            per[key][0] += 1
            per[key][1] += float(e.get("dur", 0.0))
        elif track == "engine steps":
            steps[str(e["name"]).split(" ")[0]].append(float(e.get("dur", 0.0)))
    return {"kernels": dict(per), "steps": dict(steps), "total_us": sum(v[1] for v in per.values())}


def cmd_trace(args) -> int:
    events = []
    for path in args.traces:
        try:
            with open(path) as f:
                events += json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {path}: not a Chrome trace ({type(e).__name__}: {e})".splitlines()[0], file=sys.stderr)
            return 2
    s = trace_summary(events)
    total = s["total_us"]
    print(f"{'step: kernel':<48}{'launches':>10}{'GPU us':>12}{'share':>8}")
    for name, (n, us) in sorted(s["kernels"].items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<48}{n:>10}{us:>12.1f}{100 * us / max(total, 1e-9):>7.1f}%")
    print(f"{'total (traced eager steps)':<48}{sum(v[0] for v in s['kernels'].values()):>10}{total:>12.1f}")
    for kind, durs in s["steps"].items():
        print(f"engine step {kind}: n={len(durs)} median {statistics.median(durs) / 1e3:.3f} ms")
    _dump(args.json, s)
    return 0


# ================================================================================================ the command
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", metavar="{timeline,ablation,gaps,kernels,trace}", required=True)

    def mode(name, engine=True):
        p = sub.add_parser(name, help=QUESTIONS[name], description=QUESTIONS[name])
        if engine:
            p.add_argument("--model-path", required=name != "timeline", help="model folder")
        p.add_argument("--json", default=None, help="write the results here")
        return p

    def context_args(p):
        p.add_argument("--max-model-len", type=int, default=4096)
        p.add_argument("--prompt-len", type=int, default=16)
        p.add_argument("--output-len", type=int, default=64,
                       help="tokens generated before the graph is timed (sets the context; default 64)")
        p.add_argument("--replays", type=int, default=64, help="graph replays timed (default 64)")

    p = mode("timeline")
    context_args(p)
    p.add_argument("--load", default=None, metavar="FILE.npy", help="print the tables of saved records (no GPU)")
    p.add_argument("--save", default=None, metavar="FILE.npy", help="keep the raw block records")
    p.add_argument("--policy", default="", metavar="FIELD=VALUE,...",
                   help="launch-policy fields to change first, as ab_policy.py's variants (e.g. pdl=none)")
    p = mode("ablation")
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache (default 128)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded in each step (default 1)")
    p = mode("gaps")
    context_args(p)
    p.add_argument("--runs", type=int, default=3, help="timed requests after one warm-up (default 3)")
    p = mode("kernels")
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache (default 128)")
    p.add_argument("--steps", type=int, default=20, help="decode steps in the profiled graph (default 20)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded in each step (default 1)")
    p.add_argument("--trace", default=None, help="also write the profiler's raw Chrome trace here")
    p.add_argument("--layer", type=int, default=None, help="print this layer's kernels one by one (default: middle)")
    p = mode("trace", engine=False)
    p.add_argument("traces", nargs="+", metavar="TRACE.json", help="Chrome trace(s) from --trace-output-path")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "timeline" and args.policy:
        from ab_policy import VariantError, parse_fields
        try:
            parse_fields(args.policy)
        except VariantError as e:
            print(f"error: --policy: {e}", file=sys.stderr)
            return 2
    return {"timeline": cmd_timeline, "ablation": cmd_ablation, "gaps": cmd_gaps, "kernels": cmd_kernels,
            "trace": cmd_trace}[args.mode](args)


if __name__ == "__main__":
    code = main()
    # torch's profiler (CUPTI) and numba both hold the CUDA context, and their teardown at interpreter exit has
    # aborted with "double free or corruption" after the tables were printed: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
