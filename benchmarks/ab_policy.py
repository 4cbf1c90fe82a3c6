"""Which launch policy makes a decode step faster on this GPU?  Compares variants of the engine's
``LaunchPolicy`` (``pegainfer/kernels/policy.py``), alternating them on one machine: a GPU's bandwidth drifts between
runs and machines by more than most changes worth trying, so two variants compare only within one run.

A variant is ``LABEL:FIELD=VALUE[,FIELD=VALUE...]``, the default policy with those fields replaced
(``dataclasses.replace``); a bare ``LABEL`` is the default policy itself:

    pdl=none | all | default | NAME[+NAME...] | default+NAME | default-NAME   (launch names that may overlap)
    preload_o=true|false   head_argmax=true|false   gemm_norm_prologue=true|false   timeline=true|false
    tuning=FILE (the JSON that ``bench_gemv.py --cold --tuning-out`` writes) | tuning=none

Modes:

* ``graph`` (default): one engine; each variant's decode graph (batch 1, or ``--batch B``) is captured while the
  model holds that variant's policy, then every round replays every variant's graph ``--replays`` times between
  two CUDA events, in an order rotated each round.  A token costs what its decode graph replayed back to back costs
  (``step_profile.py gaps``), so the replay time is the figure compared.  Dozens of variants in minutes.
* ``bench``: ``python -m pegainfer bench`` in a fresh process per variant and round, alternating: TTFT and TPOT
  as a user sees them (~40 s a run).  Arguments after ``--`` go to ``bench``.

    python benchmarks/ab_policy.py --model-path DIR --rounds 8 --variant base \\
        --variant nopdl:pdl=none --variant nopre:preload_o=false --variant geo:tuning=tuned.json
    python benchmarks/ab_policy.py --mode bench --model-path DIR --rounds 2 --variant base \\
        --variant nohead:head_argmax=false -- --prompt-len 16 --output-len 64 --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)

from pegainfer.kernels.policy_text import (PolicyTextError, parse_fields, policy_fields,  # noqa: E402,F401
                                           policy_with)

DEFAULT_BENCH_ARGS = ["--max-model-len", "4096", "--prompt-len", "16", "--output-len", "64", "--runs", "3"]
LABEL = re.compile(r"[\w.+-]+$")

VariantError = PolicyTextError
"""A ``--variant`` that does not parse (the message is one line, naming the problem)."""


def parse_variant(spec: str) -> tuple[str, dict]:
    """``LABEL[:FIELD=VALUE,...]`` → ``(label, {field: value})``; raises ``VariantError``."""
    label, _, fields = spec.partition(":")
    label = label.strip()
    if not LABEL.match(label):
        raise VariantError(f"--variant {spec!r}: expected LABEL or LABEL:FIELD=VALUE[,FIELD=VALUE...]")
    try:
        return label, parse_fields(fields)
    except VariantError as e:
        raise VariantError(f"--variant {spec!r}: {e}") from None


def describe(fields: dict) -> str:
    """The changed fields as one short line (``-`` for none)."""
    from pegainfer.kernels.policy import PDL_DEFAULT

    def show(name, value):
        if name == "pdl":
            if value is None:
                return "pdl=all"
            added, dropped = sorted(value - PDL_DEFAULT), sorted(PDL_DEFAULT - value)
            return "pdl=" + ("none" if not value else "default" + "".join(f"+{n}" for n in added)
                             + "".join(f"-{n}" for n in dropped))
        if name == "tuning":
            return f"tuning={len(value)} entries"
        return f"{name}={value}"
    return ", ".join(show(k, v) for k, v in fields.items()) or "-"


# ------------------------------------------------------------------------------------------------ graph mode
def run_graphs(args, variants) -> dict:
    """Capture each variant's decode graph on one engine, replay them in rotated rounds; ``{label: [ms, ...]}``
    and ``{label: error}`` of variants that failed to capture."""
    from pegainfer.kernels.policy import LaunchPolicy
    engine = graph_timing.warmed_engine(args.model_path, args.max_model_len, args.prompt_len, args.output_len,
                                        policy=LaunchPolicy(), batch=args.batch)
    base = engine.model.policy
    execs, failed = {}, {}
    policies = []
    for label, fields in variants:
        try:
            policies.append(policy_with(base, fields))
        except Exception:               # reported below, where the variant is captured
            pass
    graph_timing.fit_linear_workspace(engine, policies + [base])
    for label, fields in variants:
        try:
            policy = policy_with(base, fields)
            if policy.timeline:
                _timeline_buffer()
            execs[label] = graph_timing.capture_decode_graph(engine, policy, args.batch)
        except Exception as e:          # a variant that does not compile or launch: report it, time the others
            failed[label] = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"{label}: failed: {failed[label]}", flush=True)
    graph_timing.capture_decode_graph(engine, batch=args.batch)   # the engine's own graph back
    labels = list(execs)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for rnd in range(args.rounds):
        k = rnd % max(1, len(labels))
        for label in labels[k:] + labels[:k]:
            times[label].append(graph_timing.replay_graph_ms(engine.runner, execs[label], args.replays, warmup=2))
    return {"ms": times, "failed": failed}


def _timeline_buffer() -> None:
    """Allocate the timeline's record buffer before a capture (it cannot be allocated inside one)."""
    from pegainfer.kernels import timeline
    timeline.buffer()


