"""The built-in demo model: built once and atomically, loadable by transformers and tokenizers, sane tokenizer."""
import json

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from pegainfer.config import load_generation_config, load_model_config
from pegainfer.demo import (DEMO_CORPUS, DEMO_NAME, DEMO_VERSION, QUIET_ROW_SCALE, ensure_demo_model,
                            prints_visibly, quiet_token_ids, train_tokenizer, write_random_qwen3)
from pegainfer.weights import WeightReader


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_built_once(tmp_path):
    folder = ensure_demo_model(tmp_path)
    assert folder == tmp_path / DEMO_NAME
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]   # no temp folders left behind


def test_cache_env_and_outdated_copy_rebuilt(tmp_path, monkeypatch):
    """``$PEGAINFER_CACHE`` is where the demo lives; a copy there is rebuilt when it is of an older version (every
    file present) or misses a file, and kept when current."""
    monkeypatch.setenv("PEGAINFER_CACHE", str(tmp_path))
    stale = tmp_path / DEMO_NAME
    stale.mkdir()
    (stale / "config.json").write_text(json.dumps({"pegainfer_demo": True, "pegainfer_demo_version": -1}))
    folder = ensure_demo_model()
    assert folder == stale and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["pegainfer_demo_version"] == DEMO_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]

    def mark_and_set_version(version):
        (folder / "marker").write_text("of the copy before")
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "pegainfer_demo_version": version}))

    mark_and_set_version(DEMO_VERSION)            # current: kept as it is
    assert ensure_demo_model() == folder and (folder / "marker").is_file()
    mark_and_set_version(DEMO_VERSION - 1)        # complete but older: rebuilt
    assert ensure_demo_model() == folder and not (folder / "marker").exists()
    assert json.loads((folder / "config.json").read_text())["pegainfer_demo_version"] == DEMO_VERSION
    mark_and_set_version(DEMO_VERSION)
    (folder / "generation_config.json").unlink()  # current but incomplete: rebuilt
    assert ensure_demo_model() == folder and not (folder / "marker").exists()
    assert (folder / "generation_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]


def test_deterministic(tmp_path):
    a, b = ensure_demo_model(tmp_path / "a"), ensure_demo_model(tmp_path / "b")
    for f in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json", "tokenizer_config.json",
              "README.md"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_config_and_readme(demo):
    raw = json.loads((demo / "config.json").read_text())
    assert raw["pegainfer_demo"] is True and raw["pegainfer_demo_version"] == DEMO_VERSION
    assert raw["torch_dtype"] == "bfloat16"
    assert "random" in (demo / "README.md").read_text().lower()
    cfg = load_model_config(demo)
    assert cfg.arch == "qwen3" and cfg.weight_prefix == "model."
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.max_position_embeddings) == (64, 2, 4, 2, 16, 128, 512)
    assert cfg.tie_word_embeddings and cfg.vocab_size % 64 == 0
    gen = load_generation_config(demo)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert cfg.eos_token_ids == (im_end,) and cfg.bos_token_id == eot
    assert gen.eos_token_ids == (im_end, eot)
    assert (gen.temperature, gen.top_k, gen.top_p) == (0.6, 20, 0.95)     # sampling, top 20 (the visible tokens)


def test_tokenizer(demo):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    assert 400 <= n <= 500
    cfg = load_model_config(demo)
    assert cfg.vocab_size >= n + 16  # spare embedding rows the tokenizer does not know, as in Qwen3
    for text in ["The quick brown fox jumps over the lazy dog.", "Grüße, naïve café — 你好, мир! 🙂\n\ttabs  ",
                 "unseen words: zyxwvut qqq 1234567890", ""]:
        ids = tok.encode(text).ids
        assert all(0 <= i < n for i in ids)
        assert tok.decode(ids) == text
    # the corpus is compressed by the learned merges
    assert len(tok.encode(DEMO_CORPUS).ids) < len(DEMO_CORPUS.encode()) / 2
    chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = tok.encode(chat).ids
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.token_to_id(special) in ids
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\nassistant\n<think>\n\n</think>\n\n"


def test_prints_visibly():
    for text in ("the", " fox", ".", ".\n", "42", "é"):
        assert prints_visibly(text), text
    for text in ("", " ", "\n\n", "\ufffd", "\x07", "\t", " \r\n"):
        assert not prints_visibly(text), repr(text)


