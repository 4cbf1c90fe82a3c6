"""A/B timing of code variants: ``python -m pegainfer bench`` once per variant and round, alternating.

A lent GPU's bandwidth drifts between runs and differs between machines by a few percent, more than most changes
worth trying, so two variants compare only when their runs alternate on the same machine in one call.  A variant
is a label and a few Python statements run in a fresh interpreter before the engine is built -- typically a patch
of a module attribute -- so no experiment needs a knob in the engine's code:

    python benchmarks/ab_bench.py --model-path /tmp/models/qwen3-4b --rounds 2 \\
        --variant base= \\
        --variant 'late=import pegainfer.kernels.linear as l; l.GEMV_TRIGGER = "last_stream"'

Prints one row per run (TTFT / TPOT p50 and the floor ratio of ``bench``) and, per variant, the median over its
rounds and its difference to the first variant; ``--json`` writes every run.  Arguments after ``--`` go to
``bench`` as they are (default: ``--max-model-len 4096 --prompt-len 16 --output-len 64 --runs 3``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT_BENCH_ARGS = ["--max-model-len", "4096", "--prompt-len", "16", "--output-len", "64", "--runs", "3"]

CHILD = """
import sys
exec(compile(sys.argv[1], "<variant>", "exec"), {"__name__": "variant"})
sys.argv = ["pegainfer", "bench", *sys.argv[2:]]
from pegainfer.__main__ import main
sys.exit(main())
"""


def parse_variant(spec: str) -> tuple[str, str]:
    label, sep, code = spec.partition("=")
    if not sep or not label.strip():
        raise SystemExit(f"error: --variant {spec!r}: expected LABEL=STATEMENTS (LABEL= for the code as it is)")
    return label.strip(), code


def run_variant(code: str, bench_args: list[str], timeout: float) -> dict:
    """One ``bench`` run after ``code``; its JSON results (raises with the child's last lines on failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        r = subprocess.run([sys.executable, "-c", CHILD, code, *bench_args, "--json", out], capture_output=True,
                           text=True, timeout=timeout)
        if r.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"exit {r.returncode}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model folder (default: bench's built-in demo model)")
    ap.add_argument("--variant", action="append", required=True, metavar="LABEL=STATEMENTS",
                    help="a variant: Python statements run before the engine is built (repeat; LABEL= for none)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant, alternating (default 2)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    ap.add_argument("--json", default=None, help="write every run's results here")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({label for label, _ in variants}) != len(variants):
        raise SystemExit("error: two --variant share a label; give each its own")
    bench_args = (extra or DEFAULT_BENCH_ARGS) + (["--model-path", args.model_path] if args.model_path else [])

    rows = []
    print(f"{'variant':16s} {'round':>5s} {'ttft_ms':>9s} {'tpot_ms':>9s} {'floor %':>8s}", flush=True)
    for rnd in range(1, args.rounds + 1):
        for label, code in variants:
            try:
                res = run_variant(code, bench_args, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"error: variant {label!r}, round {rnd}: {e}", file=sys.stderr)
                return 1
            row = {"variant": label, "round": rnd, "ttft_ms": res["ttft_ms"]["p50"], "tpot_ms": res["tpot_ms"]["p50"],
                   "floor_ratio": res.get("floor_ratio"), "bench": res}
            rows.append(row)
            floor = f"{100 * row['floor_ratio']:8.1f}" if row["floor_ratio"] else f"{'-':>8s}"
            print(f"{label[:16]:16s} {rnd:5d} {row['ttft_ms']:9.3f} {row['tpot_ms']:9.3f} {floor}", flush=True)

    print(f"\n{'variant':16s} {'ttft_ms':>9s} {'tpot_ms':>9s} {'tpot vs first':>14s}   (medians over rounds)")
    base = None
    for label, _ in variants:
        mine = [r for r in rows if r["variant"] == label]
        ttft = statistics.median(r["ttft_ms"] for r in mine)
        tpot = statistics.median(r["tpot_ms"] for r in mine)
        base = tpot if base is None else base
        print(f"{label[:16]:16s} {ttft:9.3f} {tpot:9.3f} {100 * (tpot / base - 1):+13.2f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench_args": bench_args, "variants": dict(variants), "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
