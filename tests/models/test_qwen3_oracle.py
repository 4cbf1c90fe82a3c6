"""Hugging Face oracle: tiny random Qwen3 models written by transformers (CPU torch); pegainfer loads the same
folder and must give the same logits (every prompt position and 8 greedy decode steps) and the same greedy tokens."""
import shutil

import numpy as np
import pytest

from tests.util import assert_pdl_contract, greedy_decode, launches_during, rel_l2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LEN = 9
DECODE_STEPS = 8


def _write_tiny_qwen3(folder, tie: bool, seed: int = 0):
    from pegainfer.demo import ensure_demo_model

    cfg = transformers.Qwen3Config(
        vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tie, initializer_range=0.1, bos_token_id=None, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:           # random (not all-ones) norm weights so the norms are really checked
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, folder / name)
    # the oracle: the same bf16 weights, computed in float32
    return transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    from pegainfer.engine.engine import Engine

    folder = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    ref = _write_tiny_qwen3(folder, tie=request.param)
    engine = Engine.from_folder(str(folder), max_model_len=64, use_cuda_graph=False)
    return ref, engine


def _prompt():
    return np.random.default_rng(7).integers(0, 576, size=PROMPT_LEN).tolist()


def test_prompt_logits_match_hf(tiny):
    ref, engine = tiny
    ids = _prompt()
    ours = engine.score(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == theirs.shape
    errs = [rel_l2(ours[t], theirs[t]) for t in range(len(ids))]
    assert max(errs) < 2e-2, errs


def test_greedy_decode_matches_hf(tiny):
    ref, engine = tiny
    ids = _prompt()
    tokens, step_logits = greedy_decode(engine, ids, DECODE_STEPS, "oracle")
    assert len(tokens) == DECODE_STEPS
    with torch.no_grad():
        hf_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                 min_new_tokens=DECODE_STEPS)[0, len(ids):].tolist()
        full = torch.tensor([ids + tokens[:-1]])
        theirs = ref(full).logits[0, len(ids) - 1:].float().numpy()
    assert tokens == hf_tokens
    errs = [rel_l2(step_logits[i], theirs[i]) for i in range(DECODE_STEPS)]
    assert max(errs) < 2e-2, errs
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["slots_used"] == 0


def test_every_step_launch_keeps_the_pdl_contract(tiny):
    """Prefill and decode: every kernel is launched with PDL and waits for its inputs."""
    _, engine = tiny
    assert_pdl_contract(launches_during(lambda: greedy_decode(engine, _prompt(), 2, "pdl")))
