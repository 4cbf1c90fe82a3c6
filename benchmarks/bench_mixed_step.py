"""How long does a mixed step take -- B running decodes beside the prompts of N new requests of L tokens each, the
step a server runs whenever requests arrive -- against its parts: the decode step of the B sequences alone and a
step of the same N prompts alone?

    python benchmarks/bench_mixed_step.py --model-path ~/models/Qwen3-4B [--batch 64] [--prompts 16] [--prompt-len 128]
        [--policy pdl=none] [--profile]

B sequences are prefilled to ``--context`` tokens and keep decoding; then, ``--runs`` times, N new requests of L
random tokens (one output token each, so they leave right after) arrive together and the next step carries them
beside the B decodes.  Every shape is run once untimed first (so its CUDA graph is captured), and the engine runs
synchronously (``async_scheduling`` off): each step's time is its host work plus its GPU work, the same for the three
kinds.  Prints each kind's p50 and the mixed step's excess over the sum of its parts (negative: the mixed step
shares what its parts would each pay, e.g. one pass over the weights).  Without a GPU it runs in the simulator on
the demo model (use small sizes).

``--profile`` then runs one more decode step and one more mixed step under the CUDA profiling interface (CUPTI
through torch.profiler; torch only traces) and prints per kernel family the GPU time of each and what the mixed step
adds: where the prompts' cost goes when they ride beside the decodes."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _arrive(engine, rng, tag: str, n: int, length: int, vocab: int) -> None:
    from pegainfer.engine.types import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for j in range(n):
        engine.add_request(f"{tag}-{j}", rng.integers(0, vocab, size=length).tolist(), one)


def measure(engine, batch: int, prompts: int, prompt_len: int, context: int, runs: int) -> dict:
    """Step times (seconds) of the three kinds on ``engine``: ``decode`` (the B sequences), ``prompts`` (the N
    prompts, nothing else running) and ``mixed`` (both in one step), each ``runs`` times after one untimed run."""
    from pegainfer.engine.types import SamplingParams
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    sched = engine.scheduler
    times = {"decode": [], "prompts": [], "mixed": []}
    for run in range(runs + 1):                 # the N prompts alone (run 0 untimed: captures the shape)
        _arrive(engine, rng, f"alone{run}", prompts, prompt_len, vocab)
        t = _timed_step(engine)
        assert not engine.has_unfinished(), "the prompts did not fit one step: raise --max-num-batched-tokens"
        if run:
            times["prompts"].append(t)
    long = SamplingParams(max_tokens=10 ** 6, temperature=0.0, ignore_eos=True)
    for j in range(batch):                      # the B decoding sequences, at the given context
        engine.add_request(f"run-{j}", rng.integers(0, vocab, size=context).tolist(), long)
    while sched.waiting or any(seq.num_uncomputed > 1 for seq in sched.running):
        engine.step()
    for run in range(runs + 1):
        t = _timed_step(engine)                 # a decode step of the B sequences
        _arrive(engine, rng, f"mixed{run}", prompts, prompt_len, vocab)
        # the step that carries the new prompts beside the decodes (which a step never skips): their single
        # tokens finish them in it
        tm = _timed_step(engine)
        assert not sched.waiting and len(sched.running) == batch, "the prompts did not fit one step beside the decodes"
        if run:
            times["decode"].append(t)
            times["mixed"].append(tm)
    for j in range(batch):
        engine.abort(f"run-{j}")
    while engine.has_unfinished():
        engine.step()
    return times


def profile_kinds(engine, batch: int, prompts: int, prompt_len: int) -> dict[str, dict[str, list[float]]]:
    """Per kind (``decode``, ``mixed``), per kernel name (with grid x block): [launches, GPU µs] of one step of that
    kind, recorded by CUPTI.  The B sequences of ``measure`` must be gone; they are added again and aborted after."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from step_profile import kernel_events
    from pegainfer.engine.types import SamplingParams
    rng = np.random.default_rng(1)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    sched = engine.scheduler
    long = SamplingParams(max_tokens=10 ** 6, temperature=0.0, ignore_eos=True)
    for j in range(batch):
        engine.add_request(f"prof-{j}", rng.integers(0, vocab, size=prompt_len).tolist(), long)
    while sched.waiting or any(seq.num_uncomputed > 1 for seq in sched.running):
        engine.step()
    for _ in range(2):                          # both shapes captured and warm before the profiled pair
        engine.step()
        _arrive(engine, rng, "warm", prompts, prompt_len, vocab)
        engine.step()
    out = {}
    for kind in ("decode", "mixed"):
        if kind == "mixed":
            _arrive(engine, rng, "prof", prompts, prompt_len, vocab)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = kernel_events(json.load(f))
        fam: dict[str, list[float]] = {}
        for name, start, end in events:
            f = fam.setdefault(name, [0, 0.0])
            f[0] += 1
            f[1] += end - start
        out[kind] = fam
    for j in range(batch):
        engine.abort(f"prof-{j}")
    while engine.has_unfinished():
        engine.step()
    return out


