"""Shallow models at full served width for the GPU accuracy and race tests: Qwen3-4B's and Qwen3.5-4B's hidden
size, heads, intermediate size and vocabulary, but 2-3 layers, so bf16 noise has few layers to grow through and a
per-position bound against Hugging Face can be tight.  Written by transformers (random weights, random -- not
all-ones -- norm weights) on the GPU; the same helpers take a device and a shape, so the checks also run at tiny
size on CPU torch and the simulator.

``check_against_hf`` scores a prompt in one prefill step (every row at once, so the projections and the LM head take
their tensor-core GEMM paths for T > 16, not 16-token chunks), runs greedy decode steps, and holds every position to
the per-position bounds of its docstring against HF bf16 and HF fp32."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from tests.util import bf16_round, greedy_decode, record_gpu_result, rel_l2

SHALLOW_QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=3, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
SHALLOW_QWEN35_4B = dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                          "partial_rotary_factor": 0.25})


MEAN_FP32_RATIO = 1.05   # check_against_hf: mean over positions of (ours vs fp32) / (HF bf16 vs fp32)


def models_root(tmp_path_factory) -> Path:
    """$PEGAINFER_GPU_MODELS (folders reused across runs) or a pytest tmp dir."""
    return Path(os.environ.get("PEGAINFER_GPU_MODELS") or tmp_path_factory.getbasetemp() / "gpu_models")


def _randomize_norms(model, torch, plain_weight) -> None:
    """Norm weights drawn at random, so a norm whose weight is ignored or misread is caught: ``plain_weight(name)``
    norms (``x * w``, initialised to ones) get ``1 + 0.2 N(0, 1)``, the others (``x * (1 + w)``, zeros) ``0.2 N``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if plain_weight(name) else 0.0) + 0.2 * torch.randn_like(p))


def _write(model, folder: Path) -> Path:
    tmp = folder.parent / (folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    from pegainfer.demo import ensure_demo_model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, tmp / name)
    tmp.rename(folder)
    return folder


