"""Where the time between a decode step's kernels goes, block by block, inside the CUDA graph.

Captures the batch-1 decode graph with ``pegainfer.kernels.timeline`` on (the GEMVs, qk-norm/RoPE, decode
attention and the Gated DeltaNet step append one record per block: entry, PDL wait returned, inputs staged, end,
SM), replays it, and prints
per kernel of the step, medians over the layers:

  wall     its last block's end minus the previous kernel's last block's end (sums to the step)
  wait     its first block's wait return minus the previous kernel's last block's end (the PDL handoff)
  early    how long its blocks ran before that wait returned (the loads they issued meanwhile)
  prologue median of ``t_ready - t_wait`` (x read, norm, staged; decode attention: to its first P V products;
           the Gated DeltaNet step: to its first item's outputs)
  tail     its last block's end minus its median block's end

A second table gives each kernel's moments relative to the previous kernel's last block end (medians over the
layers): its first and last block entry, its first wait return, its median block's inputs staged, and its first,
median and last block end.  ``--save FILE.npy`` keeps the raw records (``timeline.records()`` of the last replay);
``--load FILE.npy`` prints both tables from saved records, without a GPU.

Usage (GPU):  python benchmarks/step_timeline.py --model-path DIR [--output-len 64] [--save t.npy] [--set CODE]
       (any): python benchmarks/step_timeline.py --load t.npy
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))

import numpy as np


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
    from pegainfer.kernels.timeline import KINDS
    kind, extra = KINDS[int(blocks["kind"][0])], int(blocks["extra"][0])
    return f"{kind}[{extra}]x{int(blocks['grid'][0])}" if extra else f"{kind}x{int(blocks['grid'][0])}"


def summarize(rec: np.ndarray) -> list[dict]:
    rows, prev_end = [], None
    for blocks in launches(rec):
        end = int(blocks["t_end"].max())
        waited = blocks[blocks["t_wait"] > 0]       # (a decode attention block without work never waits)
        waited = waited if len(waited) else blocks
        first_wait = int(waited["t_wait"].min())
        row = {"label": label(blocks), "end": end,
               "early": float(np.median(waited["t_wait"] - waited["t_entry"])) / 1e3,
               "prologue": float(np.median(waited["t_ready"] - waited["t_wait"])) / 1e3,
               "tail": (end - float(np.median(blocks["t_end"]))) / 1e3,
               "wall": None if prev_end is None else (end - prev_end) / 1e3,
               "wait": None if prev_end is None else (first_wait - prev_end) / 1e3}
        rows.append(row)
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
        rel = lambda a: (np.asarray(a, np.int64) - t0) / 1e3
        waited = blocks[blocks["t_wait"] > 0]
        waited = waited if len(waited) else blocks
        m = per[lab]
        m["enter"].append(rel(blocks["t_entry"].min()))
        m["enter_last"].append(rel(blocks["t_entry"].max()))
        m["wait"].append(rel(waited["t_wait"].min()))
        m["ready"].append(float(np.median(rel(waited["t_ready"]))))
        m["end_first"].append(rel(blocks["t_end"].min()))
        m["end"].append(float(np.median(rel(blocks["t_end"]))))
        m["end_last"].append(rel(blocks["t_end"].max()))
    return {lab: {k: float(np.median(v)) for k, v in per[lab].items()} for lab in order}


def report_moments(table: dict[str, dict[str, float]]) -> None:
    keys = ("enter", "enter_last", "wait", "ready", "end_first", "end", "end_last")
    print(f"\n{'µs after the previous kernel ended':40s} " + " ".join(f"{k:>10s}" for k in keys))
    for lab, m in table.items():
        print(f"{lab:40s} " + " ".join(f"{m[k]:10.2f}" for k in keys))


def report(rows: list[dict]) -> None:
    by = defaultdict(list)
    order = []
    for r in rows:
        if r["label"] not in by:
            order.append(r["label"])
        by[r["label"]].append(r)
    print(f"{'kernel':40s} {'n':>3s} {'wall µs':>8s} {'wait':>6s} {'early':>6s} {'prologue':>8s} {'tail':>6s}")
    total = 0.0
    for lab in order:
        rs = by[lab]
        med = lambda key: statistics.median([r[key] for r in rs if r[key] is not None] or [float("nan")])
        walls = [r["wall"] for r in rs if r["wall"] is not None]
        total += sum(walls)
        print(f"{lab:40s} {len(rs):3d} {med('wall'):8.2f} {med('wait'):6.2f} {med('early'):6.2f} "
              f"{med('prologue'):8.2f} {med('tail'):6.2f}")
    print(f"sum of walls (first kernel's excluded): {total:.1f} µs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path")
    ap.add_argument("--load", default=None, metavar="FILE.npy", help="print the tables of saved records (no GPU)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated before capture (context length)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--save", default=None)
    ap.add_argument("--set", default="", metavar="STATEMENTS",
                    help="Python run before the engine is built, e.g. 'import pegainfer.kernels.linear as l; "
                         "l.PRELOAD_AROUND_BUSY_SMS = False' (a variant as graph_sweep.py takes them)")
    args = ap.parse_args(argv)
    if args.load:
        rec = np.load(args.load)
        report(summarize(rec))
        report_moments(moments(rec))
        return 0
    if not args.model_path:
        ap.error("--model-path is required (or --load FILE.npy)")
    if args.set:
        exec(compile(args.set, "<--set>", "exec"), {"__name__": "variant"})

    from cuda.bindings import driver as drv
    from numba import cuda

    from graph_sweep import warmed_engine
    from pegainfer.kernels import timeline
    engine = warmed_engine(args, "step_timeline")
    if engine is None:
        return 0
    runner = engine.runner

    stream = drv.CUstream(int(runner.stream.handle))
    start, end = cuda.event(), cuda.event()

    def replay_ms(n):
        start.record(runner.stream)
        for _ in range(n):
            drv.cuGraphLaunch(runner.graphs.execs[(1, 1)], stream)
        end.record(runner.stream)
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / n

    plain = replay_ms(args.replays)
    timeline.buffer()                   # allocated outside the capture
    timeline.ENABLED = True
    runner.graphs.capture(1, 1, decode=True)
    runner.stream.synchronize()
    stamped = replay_ms(args.replays)
    timeline.reset()
    replay_ms(1)
    rec = timeline.records()
    print(f"decode graph: {plain:.4f} ms plain, {stamped:.4f} ms stamped; {len(rec)} block records")
    ticks = np.diff(np.unique(np.concatenate([rec["t_entry"], rec["t_end"]])))
    print(f"globaltimer: smallest step between distinct stamps {int(ticks.min()) if len(ticks) else 0} ns")
    step = (int(rec["t_end"].max()) - int(rec["t_entry"].min())) / 1e3
    print(f"first block entry to last block end: {step:.1f} µs")
    report(summarize(rec))
    report_moments(moments(rec))
    if args.save:
        np.save(args.save, rec)
        print(f"records saved to {args.save}")
    timeline.ENABLED = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