def report_profile(prof: dict[str, dict[str, list[float]]], top: int = 30) -> None:
    dec, mix = prof["decode"], prof["mixed"]
    total = {k: sum(v[1] for v in fam.values()) for k, fam in prof.items()}
    print(f"\nGPU time of one step by kernel (CUPTI): decode {total['decode']:.1f} us, mixed {total['mixed']:.1f} us")
    print(f"{'kernel (grid x block in the mixed step)':<52}{'launches':>9}{'mixed us':>10}{'decode us':>10}{'added us':>10}")
    names = sorted(set(dec) | set(mix), key=lambda n: -(mix.get(n, [0, 0.0])[1] - dec.get(n, [0, 0.0])[1]))
    for name in names[:top]:
        m, d = mix.get(name, [0, 0.0]), dec.get(name, [0, 0.0])
        print(f"{name[:52]:<52}{m[0]:>9}{m[1]:>10.1f}{d[1]:>10.1f}{m[1] - d[1]:>+10.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--batch", type=int, default=64, help="running decodes B (default 64)")
    ap.add_argument("--prompts", type=int, default=16, help="new requests N arriving together (default 16)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens L of each new prompt (default 128)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence (default 256)")
    ap.add_argument("--runs", type=int, default=5, help="timed steps of each kind (default 5)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step's token budget (default: B + N·L, so one step carries every new prompt)")
    ap.add_argument("--policy", default="", metavar="FIELD=VALUE,...",
                    help="LaunchPolicy fields to change, as the CLI's --launch-policy (e.g. "
                         "pdl=none)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each kernel's GPU time in a decode step and a mixed step (CUPTI; needs a GPU "
                         "and torch)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.profile:
        import graph_timing
        graph_timing.require_gpu("--profile", "it reads the CUDA profiling interface's kernel records")
    from pegainfer.kernels.policy_text import PolicyTextError, parse_fields
    try:
        fields = parse_fields(args.policy)
    except PolicyTextError as e:
        ap.error(f"--policy: {e}")
    from pegainfer.engine.engine import Engine, engine_policy

    budget = args.max_num_batched_tokens or args.batch + args.prompts * args.prompt_len
    mml = args.context + 4 * (args.runs + 2) + args.prompt_len + 64
    engine = Engine.from_folder(args.model_path, mml, max_batch=args.batch + args.prompts,
                                max_num_batched_tokens=budget, async_scheduling=False,
                                policy=engine_policy(fields))
    times = measure(engine, args.batch, args.prompts, args.prompt_len, args.context, args.runs)
    p50 = {kind: 1e3 * statistics.median(t) for kind, t in times.items()}
    res = {"model": engine.model_name, "batch": args.batch, "prompts": args.prompts, "prompt_len": args.prompt_len,
           "context": args.context, "runs": args.runs, "max_num_batched_tokens": budget, "policy": args.policy,
           "p50_ms": p50, "excess_ms": p50["mixed"] - p50["decode"] - p50["prompts"],
           "step_s": times}
    B, N, L = args.batch, args.prompts, args.prompt_len
    print(f"{engine.model_name}: {B} decodes at context ~{args.context}, {N} prompts of {L} tokens, p50 of "
          f"{args.runs} steps each (synchronous steps)")
    print(f"{'step':<40}{'tokens':>8}{'p50 ms':>10}")
    print(f"{f'decode of {B}':<40}{B:>8}{p50['decode']:>10.3f}")
    print(f"{f'{N} prompts x {L} alone':<40}{N * L:>8}{p50['prompts']:>10.3f}")
    print(f"{f'mixed: {B} decodes + {N} x {L}':<40}{B + N * L:>8}{p50['mixed']:>10.3f}")
    print(f"{'mixed - (decode + prompts)':<40}{'':>8}{res['excess_ms']:>+10.3f}")
    if args.profile:
        res["profile"] = profile_kinds(engine, args.batch, args.prompts, args.prompt_len)
        report_profile(res["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    code = main()
    # torch's profiler and numba both hold the CUDA context; their teardown at exit can abort (step_profile.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
