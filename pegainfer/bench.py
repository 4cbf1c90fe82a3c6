"""``python -m pegainfer bench``: TTFT / TPOT percentiles on a model folder, next to the memory-bandwidth floor
and, with ``--hf`` (torch + transformers on a GPU), Hugging Face on the same weights side by side.

**Batched decode** (``--batch B``): B requests of random prompts are added at once and stepped until every one has
its first token (prefilled) and ``BATCH_WARM_STEPS`` more, then ``--output-len`` steps of all B sequences are timed
one ``step()`` call each (with async scheduling a call launches the next step and reads this one, so its duration
is the step period), ``--runs`` times; every timed step must return one token per sequence (``short_steps``
counts those that did not).  The prompt is ``--prompt-len - 1 - BATCH_WARM_STEPS`` tokens long, so each sequence
holds ``--prompt-len`` tokens of context when the timed steps begin.  Reported: p50 / p90 step time, tokens/s
(B / step time), and the floor of a step of B sequences over the bandwidth measured in the same run.

**The floor.** A batch-1 decode step is memory-bound: it cannot be faster than the bytes it must move divided by
the read bandwidth the GPU reaches (``kernels.memory.measure_read_bandwidth``, measured in the same run).  Those
bytes (``decode_floor_bytes``) are

* the weights, every matrix once — the embedding table only when it is also the LM head (an untied table is read
  one row per token);
* the recurrent state of hybrid models (Qwen3.5), read and written back once per step: the conv window (bf16) and
  the delta-rule state (f32) of every linear-attention layer, sized from the model's own state buffers;
* the KV cache of the full-attention layers, read at the mean context of the timed decode steps
  (``prompt_len + output_len / 2`` tokens).

For a step of B sequences (``batch``): the weights once (an untied embedding: B rows), the recurrent state of B
sequences, and the KV cache of all B at their mean context.

Activations, the logits row (``V × 2`` bytes) and the sampled id (together under a megabyte) are left out.

**Hugging Face.** ``--hf`` loads the class that ``config.json`` names (``hf_model_class``) and times, on the same
prompt length: TTFT as one prefill forward + the first greedy token read back to the host (warmed up, median of
``--runs``), TPOT as a bare forward loop over its own cache, and ``generate()`` end to end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from pegainfer.device import SIMULATOR


BATCH_WARM_STEPS = 2   # decode steps of the whole batch after the last prefill, before the timed ones


def add_bench_arguments(p) -> None:
    from pegainfer.argtypes import output_file, positive
    p.add_argument("--prompt-len", type=positive, default=16,
                   help="prompt tokens (random ids) per run (default 16); with --batch: the context each sequence "
                        "holds when the timed steps begin (prompt + the tokens generated before them)")
    p.add_argument("--output-len", type=positive, default=128,
                   help="tokens generated per run (default 128); with --batch: timed decode steps per run")
    p.add_argument("--runs", type=positive, default=5,
                   help="timed runs (default 5; without --batch after one warm-up run)")
    p.add_argument("--batch", type=positive, default=None,
                   help="time decode steps of this many sequences at once (p50 / p90 step time, tokens/s, and the "
                        "floor of a step of B sequences) instead of one request's TTFT / TPOT; the engine is built "
                        "with max batch B")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=False,
                   help="also time Hugging Face transformers on the same weights and prompt length (needs torch + "
                        "a GPU); with --batch: its forward loop over a batch of B at the same context")
    p.add_argument("--penalties", action="store_true",
                   help="every request with presence 0.5, frequency 0.5 and repetition 1.1 penalties (greedy still):"
                        " what the penalties cost a token or a step, against a run without")
    p.add_argument("--json", type=output_file, default=None, help="write the results as JSON to this path")


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


BENCH_PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
"""The penalties of ``--penalties``."""


def time_generation(engine, prompt_ids, output_len, penalties: bool = False):
    """One greedy request (``penalties``: with ``BENCH_PENALTIES``): returns (ttft_s, [inter-token seconds])."""
    from pegainfer.engine.types import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                            **(BENCH_PENALTIES if penalties else {}))
    t0 = time.perf_counter()
    engine.add_request("bench", list(prompt_ids), params)
    stamps = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    return ttft, list(np.diff(stamps))


def time_batch_decode(engine, prompts, steps: int, run: int = 0, penalties: bool = False) -> dict:
    """Add one greedy request per prompt, step until each has its first token and ``BATCH_WARM_STEPS`` more, then
    time ``steps`` step() calls (the module docstring); the requests are aborted afterwards.  Returns
    ``step_s`` (the timed periods), ``tokens`` (tokens returned by each timed step) and ``context`` (the mean
    context, prompt + generated, the timed steps read per sequence)."""
    from pegainfer.engine.types import SamplingParams
    batch = len(prompts)
    ids = [f"batch{run}-{i}" for i in range(batch)]
    # room for a prefill phase that interleaves decodes (at most one per prefill), the warm-up and timed steps
    params = SamplingParams(max_tokens=batch + BATCH_WARM_STEPS + steps + 2, temperature=0.0, ignore_eos=True,
                            **(BENCH_PENALTIES if penalties else {}))
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, list(prompt), params)
    generated = dict.fromkeys(ids, 0)

    def step() -> int:
        n = 0
        for out in engine.step():
            if out.request_id in generated and out.new_token_ids:
                generated[out.request_id] += len(out.new_token_ids)
                n += len(out.new_token_ids)
        return n

    while min(generated.values()) < 1 + BATCH_WARM_STEPS:
        if not engine.has_unfinished():
            raise RuntimeError("the batch finished before the timed steps")
        step()
    prompt_len = len(prompts[0])
    contexts, times, tokens = [], [], []
    t = time.perf_counter()
    for _ in range(steps):
        contexts.append(prompt_len + np.mean(list(generated.values())))
        tokens.append(step())
        now = time.perf_counter()
        times.append(now - t)
        t = now
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return {"step_s": times, "tokens": tokens, "context": float(np.mean(contexts))}


# ------------------------------------------------------------------------------------------------ the floor
def recurrent_state_bytes(model) -> int:
    """Bytes of one sequence's recurrent state over all layers, from the model's state buffers (``conv_state`` and
    ``ssm_state``, each ``[linear layers, slots, ...]``); 0 for models without any (Qwen3)."""
    slots = getattr(model, "num_slots", 0)
    if not slots:
        return 0
    buffers = [getattr(model, name, None) for name in ("conv_state", "ssm_state")]
    return sum(int(b.nbytes) for b in buffers if b is not None) // slots


def decode_floor_bytes(model, context_tokens: float, batch: int = 1) -> dict:
    """The bytes one decode step of ``batch`` sequences must move at least, by component (see the module
    docstring): ``weights_read``, ``recurrent_state_rw`` (read + write, every sequence's), ``kv_read`` of every
    sequence at ``context_tokens`` cached tokens (their mean), and their ``total``."""
    weights = model.weight_bytes()
    if getattr(model, "lm_head", None) is not getattr(model, "embed", None):
        weights -= 2 * max(0, model.V - batch) * model.H   # an untied embedding: one row per token, not the table
    parts = {"weights_read": int(weights),
             "recurrent_state_rw": 2 * batch * recurrent_state_bytes(model),
             "kv_read": int(round(batch * context_tokens * model.kv_bytes_per_token())),
             "kv_context_tokens": float(context_tokens), "batch": int(batch)}
    parts["total"] = parts["weights_read"] + parts["recurrent_state_rw"] + parts["kv_read"]
    return parts


# ------------------------------------------------------------------------------------------------ Hugging Face
def hf_model_class(folder):
    """The transformers class to load ``folder`` with: the one its ``config.json`` names (``architectures[0]``)
    when transformers has it, else ``AutoModelForCausalLM``.

    Named classes matter for Qwen3.5's multimodal checkpoints (``Qwen3_5ForConditionalGeneration``, tensors under
    ``model.language_model.``): ``AutoModelForCausalLM`` maps their config to the text-only
    ``Qwen3_5ForCausalLM``, and whether that class finds the text weights under the multimodal prefix depends on
    the transformers release (5.24 renames them on load; older 5.x releases may initialise them at random).  The
    named class reads the checkpoint as saved, on every release."""
    import transformers

    from pegainfer.jsonfile import read_json
    archs = read_json(Path(folder) / "config.json").get("architectures") or []
    for name in archs:
        cls = getattr(transformers, str(name), None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def _cache_of(out):
    """The cache a forward returned (``past_key_values`` up to transformers 5.2x, ``cache`` after)."""
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache", None)


def _hf_linear_attention_kernels() -> dict:
    """Whether HF's Qwen3.5 linear attention can use its fast kernels (else it runs a PyTorch reference)."""
    import importlib.util
    return {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}


