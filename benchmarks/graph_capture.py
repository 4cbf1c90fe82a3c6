"""What does capturing a mixed step's CUDA graph cost, and does a replay's time depend on its padded chunk rows?

A mixed step (decodes beside prompt chunks) replays the graph of its padded shape (Dp decode rows, Cp chunk tokens,
Rp chunk rows: ``engine/cuda_graph.py``).  A shape first met while serving is captured on the engine thread, so
every stream waits for it; the warm-up captures the shapes a load can meet (``mixed_warmup_shapes``) to avoid that,
which costs start-up time and GPU memory.  This script loads a model as ``serve`` would (``--max-batch``, the
2048-token budget), reports the warm-up (seconds, graphs), then:

* captures ``--shapes`` more shapes the warm-up did not take (``ModelRunner.warm_mixed``), each timed on the host
  (what a stream would wait), and the GPU memory they hold;
* replays shapes that differ only in their chunk rows (8, 16, 32), CUDA graphs back to back between two CUDA
  events (``graph_timing.replay_graph_ms``), ms per step: the cost of padding chunk rows, which decides
  ``MIXED_MIN_ROWS``.

    python benchmarks/graph_capture.py --model-path DIR [--max-batch 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)

ROWS = (8, 16, 32)
DECODES = (0, 16, 48, 64)


def extra_shapes(runner, max_batch: int, count: int) -> list[tuple]:
    """Up to ``count`` mixed shapes (Dp, Cp, Rp) the warm-up did not capture: the chunk-row sizes of ``ROWS`` beside
    a few decode sizes and chunk buckets."""
    from pegainfer.engine.cuda_graph import mixed_decode_rows
    tokens = runner.model.max_tokens
    out = []
    for d in DECODES:
        Dp = mixed_decode_rows(min(d, max_batch), max_batch)
        for Cp in (128, 512, min(2048, tokens - Dp)):
            for Rp in ROWS:
                key = ("mixed", Dp, Cp, Rp)
                if Dp + Rp <= runner.model.max_rows and key not in runner.graphs.execs and (Dp, Cp, Rp) not in out:
                    out.append((Dp, Cp, Rp))
    return out[:count]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="model folder")
    ap.add_argument("--max-batch", type=int, default=64, help="sequences at once, as serve's --max-batch (64)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--shapes", type=int, default=36, help="shapes to capture beyond the warm-up's (36)")
    ap.add_argument("--replays", type=int, default=30, help="timed replays per shape (30)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    graph_timing.require_gpu("graph_capture.py")

    from numba import cuda

    from pegainfer.engine.engine import Engine
    eng = Engine.from_folder(args.model_path, args.max_model_len, max_batch=args.max_batch)
    runner, graphs = eng.runner, eng.runner.graphs
    res = {"max_batch": args.max_batch, "warmup_s": eng.warmup_s, "graphs_at_start": len(graphs.execs),
           "mixed_at_start": len(graphs.mixed_shapes)}
    print(f"warm-up {eng.warmup_s:.2f} s: {len(graphs.execs)} graphs ({len(graphs.mixed_shapes)} mixed shapes)")

    ctx = cuda.current_context()
    free0 = ctx.get_memory_info()[0]
    captures = []
    for shape in extra_shapes(runner, args.max_batch, args.shapes):
        t0 = time.perf_counter()
        runner.warm_mixed(*shape)
        runner.stream.synchronize()
        captures.append((shape, time.perf_counter() - t0))
    held = ctx.get_memory_info()[0] - free0
    if captures:
        secs = [t for _, t in captures]
        print(f"{len(captures)} more shapes: {sum(secs):.2f} s (mean {1e3 * sum(secs) / len(secs):.1f} ms, "
              f"max {1e3 * max(secs):.1f} ms), {-held / 2 ** 20:.1f} MiB of GPU memory")
    res["captures"] = [{"shape": list(s), "ms": 1e3 * t} for s, t in captures]
    res["capture_mib"] = -held / 2 ** 20

    from pegainfer.engine.cuda_graph import mixed_decode_rows
    res["replays"] = []
    print(f"\n{'decode rows, chunk tokens':<28}" + "".join(f"{f'{r} rows':>12}" for r in ROWS) + "   (ms a step)")
    for d in DECODES:
        Dp = mixed_decode_rows(min(d, args.max_batch), args.max_batch)
        for Cp in (128, 512, min(2048, runner.model.max_tokens - Dp)):
            cells = []
            for Rp in ROWS:
                key = ("mixed", Dp, Cp, Rp)
                ms = (graph_timing.replay_graph_ms(runner, graphs.execs[key], args.replays, warmup=3)
                      if key in graphs.execs else None)
                cells.append(ms)
                res["replays"].append({"shape": [Dp, Cp, Rp], "ms": ms})
            print(f"{f'{Dp}, {Cp}':<28}" + "".join(f"{'—' if ms is None else f'{ms:.3f}':>12}" for ms in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
