"""How long does token selection take on this GPU?

µs per call of ``argmax``, ``sample`` (top-p 0.9 and a few other settings) and ``logsumexp`` at the Qwen3
(151936) and Qwen3.5 (248320) vocabularies, for B = 1, 8 and 64 rows, on two kinds of logits:

* ``lm``: shaped like a language model's (a Zipf-like tail, ``18 - 1.5 ln(1 + rank)`` plus noise, shuffled) — the
  usual case, where the tokens a filter can keep fit in shared memory;
* ``flat``: N(0, 1) logits, where top-p 0.9 keeps ~10^5 tokens and the sampler takes its full-pass search path.

Times come from replaying a CUDA graph of ``--launches`` calls (one numba launch costs ~20 µs of host time, so
eager timing of a ~10 µs kernel would measure Python); ``eager_us`` is the same calls launched one by one, for
comparison.  ``kept`` is the median number of tokens the sampler kept per row (from its workspace), which says
which path ran; ``GBps`` is the logits' size over the time (one read of the row).

Usage (on the GPU host):  python benchmarks/bench_sampling.py [--json out.json] [--launches 50]
Without a GPU it runs as a smoke test in the simulator (vocabulary 512, B = 2, wall-clock times, no graphs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import time_calls, time_eager  # noqa: E402  (puts the checkout on sys.path)

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402

SIM = pegainfer.SIMULATOR
VOCABS = [("qwen3", 151936), ("qwen3.5", 248320)] if not SIM else [("sim", 512)]
BATCHES = [1, 8, 64] if not SIM else [2]
SETTINGS = [  # (label, SamplingBuffers.set_row keyword arguments)
    ("top-p 0.9", dict(temperature=0.7, top_p=0.9)),
    ("top-k 50", dict(temperature=0.7, top_k=50)),
    ("top-k 50 + top-p 0.95", dict(temperature=0.7, top_k=50, top_p=0.95)),
    ("min-p 0.05", dict(temperature=1.0, min_p=0.05)),
    ("no filter", dict(temperature=1.0)),
    ("greedy (T=0)", dict(temperature=0.0)),
]


def time_per_call(fn, launches: int, reps: int = 5) -> tuple[float, float]:
    """(seconds per call from CUDA-graph replays of ``launches`` calls, seconds per call launched eagerly): medians
    over ``reps``.  ``fn`` launches through ``pegainfer.kernels.launch``, so it follows the capturing stream."""
    return time_calls([fn] * launches, reps), time_eager(fn, launches, reps)


def make_logits(kind: str, rows: int, vocab: int, rng) -> np.ndarray:
    """Host bf16 bits ``[rows, vocab]`` of the given kind (module docstring)."""
    from pegainfer.kernels.primitives import to_bf16_bits
    if kind == "lm":
        ranks = np.arange(vocab)
        base = 18.0 - 1.5 * np.log1p(ranks)
        x = np.stack([rng.permutation(base) + rng.normal(0.0, 0.3, vocab) for _ in range(rows)])
    else:
        x = rng.standard_normal((rows, vocab))
    return to_bf16_bits(x.astype(np.float32))


def run(launches: int) -> list[dict]:
    from numba import cuda

    from pegainfer.kernels import sampling
    rng = np.random.default_rng(0)
    results = []
    for vocab_name, vocab in VOCABS:
        for kind in ("lm", "flat"):
            host = make_logits(kind, max(BATCHES), vocab, rng)
            logits_all = cuda.to_device(host)
            for B in BATCHES:
                logits = logits_all[:B]
                out_ids = cuda.device_array(B, np.int32)
                nbytes = B * vocab * 2

                def record(kernel, setting, fn, kept=None):
                    sec, eager = time_per_call(fn, launches)
                    row = dict(kernel=kernel, vocab=vocab, model=vocab_name, logits=kind, B=B, setting=setting,
                               us=sec * 1e6, eager_us=eager * 1e6, GBps=nbytes / sec / 1e9, kept=kept)
                    results.append(row)
                    kept_s = "" if kept is None else f"{kept:>8d}"
                    print(f"{kernel:9s} {vocab:>7d} {kind:5s} B={B:<3d} {setting:24s} {sec * 1e6:9.1f} us "
                          f"(eager {eager * 1e6:8.1f}) {nbytes / sec / 1e9:8.0f} GB/s {kept_s}", flush=True)

                record("argmax", "", lambda: sampling.argmax(logits, out_ids))
                lse = cuda.device_array(B, np.float32)
                record("logsumexp", "", lambda: sampling.logsumexp(logits, lse))
                for label, kw in SETTINGS:
                    params = sampling.SamplingBuffers(B)
                    for r in range(B):
                        params.set_row(r, seed=r, step=7, **kw)
                    params.upload()
                    workspace = sampling.allocate_sample_workspace(B, vocab)
                    fn = (lambda params=params, workspace=workspace:
                          sampling.sample(logits, params, out_ids, workspace))
                    fn()
                    kept = int(np.median(sampling.workspace_views(workspace)[1].copy_to_host()[:B]))
                    record("sample", label, fn, kept)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results (a list of rows) here")
    ap.add_argument("--launches", type=int, default=50, help="calls per CUDA graph (default 50)")
    args = ap.parse_args(argv)
    print(pegainfer.device.describe())
    print(f"{'kernel':9s} {'V':>7s} {'kind':5s} {'B':5s} {'setting':24s} {'µs/call':>12s} {'(eager)':>15s} "
          f"{'logits':>13s} {'kept':>8s}")
    results = run(1 if SIM else args.launches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(simulator=SIM, launches=args.launches, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