def hf_reference(folder, prompt_len, output_len, runs, device="cuda"):
    """Time transformers (bf16, its default sdpa attention) on the same folder and prompt length: TTFT (prefill +
    the first greedy token on the host), a bare forward loop with its cache (TPOT), and ``generate()``.
    (``device="cpu"`` only checks the code path.)"""
    import inspect

    import torch
    dev = device

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    cls = hf_model_class(folder)
    model = cls.from_pretrained(folder, dtype=torch.bfloat16).to(dev).eval()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = torch.randint(0, min(cfg.vocab_size, 10000), (1, prompt_len), device=dev)
    # generate() asks for the last position's logits only; so do we (not [prompt_len, V] logits)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    res = {"hf_class": cls.__name__}
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        res["hf_fast_kernels"] = _hf_linear_attention_kernels()

    def prefill():
        out = model(ids, use_cache=True, **keep)
        return _cache_of(out), out.logits[:, -1:].argmax(-1)

    with torch.inference_mode():
        prefill()[1].item()                                   # warm-up at the timed length
        ttfts = []
        for _ in range(max(1, runs)):
            sync()
            t = time.perf_counter()
            _, tok = prefill()
            tok.item()                                        # the first token on the host (synchronizes)
            ttfts.append(time.perf_counter() - t)
        res["hf_ttft_ms"] = {f"p{q}": 1e3 * _pct(ttfts, q) for q in (50, 90)}
        res["hf_prefill_ms"] = res["hf_ttft_ms"]["p50"]

        tpots = []
        for _ in range(max(1, runs)):
            past, tok = prefill()
            sync()
            t = time.perf_counter()
            for _ in range(output_len):
                out = model(tok, past_key_values=past, use_cache=True, **keep)
                past = _cache_of(out)
                tok = out.logits[:, -1:].argmax(-1)
            sync()
            tpots.append((time.perf_counter() - t) / output_len)
        res["hf_forward_loop_tpot_ms"] = 1e3 * float(np.median(tpots))
        res["hf_forward_loop_tok_s"] = 1.0 / float(np.median(tpots))

        model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, do_sample=False, min_new_tokens=output_len)
        sync()
        res["hf_generate_tok_s"] = output_len / (time.perf_counter() - t)   # prefill included
    model = None                                              # drop the weights (prefill holds the name)
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


