"""``python -m pegainfer bench``: TTFT / TPOT percentiles on a model folder, next to the memory-bandwidth floor
(weight bytes / measured read bandwidth) and, when torch + transformers are importable on a GPU, Hugging Face's
``generate()`` and a bare forward loop on the same weights."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from pegainfer.device import SIMULATOR


def add_bench_arguments(p) -> None:
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (random ids) per run (default 16)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per run (default 128)")
    p.add_argument("--runs", type=int, default=5, help="timed runs after one warm-up run (default 5)")
    p.add_argument("--hf", action=__import__("argparse").BooleanOptionalAction, default=False,
                   help="also time Hugging Face transformers on the same weights (needs torch + a GPU)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def time_generation(engine, prompt_ids, output_len):
    """One greedy request: returns (ttft_s, [inter-token seconds])."""
    from pegainfer.engine.types import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("bench", list(prompt_ids), params)
    stamps = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    return ttft, list(np.diff(stamps))


def hf_reference(folder, prompt_len, output_len, runs):
    """Time transformers on the same folder: generate() and a bare forward loop with its KV cache."""
    import torch
    from transformers import AutoModelForCausalLM
    dev = "cuda"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(dev).eval()
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    ids = torch.randint(0, min(vocab, 10000), (1, prompt_len), device=dev)
    res = {}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, do_sample=False, min_new_tokens=output_len)
        torch.cuda.synchronize()
        res["hf_generate_tok_s"] = output_len / (time.perf_counter() - t)
        tpots = []
        for _ in range(max(1, runs)):
            out = model(ids, use_cache=True)
            past = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(output_len):
                out = model(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            tpots.append((time.perf_counter() - t) / output_len)
        res["hf_forward_loop_tpot_ms"] = 1e3 * float(np.median(tpots))
        res["hf_forward_loop_tok_s"] = 1.0 / float(np.median(tpots))
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        res["hf_prefill_ms"] = 1e3 * (time.perf_counter() - t)
    del model
    torch.cuda.empty_cache()
    return res


def run_bench(args) -> int:
    from pegainfer.engine.engine import Engine
    t0 = time.perf_counter()
    engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=1, use_cuda_graph=args.cuda_graph)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    ttfts, tpots = [], []
    for run in range(args.runs + 1):
        prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
        ttft, gaps = time_generation(engine, prompt, args.output_len)
        if run > 0:       # run 0 warms up
            ttfts.append(ttft)
            tpots.extend(gaps)
    if args.trace_output_path:   # one more, traced run (its first prefill and decode steps are timed per kernel)
        from pegainfer.trace import maybe_trace
        with maybe_trace(args.trace_output_path, engine):
            time_generation(engine, rng.integers(0, vocab, size=args.prompt_len).tolist(), args.output_len)
    res = {
        "model": engine.model_name, "simulator": SIMULATOR, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "runs": args.runs, "cuda_graph": bool(args.cuda_graph),
        "load_s": load_s, "weights_load_s": engine.weights_load_s, "warmup_s": engine.warmup_s,
        "ttft_ms": {f"p{q}": 1e3 * _pct(ttfts, q) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": 1e3 * _pct(tpots, q) for q in (50, 90, 99)},
        "weight_bytes": engine.model.weight_bytes(),
    }
    res["tok_s"] = 1e3 / res["tpot_ms"]["p50"] if tpots else float("nan")
    if not SIMULATOR:
        from pegainfer.kernels.memory import measure_read_bandwidth
        bw = measure_read_bandwidth()
        res["read_bandwidth_GBps"] = bw / 1e9
        res["floor_tpot_ms"] = 1e3 * res["weight_bytes"] / bw
        res["floor_ratio"] = res["floor_tpot_ms"] / res["tpot_ms"]["p50"]
    if args.hf and not SIMULATOR:
        try:
            res.update(hf_reference(str(engine.folder), args.prompt_len, args.output_len, args.runs))
        except ImportError as e:
            res["hf_error"] = f"transformers/torch not importable: {e}"
    _print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _print_table(res) -> None:
    w = sys.stdout.write
    w(f"\nmodel {res['model']}  prompt {res['prompt_len']}  output {res['output_len']}  runs {res['runs']}  "
      f"cuda_graph {res['cuda_graph']}{'  (SIMULATOR)' if res['simulator'] else ''}\n")
    w(f"{'metric':<28}{'p50':>12}{'p90':>12}{'p99':>12}\n")
    for k in ("ttft_ms", "tpot_ms"):
        w(f"{k:<28}" + "".join(f"{res[k][p]:>12.3f}" for p in ("p50", "p90", "p99")) + "\n")
    w(f"{'tok/s (1/TPOT p50)':<28}{res['tok_s']:>12.1f}\n")
    w(f"{'weight bytes':<28}{res['weight_bytes'] / 1e9:>11.3f}G\n")
    if "floor_tpot_ms" in res:
        w(f"{'read bandwidth':<28}{res['read_bandwidth_GBps']:>10.0f}GB/s\n")
        w(f"{'floor TPOT (bytes/bw)':<28}{res['floor_tpot_ms']:>12.3f}\n")
        w(f"{'floor / TPOT p50':<28}{100 * res['floor_ratio']:>11.1f}%\n")
    for k in ("hf_generate_tok_s", "hf_forward_loop_tok_s", "hf_forward_loop_tpot_ms", "hf_prefill_ms", "hf_error"):
        if k in res:
            v = res[k]
            w(f"{k:<28}{v:>12.3f}\n" if isinstance(v, float) else f"{k:<28}{v}\n")