# ------------------------------------------------------------------------------------------------ bench mode
def run_bench_variant(spec: str, bench_args: list[str], timeout: float) -> dict:
    """One ``pegainfer bench`` run under the policy of variant ``spec``, in a fresh interpreter; its JSON results
    (raises RuntimeError with the child's last lines on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        r = subprocess.run([sys.executable, __file__, "--bench-child", spec, "--", *bench_args, "--json", out],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"exit {r.returncode}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def bench_child(spec: str, bench_args: list[str]) -> int:
    """The child of ``run_bench_variant``: ``pegainfer bench`` with the variant's policy."""
    from pegainfer.__main__ import build_parser
    from pegainfer.bench import run_bench
    from pegainfer.errors import PegainferError
    from pegainfer.kernels.policy import LaunchPolicy
    _, fields = parse_variant(spec)
    args = build_parser().parse_args(["bench", *bench_args])
    try:
        return run_bench(args, policy=policy_with(LaunchPolicy(), fields)) or 0
    except PegainferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_benches(args, variants, specs, bench_args) -> list[dict]:
    """Each variant's ``pegainfer bench`` per round: TTFT and TPOT p50, or with ``--batch`` the decode step's p50
    (in the ``tpot_ms`` column: a step of the batch; no TTFT)."""
    rows = []
    print(f"{'variant':16s} {'round':>5s} {'ttft_ms':>9s} {'tpot_ms':>9s} {'floor %':>8s}", flush=True)
    for rnd in range(1, args.rounds + 1):
        for (label, _), spec in zip(variants, specs):
            res = run_bench_variant(spec, bench_args, args.timeout)
            ttft = res["ttft_ms"]["p50"] if "ttft_ms" in res else None
            step = res["tpot_ms"]["p50"] if "tpot_ms" in res else res["step_ms"]["p50"]
            row = {"variant": label, "round": rnd, "ttft_ms": ttft, "tpot_ms": step,
                   "floor_ratio": res.get("floor_ratio"), "bench": res}
            rows.append(row)
            floor = f"{100 * row['floor_ratio']:8.1f}" if row["floor_ratio"] else f"{'-':>8s}"
            ttft_text = f"{ttft:9.3f}" if ttft is not None else f"{'-':>9s}"
            print(f"{label[:16]:16s} {rnd:5d} {ttft_text} {step:9.3f} {floor}", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ the command
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model folder (bench mode: default the demo model)")
    ap.add_argument("--mode", choices=("graph", "bench"), default="graph",
                    help="graph: decode-graph replays on one engine (default); bench: pegainfer bench per run")
    ap.add_argument("--variant", action="append", metavar="LABEL[:FIELD=VALUE,...]",
                    help="a policy variant (repeat; the first is the reference)")
    ap.add_argument("--batch", type=int, default=1,
                    help="graph mode: time the decode graph of this many sequences (default 1), after --output-len "
                         "steps of the batch from --prompt-len-token prompts")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: 8 graph, 2 bench)")
    ap.add_argument("--replays", type=int, default=64, help="graph mode: replays timed per variant and round")
    ap.add_argument("--max-model-len", type=int, default=4096, help="graph mode (default 4096)")
    ap.add_argument("--prompt-len", type=int, default=16, help="graph mode: prompt before capture (default 16)")
    ap.add_argument("--output-len", type=int, default=64,
                    help="graph mode: tokens generated before capture, which sets the context (default 64)")
    ap.add_argument("--timeout", type=float, default=300, help="bench mode: seconds per run (default 300)")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--bench-child", default=None, help=argparse.SUPPRESS)   # internal: one bench run
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.bench_child is not None:
            return bench_child(args.bench_child, extra)
        if not args.variant:
            raise VariantError("give at least one --variant (e.g. --variant base --variant nopdl:pdl=none)")
        variants = [parse_variant(v) for v in args.variant]
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len({label for label, _ in variants}) != len(variants):
        print("error: two --variant share a label; give each its own", file=sys.stderr)
        return 2
    args.rounds = args.rounds or (8 if args.mode == "graph" else 2)

    if args.mode == "graph":
        if not args.model_path:
            print("error: graph mode needs --model-path", file=sys.stderr)
            return 2
        graph_timing.require_gpu("ab_policy.py --mode graph")
        res = run_graphs(args, variants)
        print(f"\n{'variant':20s} {'median ms':>10s} {'min ms':>9s} {'max ms':>9s} {'vs first':>9s}  policy")
        rows, ref = [], None
        for label, fields in variants:
            ms = res["ms"].get(label)
            if not ms:
                continue
            med = statistics.median(ms)
            ref = med if ref is None else ref
            rows.append({"label": label, "policy": describe(fields), "median_ms": med, "min_ms": min(ms),
                         "max_ms": max(ms), "change": med / ref - 1.0, "rounds_ms": ms})
            print(f"{label[:20]:20s} {med:10.4f} {min(ms):9.4f} {max(ms):9.4f} {100 * (med / ref - 1):+8.2f}%  "
                  f"{describe(fields)}", flush=True)
        out = {"mode": "graph", "variants": rows, "failed": res["failed"],
               "args": {k: v for k, v in vars(args).items() if k != "bench_child"}}
    else:
        bench_args = (extra or DEFAULT_BENCH_ARGS) + (["--model-path", args.model_path] if args.model_path else [])
        try:
            rows = run_benches(args, variants, args.variant, bench_args)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"error: a bench run failed: {e}", file=sys.stderr)
            return 1
        print(f"\n{'variant':16s} {'ttft_ms':>9s} {'tpot_ms':>9s} {'tpot vs first':>14s}   (medians over rounds)")
        base = None
        for label, fields in variants:
            mine = [r for r in rows if r["variant"] == label]
            ttfts = [r["ttft_ms"] for r in mine if r["ttft_ms"] is not None]
            ttft = statistics.median(ttfts) if ttfts else float("nan")
            tpot = statistics.median(r["tpot_ms"] for r in mine)
            base = tpot if base is None else base
            print(f"{label[:16]:16s} {ttft:9.3f} {tpot:9.3f} {100 * (tpot / base - 1):+13.2f}%   {describe(fields)}")
        out = {"mode": "bench", "bench_args": bench_args,
               "variants": {label: describe(fields) for label, fields in variants}, "runs": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