def hf_batch_decode(folder, batch, context, steps, runs, device="cuda"):
    """transformers' bare forward loop over a batch: ``batch`` random prompts of ``context`` tokens prefilled
    together, then ``steps`` greedy one-token forwards of the whole batch with its cache, ``runs`` times; returns
    ``hf_step_ms`` (p50, p90 of the per-run mean step time) and ``hf_tok_s`` (batch / p50).  (``device="cpu"``
    only checks the code path.)"""
    import inspect

    import torch
    cls = hf_model_class(folder)
    model = cls.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = torch.randint(0, min(cfg.vocab_size, 10000), (batch, context), device=device)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    per_run = []
    with torch.inference_mode():
        for run in range(runs + 1):               # run 0 warms up
            out = model(ids, use_cache=True, **keep)
            past, tok = _cache_of(out), out.logits[:, -1:].argmax(-1)
            sync()
            t = time.perf_counter()
            for _ in range(steps):
                out = model(tok, past_key_values=past, use_cache=True, **keep)
                past, tok = _cache_of(out), out.logits[:, -1:].argmax(-1)
            sync()
            if run > 0:
                per_run.append((time.perf_counter() - t) / steps)
    model = None
    if device == "cuda":
        torch.cuda.empty_cache()
    p50 = 1e3 * _pct(per_run, 50)
    return {"hf_class": cls.__name__, "hf_step_ms": {"p50": p50, "p90": 1e3 * _pct(per_run, 90)},
            "hf_tok_s": 1e3 * batch / p50}