def _f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_the_model_picks_visible_tokens(demo):
    """The rows of tokens that print nothing (lone bytes of multi-byte characters, whitespace, special tokens, the
    spare ids) are scaled down: for any final hidden state, the greedy token and the top 20 (the demo's default
    top-k) print visibly, and sampling from the whole vocabulary picks a silent token rarely."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    r = WeightReader(demo)
    embed = _f32(r.host_bf16("model.embed_tokens.weight"))   # [V, H], also the LM head (tied)
    V = embed.shape[0]
    quiet = np.array(quiet_token_ids(tok, V))
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    assert set(range(n_tokens, V)) <= set(quiet)             # the spare ids
    assert {tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>")} <= set(quiet)
    visible = np.setdiff1d(np.arange(V), quiet)
    assert 250 < visible.size < n_tokens and all(prints_visibly(tok.decode([int(i)])) for i in visible)
    norms = np.linalg.norm(embed, axis=1)
    assert norms[quiet].max() < 4 * QUIET_ROW_SCALE * norms[visible].min()

    rng = np.random.default_rng(0)
    h = rng.standard_normal((2000, embed.shape[1]))
    h /= np.sqrt((h ** 2).mean(axis=1, keepdims=True))          # RMSNorm ...
    h *= _f32(r.host_bf16("model.norm.weight"))                 # ... with the final norm's weight
    logits = h @ embed.T
    assert np.isin(logits.argmax(axis=1), visible).all()
    assert np.isin(np.argsort(-logits, axis=1)[:, :20], visible).all()
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    assert p[:, quiet].sum(axis=1).mean() < 0.01


def test_chat_template(demo):
    """The ChatML template as transformers renders it: system, user and assistant turns, an earlier assistant turn
    without its think block (the last one keeps it), a tool turn as a user's tool response, the generation prompt
    with and without ``enable_thinking``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo)
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
            {"role": "user", "content": "Tea?"}]
    head = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTea?<|im_end|>\n")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        head + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False) == \
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False) == head
    tool = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "<think>\nask\n</think>\n\nChecking."},
            {"role": "tool", "content": "{\"sky\": \"blue\"}"},
            {"role": "assistant", "content": "<think>\nok\n</think>\n\nBlue."}]
    assert tok.apply_chat_template(tool, tokenize=False) == (     # the last turn keeps its think block
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\nChecking.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"sky\": \"blue\"}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nok\n</think>\n\nBlue.<|im_end|>\n")


def test_transformers_loads_the_same_weights(demo):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    hf = {k: v.view(torch.uint16).numpy() if hasattr(torch, "uint16") else v.view(torch.int16).numpy().view(np.uint16)
          for k, v in model.state_dict().items()}
    r = WeightReader(demo)
    assert set(r.names()) == set(hf) - {"lm_head.weight"}
    for name in r.names():
        np.testing.assert_array_equal(r.host_bf16(name), hf[name], err_msg=name)
    np.testing.assert_array_equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])  # tied
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, load_model_config(demo).vocab_size) and torch.isfinite(logits).all()


def test_write_random_qwen3_untied_and_overrides(tmp_path):
    folder = write_random_qwen3(tmp_path, {"num_hidden_layers": 3, "vocab_size": 128, "head_dim": 8}, seed=5,
                                tie=False)
    cfg = load_model_config(folder)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.head_dim, cfg.tie_word_embeddings) == (3, 128, 8, False)
    r = WeightReader(folder)
    assert r.shape("lm_head.weight") == (128, 64) and r.shape("model.layers.2.self_attn.q_proj.weight") == (32, 64)
    norm = r.host_bf16("model.layers.0.input_layernorm.weight").astype(np.uint32) << 16
    assert np.unique(norm).size > 1  # norm weights are not all ones
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert not model.config.tie_word_embeddings and model.lm_head.weight.shape == (128, 64)


def test_train_tokenizer_other_corpus(tmp_path):
    tok = train_tokenizer("aaa bbb aaa bbb ccc " * 50, 270, tmp_path / "t" / "tokenizer.json")
    assert (tmp_path / "t" / "tokenizer.json").is_file()
    assert tok.token_to_id("<|endoftext|>") >= 256 and tok.decode(tok.encode("aaa ddd é").ids) == "aaa ddd é"
