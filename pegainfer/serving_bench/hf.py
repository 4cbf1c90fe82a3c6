"""The peer of ``bench-serve --hf``: Hugging Face transformers' continuous batching on the same requests — the same
prompt token ids, the same output lengths (end-of-sequence off), greedy, bf16, in one process on the GPU.

It uses the ``ContinuousBatchingManager`` behind ``model.generate_batch`` (transformers 5.x), because
``generate_batch`` takes one ``max_new_tokens`` for every request while a length mix needs one per request: the
manager is started (its warm-up captures its graphs), a few short requests run untimed, then every request is
added at once and the wall time runs until the last one finishes.  There is no HTTP, no arrival schedule and no
concurrency limit: transformers' scheduler admits what its cache holds, so compare its throughput with
``bench-serve`` at ``--request-rate inf`` (the default).

torch and transformers are benchmark-only peers: imported inside ``hf_continuous_batching`` only.
"""
from __future__ import annotations

import inspect
import time
from typing import Sequence

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 4


def _collect(manager, request_ids: set, timeout_s: float) -> dict:
    """Wait for every id in ``request_ids`` to finish; returns id -> GenerationOutput."""
    done = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is not None:
            if result.request_id in request_ids and result.is_finished():
                done[result.request_id] = result
        elif not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread stopped before every request finished")
        if time.monotonic() > deadline:
            raise RuntimeError(f"transformers' continuous batching did not finish in {timeout_s:.0f} s")
    return done


def hf_continuous_batching(folder: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                           device: str = "cuda", timeout_s: float = 3600.0, cb_config=None) -> dict:
    """Run ``prompts`` (token ids) with ``output_lens`` new tokens each through transformers' continuous batching;
    returns ``hf_class``, ``hf_duration_s``, ``hf_completed``, ``hf_failed``, ``hf_total_output_tokens`` and the
    throughputs ``hf_request_throughput``, ``hf_output_throughput``, ``hf_total_token_throughput`` (per second of
    wall time).  ``device="cpu"`` only checks the code path; ``cb_config``: a ``ContinuousBatchingConfig`` (None:
    transformers sizes its cache from free memory)."""
    import torch
    from transformers import GenerationConfig

    from pegainfer.bench import hf_model_class

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA GPU")
    cls = hf_model_class(folder)
    model = cls.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    gen = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False)
    kwargs = {"generation_config": gen, "block": True, "timeout": 30}
    if cb_config is not None:
        kwargs["continuous_batching_config"] = cb_config
    params = inspect.signature(model.continuous_batching_context_manager).parameters
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                                                 max_generated_length=max(output_lens), num_requests=len(prompts))
    res = {"hf_class": cls.__name__}
    # no_grad, not inference_mode: the manager's thread updates in place tensors made here, which inference mode
    # would make inference tensors (transformers 5.17 then fails: "Inplace update to inference tensor outside
    # InferenceMode")
    with torch.no_grad(), model.continuous_batching_context_manager(**kwargs) as manager:
        warm = [f"warm{i}" for i in range(min(WARMUP_REQUESTS, len(prompts)))]
        for rid, ids in zip(warm, prompts):
            manager.add_request(list(ids), request_id=rid, max_new_tokens=WARMUP_TOKENS, eos_token_id=-1)
        _collect(manager, set(warm), timeout_s)
        if device == "cuda":
            torch.cuda.synchronize()
        ids = [f"req{i}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        for rid, p, n in zip(ids, prompts, output_lens):
            manager.add_request(list(p), request_id=rid, max_new_tokens=int(n), eos_token_id=-1)
        done = _collect(manager, set(ids), timeout_s)
        duration = time.perf_counter() - t0
    ok = [i for i, rid in enumerate(ids) if done[rid].error is None]
    n_in = sum(len(prompts[i]) for i in ok)
    n_out = sum(len(done[ids[i]].generated_tokens) for i in ok)
    res.update({"hf_duration_s": duration, "hf_completed": len(ok), "hf_failed": len(ids) - len(ok),
                "hf_total_output_tokens": n_out, "hf_request_throughput": len(ok) / duration,
                "hf_output_throughput": n_out / duration, "hf_total_token_throughput": (n_in + n_out) / duration})
    model = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return res