# ------------------------------------------------------------------------------------------------ the command
def policy_summary(policy) -> dict:
    """The launch policy as JSON values: ``pdl`` the sorted launch names that may overlap (None: every launch),
    ``tuning`` the number of measured geometries, the other fields as they are."""
    import dataclasses
    out = {}
    for field in dataclasses.fields(policy):
        name, value = field.name, getattr(policy, field.name)
        if name == "pdl":
            value = None if value is None else sorted(value)
        elif name == "tuning":
            value = len(value)
        out[name] = value
    return out


def run_bench(args, policy=None) -> int:
    """The ``bench`` command on parsed ``args``; ``policy``: the engine's ``LaunchPolicy`` (None: the default with
    ``--launch-policy``'s fields; ``benchmarks/ab_policy.py --mode bench`` passes each variant's)."""
    if policy is None:
        from pegainfer.engine.engine import engine_policy
        policy = engine_policy(getattr(args, "launch_policy", None))
    if getattr(args, "batch", None):
        return run_batch_bench(args, policy)
    from pegainfer.engine.engine import Engine
    t0 = time.perf_counter()
    engine = Engine.from_folder(args.model_path, args.max_model_len, max_batch=1, use_cuda_graph=args.cuda_graph,
                                async_scheduling=getattr(args, "async_scheduling", True), policy=policy,
                                mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    ttfts, tpots = [], []
    for run in range(args.runs + 1):
        prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
        ttft, gaps = time_generation(engine, prompt, args.output_len, getattr(args, "penalties", False))
        if run > 0:       # run 0 warms up
            ttfts.append(ttft)
            tpots.extend(gaps)
    if args.trace_output_path:   # one more, traced run (its first prefill and decode steps are timed per kernel)
        from pegainfer.trace import maybe_trace
        with maybe_trace(args.trace_output_path, engine):
            time_generation(engine, rng.integers(0, vocab, size=args.prompt_len).tolist(), args.output_len)
    res = {
        "model": engine.model_name, "arch": engine.model_config.arch, "simulator": SIMULATOR,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": args.runs,
        "cuda_graph": bool(args.cuda_graph), "async_scheduling": bool(getattr(args, "async_scheduling", True)),
        "penalties": bool(getattr(args, "penalties", False)), "load_s": load_s,
        "weights_load_s": engine.weights_load_s, "warmup_s": engine.warmup_s,
        "ttft_ms": {f"p{q}": 1e3 * _pct(ttfts, q) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": 1e3 * _pct(tpots, q) for q in (50, 90, 99)},
        "policy": policy_summary(engine.model.policy),
        "weight_bytes": engine.model.weight_bytes(),
        "floor_bytes": decode_floor_bytes(engine.model, args.prompt_len + args.output_len / 2),
    }
    res["tok_s"] = 1e3 / res["tpot_ms"]["p50"] if tpots else float("nan")
    if not SIMULATOR:
        from pegainfer.kernels.memory import measure_read_bandwidth
        bw = measure_read_bandwidth()
        res["read_bandwidth_GBps"] = bw / 1e9
        res["floor_tpot_ms"] = 1e3 * res["floor_bytes"]["total"] / bw
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


def run_batch_bench(args, policy=None) -> int:
    """``bench --batch B``: decode steps of B sequences (the module docstring)."""
    from pegainfer.engine.engine import PAGE_SIZE, Engine
    from pegainfer.errors import PegainferError
    B = args.batch
    if args.prompt_len < 2 + BATCH_WARM_STEPS:
        raise PegainferError(f"--prompt-len with --batch is the context when the timed steps begin: at least "
                             f"{2 + BATCH_WARM_STEPS} (a 1-token prompt and the {1 + BATCH_WARM_STEPS} tokens "
                             f"generated before them)")
    prompt_len = args.prompt_len - 1 - BATCH_WARM_STEPS
    # the longest sequence: its prompt, a prefill phase with a decode per prefill, the warm-up and timed steps
    needed = prompt_len + B + BATCH_WARM_STEPS + args.output_len + 4
    # a page more than that, so a pool of B sequences of this length has room beyond B full sequences (the
    # scheduler admits a sequence only while a reserve of pages stays free)
    mml = args.max_model_len or needed + PAGE_SIZE
    if mml < needed:
        raise PegainferError(f"--max-model-len {mml} is too short for --batch {B} at --prompt-len {args.prompt_len} "
                             f"with --output-len {args.output_len}: give at least {needed}, or leave it out")
    t0 = time.perf_counter()
    engine = Engine.from_folder(args.model_path, mml, max_batch=B, use_cuda_graph=args.cuda_graph,
                                async_scheduling=getattr(args, "async_scheduling", True), policy=policy,
                                mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = min(engine.model.V, engine.tokenizer.vocab_size)
    steps, tokens, contexts = [], [], []
    for run in range(args.runs):
        prompts = rng.integers(0, vocab, size=(B, prompt_len)).tolist()
        got = time_batch_decode(engine, prompts, args.output_len, run, getattr(args, "penalties", False))
        steps += got["step_s"]
        tokens += got["tokens"]
        contexts.append(got["context"])
    if args.trace_output_path:   # one more, traced run (its first prefill and decode steps are timed per kernel)
        from pegainfer.trace import maybe_trace
        with maybe_trace(args.trace_output_path, engine):
            time_batch_decode(engine, rng.integers(0, vocab, size=(B, prompt_len)).tolist(), args.output_len,
                              args.runs)
    context = float(np.mean(contexts))
    res = {
        "model": engine.model_name, "arch": engine.model_config.arch, "simulator": SIMULATOR, "batch": B,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": args.runs,
        "cuda_graph": bool(args.cuda_graph), "async_scheduling": bool(getattr(args, "async_scheduling", True)),
        "penalties": bool(getattr(args, "penalties", False)), "max_model_len": engine.max_model_len,
        "load_s": load_s,
        "step_ms": {f"p{q}": 1e3 * _pct(steps, q) for q in (50, 90, 99)},
        "mean_context_tokens": context,
        "short_steps": sum(1 for n in tokens if n != B),
        "policy": policy_summary(engine.model.policy),
        "weight_bytes": engine.model.weight_bytes(),
        "floor_bytes": decode_floor_bytes(engine.model, context, B),
    }
    res["tok_s"] = 1e3 * B / res["step_ms"]["p50"]
    if not SIMULATOR:
        from pegainfer.kernels.memory import measure_read_bandwidth
        bw = measure_read_bandwidth()
        res["read_bandwidth_GBps"] = bw / 1e9
        res["floor_step_ms"] = 1e3 * res["floor_bytes"]["total"] / bw
        res["floor_tok_s"] = 1e3 * B / res["floor_step_ms"]
        res["floor_ratio"] = res["floor_step_ms"] / res["step_ms"]["p50"]
    if args.hf and not SIMULATOR:
        folder = str(engine.folder)
        engine = None                               # the GPU memory goes to transformers
        try:
            res.update(hf_batch_decode(folder, B, args.prompt_len, args.output_len, args.runs))
        except ImportError as e:
            res["hf_error"] = f"transformers/torch not importable: {e}"
    _print_batch_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _print_batch_table(res) -> None:
    w = sys.stdout.write
    B = res["batch"]
    w(f"\nmodel {res['model']} ({res['arch']})  batch {B}  context {res['prompt_len']} (mean over the timed steps "
      f"{res['mean_context_tokens']:.1f})  steps {res['output_len']} x {res['runs']} runs  cuda_graph "
      f"{res['cuda_graph']}{'  (SIMULATOR)' if res['simulator'] else ''}\n")
    w(f"{'metric':<32}{'p50':>12}{'p90':>12}{'p99':>12}\n")
    w(f"{'decode step ms':<32}" + "".join(f"{res['step_ms'][p]:>12.3f}" for p in ("p50", "p90", "p99")) + "\n")
    w(f"{'tok/s (B / step p50)':<32}{res['tok_s']:>12.1f}\n")
    if res["short_steps"]:
        w(f"{res['short_steps']} timed steps returned fewer than {B} tokens (the batch was not decoded whole)\n")
    fb = res["floor_bytes"]
    w(f"bytes per decode step of {B} sequences, MB (the floor's numerator):\n")
    w(f"{'  weights read':<32}{fb['weights_read'] / 1e6:>12.3f}\n")
    w(f"{'  recurrent state r+w':<32}{fb['recurrent_state_rw'] / 1e6:>12.3f}\n")
    w(f"{'  KV read (' + str(B) + ' x ctx ' + format(fb['kv_context_tokens'], '.1f') + ')':<32}"
      f"{fb['kv_read'] / 1e6:>12.3f}\n")
    w(f"{'  total':<32}{fb['total'] / 1e6:>12.3f}\n")
    if "floor_step_ms" in res:
        w(f"{'read bandwidth':<32}{res['read_bandwidth_GBps']:>10.0f}GB/s\n")
        w(f"{'floor step (bytes/bw) ms':<32}{res['floor_step_ms']:>12.3f}\n")
        w(f"{'floor tok/s':<32}{res['floor_tok_s']:>12.1f}\n")
        w(f"{'floor / step p50':<32}{100 * res['floor_ratio']:>11.1f}%\n")
    if "hf_step_ms" in res:
        w(f"\nside by side, same weights, batch and context (Hugging Face: {res['hf_class']}, bf16, bare forward "
          f"loop):\n")
        w(f"{'':<32}{'pegainfer':>12}{'HF':>12}{'HF / ours':>12}\n")
        ours, theirs = res["step_ms"]["p50"], res["hf_step_ms"]["p50"]
        w(f"{'decode step p50 ms':<32}{ours:>12.3f}{theirs:>12.3f}{theirs / ours:>11.1f}x\n")
    if "hf_error" in res:
        w(f"{'hf_error':<32}{res['hf_error']}\n")


def _print_table(res) -> None:
    w = sys.stdout.write
    w(f"\nmodel {res['model']} ({res['arch']})  prompt {res['prompt_len']}  output {res['output_len']}  "
      f"runs {res['runs']}  cuda_graph {res['cuda_graph']}{'  (SIMULATOR)' if res['simulator'] else ''}\n")
    w(f"{'metric':<28}{'p50':>12}{'p90':>12}{'p99':>12}\n")
    for k in ("ttft_ms", "tpot_ms"):
        w(f"{k:<28}" + "".join(f"{res[k][p]:>12.3f}" for p in ("p50", "p90", "p99")) + "\n")
    w(f"{'tok/s (1/TPOT p50)':<28}{res['tok_s']:>12.1f}\n")
    fb = res["floor_bytes"]
    w(f"{'weight bytes (on device) MB':<28}{res['weight_bytes'] / 1e6:>12.3f}\n")
    w("bytes per decode step, MB (the floor's numerator):\n")
    w(f"{'  weights read':<28}{fb['weights_read'] / 1e6:>12.3f}\n")
    w(f"{'  recurrent state r+w':<28}{fb['recurrent_state_rw'] / 1e6:>12.3f}\n")
    w(f"{'  KV read (ctx ' + format(fb['kv_context_tokens'], 'g') + ')':<28}{fb['kv_read'] / 1e6:>12.3f}\n")
    w(f"{'  total':<28}{fb['total'] / 1e6:>12.3f}\n")
    if "floor_tpot_ms" in res:
        w(f"{'read bandwidth':<28}{res['read_bandwidth_GBps']:>10.0f}GB/s\n")
        w(f"{'floor TPOT (bytes/bw) ms':<28}{res['floor_tpot_ms']:>12.3f}\n")
        w(f"{'floor / TPOT p50':<28}{100 * res['floor_ratio']:>11.1f}%\n")
    if "hf_ttft_ms" in res:
        kernels = (f"; its linear-attention kernels installed: {res['hf_fast_kernels']}"
                   if "hf_fast_kernels" in res else "")
        w(f"\nside by side, same weights and prompt length (Hugging Face: {res['hf_class']}, bf16{kernels}):\n")
        w(f"{'':<28}{'pegainfer':>12}{'HF':>12}{'HF / ours':>12}\n")
        rows = (("TTFT p50 ms", res["ttft_ms"]["p50"], res["hf_ttft_ms"]["p50"]),
                ("TPOT p50 ms", res["tpot_ms"]["p50"], res["hf_forward_loop_tpot_ms"]))
        for name, ours, theirs in rows:
            w(f"{name:<28}{ours:>12.3f}{theirs:>12.3f}{theirs / ours:>11.1f}x\n")
        w(f"{'HF generate() tok/s':<28}{'':>12}{res['hf_generate_tok_s']:>12.1f}   (prefill included)\n")
    if "hf_error" in res:
        w(f"{'hf_error':<28}{res['hf_error']}\n")
