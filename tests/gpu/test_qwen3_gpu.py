"""GPU accuracy check at full Qwen3-4B / Qwen3-8B shapes (random bf16 weights made by transformers on the GPU),
against Hugging Face bf16 on the same GPU. Skipped without a GPU.

Folders are written under $PEGAINFER_GPU_MODELS (default: a pytest tmp dir) and reused when present. Results are
appended as JSON lines to $PEGAINFER_GPU_RESULTS when set (the lead copies them into benchmarks/RESULTS.md)."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.util import rel_l2

pytestmark = pytest.mark.gpu

SHAPES = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
PROMPT_LEN = 128
DECODE_STEPS = 64


def make_random_qwen3(folder: Path, shape: dict, seed: int = 0) -> Path:
    """Write a random-weight Qwen3 of the given shape with transformers (on the GPU), plus the demo tokenizer."""
    import shutil

    import torch
    import transformers
    from pegainfer.demo import ensure_demo_model

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.Qwen3Config(max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                   eos_token_id=151645, bos_token_id=151643, **shape)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    tmp = folder.with_suffix(".tmp")
    model.save_pretrained(tmp)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    tmp.rename(folder)
    return folder


def _record(entry):
    path = os.environ.get("PEGAINFER_GPU_RESULTS")
    print(json.dumps(entry))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.mark.parametrize("name", list(SHAPES))
def test_qwen3_matches_hf_bf16_on_gpu(name, tmp_path_factory):
    import torch
    import transformers
    from pegainfer.engine.engine import Engine
    from pegainfer.engine.types import SamplingParams

    root = Path(os.environ.get("PEGAINFER_GPU_MODELS") or tmp_path_factory.mktemp("gpu_models"))
    folder = make_random_qwen3(root / name, SHAPES[name])
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150000, size=PROMPT_LEN).tolist()

    # Hugging Face bf16 reference first (then freed), so both fit comfortably.
    ref = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        hf_prompt_logits = ref(torch.tensor([prompt], device="cuda")).logits[0].float().cpu().numpy()

    t0 = time.perf_counter()
    engine = Engine.from_folder(str(folder), max_model_len=4096, use_cuda_graph=True)
    load_s = time.perf_counter() - t0
    ours_prompt = engine.score(prompt)
    prompt_errs = [rel_l2(ours_prompt[t], hf_prompt_logits[t]) for t in range(PROMPT_LEN)]

    engine.add_request("gpu", prompt, SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True))
    tokens, step_logits = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                tokens.extend(out.new_token_ids)
                step_logits.append(engine.runner.logits_host(1)[0].copy())
    with torch.inference_mode():
        full = torch.tensor([prompt + tokens[:-1]], device="cuda")
        hf = ref(full).logits[0, PROMPT_LEN - 1:].float().cpu().numpy()
    decode_errs = [rel_l2(step_logits[i], hf[i]) for i in range(DECODE_STEPS)]
    agree = float(np.mean([int(np.argmax(hf[i])) == tokens[i] for i in range(DECODE_STEPS)]))
    _record({"test": "qwen3_accuracy", "model": name, "load_s": round(load_s, 1),
             "prompt_rel_l2_max": max(prompt_errs), "prompt_rel_l2_mean": float(np.mean(prompt_errs)),
             "decode_rel_l2_max": max(decode_errs), "decode_rel_l2_mean": float(np.mean(decode_errs)),
             "greedy_agreement": agree})
    del ref
    torch.cuda.empty_cache()
    assert max(prompt_errs) < 2e-2
    assert max(decode_errs) < 2e-2
    assert agree >= 0.95
