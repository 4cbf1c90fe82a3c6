"""How much of a decode token's time is spent outside its CUDA graph?  Times, on one engine and one GPU:

* ``tpot``: the engine's inter-token time of a greedy request (what ``pegainfer bench`` reports as TPOT), with async
  scheduling: per token the stream holds the step's input upload, the graph, and the copy of the sampled id to the
  host (and whatever else the runner puts between two graphs);
* ``graph``: the same batch-1 decode graph replayed back to back with nothing between replays (CUDA events around
  ``--replays`` launches; the inputs are the last step's, replayed as they are).

``tpot - graph`` is what a token costs beyond its kernels: the copies between graphs, the graph launch boundary,
and host time the GPU waits for.

Usage (GPU):  python benchmarks/step_gap.py --model-path DIR [--prompt-len 16] [--output-len 64] [--replays 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))   # (after PYTHONPATH: A/B against another tree)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--replays", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import numpy as np
    from numba import cuda

    from pegainfer.bench import time_generation
    from pegainfer.device import SIMULATOR
    from pegainfer.engine.engine import Engine
    if SIMULATOR:
        print("step_gap needs a GPU (the simulator has no CUDA graphs)")
        return 0
    engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=1)
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    runner = engine.runner
    rows = []
    for run in range(args.runs + 1):
        _, gaps = time_generation(engine, rng.integers(0, vocab, size=args.prompt_len).tolist(), args.output_len)
        start, end = cuda.event(), cuda.event()
        start.record(runner.stream)
        for _ in range(args.replays):
            runner.graphs.replay(1, 1)
        end.record(runner.stream)
        end.synchronize()
        graph_ms = cuda.event_elapsed_time(start, end) / args.replays
        if run > 0:     # run 0 warms up
            rows.append({"tpot_ms": 1e3 * statistics.median(gaps), "graph_ms": graph_ms})
    for r in rows:
        r["gap_us"] = 1e3 * (r["tpot_ms"] - r["graph_ms"])
    print(f"{'run':>4} {'tpot ms':>9} {'graph ms':>9} {'gap µs':>8}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['tpot_ms']:>9.4f} {r['graph_ms']:>9.4f} {r['gap_us']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
