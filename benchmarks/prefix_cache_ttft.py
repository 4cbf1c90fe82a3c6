"""How much sooner does the first token of a prompt come when an earlier request computed its prefix (prefix
caching)?  TTFT with the cache on and off, in one process:

    python benchmarks/prefix_cache_ttft.py --model-path ~/models/Qwen3-4B [--prefix-len 2000] [--suffix-len 16]
        [--followers 2]

For each run: request A (a fresh random prefix + suffix) fills the cache; then ``--followers`` requests (the same
prefix, other suffixes) find the prefix's full pages there, one after the other.  Prints TTFT p50 of A and of each
follower and last follower / A, with the cache on and off (off: every follower computes everything again), and the
prompt tokens each follower found cached.  Qwen3.5 reuses pages only where a copy of its recurrent state was kept:
its first follower finds A's pages but no state where they end (A's is kept at its own end), so it recomputes and
keeps one there, and the second is the one that hits (``--followers 2``).  Without a GPU it runs in the simulator
on the demo model (use small lengths)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def ttft(engine, rid, prompt):
    """Seconds from add_request to the first token, and the request's cached prompt tokens."""
    from pegainfer.engine.types import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    first, cached = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            cached = out.cached_tokens
    return first, cached


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--followers", type=int, default=1, help="requests after the first with its prefix (default 1)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup-runs", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from pegainfer.engine.engine import Engine

    results = {}
    for cache in (True, False):
        engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=2, enable_prefix_caching=cache)
        vocab = engine.model.V
        rng = np.random.default_rng(0)
        a_times, f_times, cached = [], [[] for _ in range(args.followers)], []
        for run in range(args.warmup_runs + args.runs):
            prefix = rng.integers(0, vocab, size=args.prefix_len).tolist()
            a, _ = ttft(engine, f"a{run}", prefix + rng.integers(0, vocab, size=args.suffix_len).tolist())
            hits = []
            for k in range(args.followers):
                f, hit = ttft(engine, f"f{run}.{k}", prefix + rng.integers(0, vocab, size=args.suffix_len).tolist())
                if run >= args.warmup_runs:
                    f_times[k].append(f)
                hits.append(hit)
            if run >= args.warmup_runs:
                a_times.append(a)
                cached.append(hits)
        a50 = statistics.median(a_times) * 1e3
        f50 = [statistics.median(t) * 1e3 for t in f_times]
        results["on" if cache else "off"] = {"ttft_first_ms": a50, "ttft_followers_ms": f50,
                                             "ratio": f50[-1] / a50, "cached_tokens": cached}
        print(f"prefix caching {'on ' if cache else 'off'}: TTFT first {a50:8.2f} ms, followers (same "
              f"{args.prefix_len}-token prefix) {' / '.join(f'{t:.2f}' for t in f50)} ms, last / first "
              f"{f50[-1] / a50:.3f}, cached tokens {cached}")
        del engine
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "followers": args.followers,
                       **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