def make_shallow_qwen3(folder: Path, shape: dict = SHALLOW_QWEN3_4B, seed: int = 0, device: str = "cuda") -> Path:
    """A random-weight ``Qwen3ForCausalLM`` of ``shape`` with random norm weights, in bf16 (reused when present)."""
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.Qwen3Config(eos_token_id=151645, bos_token_id=151643, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg)
    _randomize_norms(model, torch, plain_weight=lambda name: True)
    _write(model.to(torch.bfloat16), folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def make_shallow_qwen35(folder: Path, shape: dict = SHALLOW_QWEN35_4B, seed: int = 0, device: str = "cuda") -> Path:
    """A random-weight ``Qwen3_5ForCausalLM`` of ``shape`` (Gated DeltaNet and full-attention layers) with random norm
    weights, in bf16 (reused when present)."""
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.Qwen3_5TextConfig(bos_token_id=None, eos_token_id=None, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM(cfg)
    # the gated RMSNorm of the linear-attention output is a plain weight; every other Qwen3.5 norm is (1 + w)
    _randomize_norms(model, torch, plain_weight=lambda name: name.endswith("linear_attn.norm.weight"))
    _write(model.to(torch.bfloat16), folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def hf_logits(model_class, folder, ids, dtype, attn: str = "sdpa", device: str = "cuda") -> np.ndarray:
    """Hugging Face logits (teacher forcing) of one sequence in ``dtype`` with attention ``attn``: float32 ``[T, V]``."""
    import torch

    ref = model_class.from_pretrained(folder, dtype=dtype, attn_implementation=attn).to(device).eval()
    with torch.inference_mode():
        out = ref(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def score_in_one_step(folder: Path, prompt: list[int], decode_steps: int, device: str = "cuda"):
    """pegainfer's logits at every prompt position from ONE prefill step of ``len(prompt)`` rows, then the logits of
    ``decode_steps`` greedy steps (the first from the request's own prefill, the rest decode steps; CUDA graphs on
    a GPU): (prompt logits ``[T, V]``, greedy tokens, step logits ``[decode_steps, V]``)."""
    import pegainfer.engine.engine as engine_module
    from pegainfer.engine.engine import Engine

    n = len(prompt)
    saved = engine_module.SCORE_ROWS
    engine_module.SCORE_ROWS = n     # read by Engine.from_folder: logits rows per step, score()'s chunk
    try:
        engine = Engine.from_folder(str(folder), max_model_len=max(2 * n, n + decode_steps + 16),
                                    max_num_batched_tokens=n, use_cuda_graph=device == "cuda")
    finally:
        engine_module.SCORE_ROWS = saved
    assert min(engine.model.max_rows, engine.model.max_tokens) >= n, "score() would split the prompt"
    ours_prompt = engine.score(prompt)
    tokens, step_logits = greedy_decode(engine, prompt, decode_steps, "shallow")
    assert engine.stats()["slots_used"] == 0 and len(tokens) == decode_steps
    del engine
    return ours_prompt, tokens, np.stack(step_logits)


def check_against_hf(model_class, folder: Path, prompt_len: int, decode_steps: int, name: str,
                     device: str = "cuda", prompt_vocab: int = 150000) -> dict:
    """Per position, for the ``prompt_len`` prompt rows and the ``decode_steps`` greedy steps (teacher-forced in HF):

    * against HF bf16 (sdpa): ``ours_vs_bf16[t] <= max(rounding[t], bf16_vs_fp32[t], 1.5 * eager_vs_sdpa[t])`` --
      no further from HF's bf16 forward than that forward is from the exact model, or than HF's two attention
      backends are from each other, at that very position.  ``rounding[t]`` is one bf16 rounding of the fp32 logits
      row (~2e-3), the floor two near-bit-equal implementations can sit at.  At full width HF's GEMMs (cuBLAS) sum
      in another order than ours, so the two bf16 forwards are independent bf16 implementations that round at the
      same points: measured on the H200 (2026-12-02) ours sat at <= 0.84x HF bf16's own error at every position
      (mean 0.4-0.7x), the prompt's first position (one key: HF's two backends agree there) the closest.
    * against HF fp32 (the second reference): ``ours_vs_fp32[t] <= max(1.2 * bf16_vs_fp32[t], 1.1 *
      eager_vs_fp32[t])`` -- no position more than 20 % further from the exact model than HF's bf16 forward (sdpa)
      is, or 10 % further than HF's eager bf16 forward when that one is the further at this position (the
      per-position ratio of two valid bf16 forwards is not always under 1.2: HF eager sat at 1.41x sdpa's
      distance at one position).  Measured: <= 1.07x.
    * on average over the positions of each part (prompt, decode): ``mean(ours_vs_fp32 / bf16_vs_fp32) <= 1.05``.
      Two valid bf16 forwards are equally far from the exact model on average (measured 0.999-1.004); an extra
      error independent of bf16 rounding adds in quadrature, so one of a third of HF bf16's own (~0.6 % of the
      logits' norm at these shapes, HF bf16 sitting ~1.7 % from fp32) fails.

    Prints (and records) every ratio's maximum and mean."""
    import torch

    prompt = np.random.default_rng(0).integers(0, prompt_vocab, size=prompt_len).tolist()
    t0 = time.perf_counter()
    ours_prompt, tokens, ours_steps = score_in_one_step(folder, prompt, decode_steps, device)
    ours_s = time.perf_counter() - t0
    full = prompt + tokens[:-1]
    sdpa = hf_logits(model_class, folder, full, torch.bfloat16, "sdpa", device)
    eager = hf_logits(model_class, folder, full, torch.bfloat16, "eager", device)
    fp32 = hf_logits(model_class, folder, full, torch.float32, "sdpa", device)

    n = prompt_len
    entry = {"test": "shallow_full_width_accuracy", "model": name, "prompt_len": n, "decode_steps": decode_steps,
             "engine_s": round(ours_s, 1)}
    failures = []
    parts = {"prompt": (ours_prompt, range(n)), "decode": (ours_steps, range(n - 1, n - 1 + decode_steps))}
    for part, (ours, rows) in parts.items():
        e = {k: [] for k in ("ours_vs_bf16", "ours_vs_fp32", "bf16_vs_fp32", "eager_vs_sdpa", "eager_vs_fp32",
                             "rounding", "bf16_ratio", "fp32_ratio")}
        identical = 0
        for i, r in enumerate(rows):
            ob, of = rel_l2(ours[i], sdpa[r]), rel_l2(ours[i], fp32[r])
            hf, spread = rel_l2(sdpa[r], fp32[r]), rel_l2(eager[r], sdpa[r])
            eager_fp32 = rel_l2(eager[r], fp32[r])
            rounding = rel_l2(bf16_round(fp32[r]), fp32[r])
            bound = max(rounding, hf, 1.5 * spread)
            identical += bool(np.array_equal(ours[i], sdpa[r]))
            for k, v in (("ours_vs_bf16", ob), ("ours_vs_fp32", of), ("bf16_vs_fp32", hf), ("eager_vs_sdpa", spread),
                         ("eager_vs_fp32", eager_fp32), ("rounding", rounding),
                         ("bf16_ratio", ob / bound), ("fp32_ratio", of / hf)):
                e[k].append(v)
            if not ob <= bound:
                failures.append((part, r, "vs HF bf16", round(ob, 5), "bound", round(bound, 5)))
            if not of <= max(1.2 * hf, 1.1 * eager_fp32):
                failures.append((part, r, "vs HF fp32", round(of, 5), "HF bf16 (sdpa, eager) vs fp32",
                                 round(hf, 5), round(eager_fp32, 5)))
        entry[f"{part}_rows_bit_identical_to_hf_bf16"] = identical
        for k, v in e.items():
            entry[f"{part}_{k}_max"] = float(np.max(v))
            entry[f"{part}_{k}_mean"] = float(np.mean(v))
        # HF eager's own distance from fp32 relative to sdpa's: the 1.2 margin of the fp32 check, as HF meets it
        entry[f"{part}_hf_eager_fp32_ratio_max"] = float(np.max(np.array(e["eager_vs_fp32"]) / np.array(e["bf16_vs_fp32"])))
        mean_fp32 = float(np.mean(e["fp32_ratio"]))
        if not mean_fp32 <= MEAN_FP32_RATIO:
            failures.append((part, "mean over positions", "vs HF fp32 / HF bf16 vs fp32", round(mean_fp32, 4),
                             "bound", MEAN_FP32_RATIO))
    d_rows = range(n - 1, n - 1 + decode_steps)
    entry["greedy_agreement_with_hf_bf16"] = float(np.mean([int(np.argmax(sdpa[r])) == t for r, t in zip(d_rows, tokens)]))
    record_gpu_result(entry)
    assert not failures, f"{name}: {len(failures)} positions over the bound, first: {failures[:6]}"
    return entry
