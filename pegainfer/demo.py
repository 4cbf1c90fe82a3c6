"""A built-in tiny Qwen3 with RANDOM weights, so pegainfer runs end to end (CLI, server, tests) with no download.

``ensure_demo_model()`` builds it once in ``$PEGAINFER_CACHE/demo-qwen3`` (default ``~/.cache/pegainfer``): a
real Hugging Face folder — ``config.json``, ``generation_config.json``, bf16 ``model.safetensors`` with the
standard tensor names, a byte-level BPE ``tokenizer.json`` trained on the short corpus below and a
``tokenizer_config.json`` with a Qwen3-style ChatML chat template — that ``transformers`` loads as well, which is
what lets tests compare pegainfer against it.  The text it generates is gibberish: the weights are random.

So that the gibberish is at least visible, the embedding rows (tied: also the LM head's) of tokens that print
nothing on their own — lone bytes of multi-byte characters (shown as ``�``), control characters, whitespace,
special and added tokens, the spare ids the tokenizer does not know — are scaled down by ``QUIET_ROW_SCALE``:
their logits stay near 0 while a printable word piece's reach several units, so greedy decoding and the default
top-k sampling pick printable pieces, and sampling from the whole vocabulary almost always does.

Shape (deliberately small so the CUDA simulator can run it): hidden 64, 2 layers, 4 query heads and 2 KV heads
of 16 dims, MLP 128, tied embeddings, 512 positions.  As in real Qwen3 the embedding has more rows than the
tokenizer has tokens, so a model can emit ids the tokenizer does not know.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

DEMO_NAME = "demo-qwen3"
DEMO_VERSION = 2   # bump when the demo's content changes: older cached copies are rebuilt
TOKENIZER_VOCAB = 448  # target size of the trained BPE vocabulary (256 bytes + merges), before special tokens
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EXTRA_TOKENS = ("<think>", "</think>")  # added (not special) tokens, as in Qwen3
QUIET_ROW_SCALE = 1 / 32  # embedding rows of tokens that print nothing visible are scaled by this (module docstring)

# Qwen2/Qwen3's pre-tokenizer split (contractions, letters, single digits, punctuation runs, whitespace)
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

DEMO_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and predicts the next
one. It turns each token into a vector, mixes the vectors with attention, and turns the last vector back into a
score for every token in the vocabulary. Sampling picks one of the likely tokens, appends it, and the model runs
again. This is how a chat assistant writes its answer, one token at a time.

Once upon a time there was a small village by the sea. Every morning the fishermen went out in their boats, and
every evening they came home with baskets full of fish. The children played on the beach, built castles in the
sand, and listened to the old sailors telling stories about storms, islands and the stars that guide ships at
night. The baker opened the shop early, and the smell of fresh bread filled the street.

To make a cup of tea, boil some water, put the leaves in a warm pot, and pour the water over them. Wait three or
four minutes, then pour the tea into a cup. Some people add milk or sugar; others like it plain. Green tea wants
cooler water than black tea. A good cup of tea is a small pleasure on a cold and rainy afternoon.

A graphics processor has thousands of small cores that run the same program on different data. Memory bandwidth
is often the limit: to generate one token, the model must read all of its weights from memory. Batching many
requests together lets the processor reuse each weight for several tokens, which makes the whole system faster.
The cache of keys and values remembers what the model has already seen, so the prompt is read only once.

Hello! How are you today? I am fine, thank you. What would you like to talk about? We could talk about the
weather, about books, about music, or about the history of science. Numbers such as 1, 2, 3, 42, 100 and 2025
appear in text too, and so do questions, answers, lists, and short replies like yes, no, and maybe.

The river flows from the mountains to the sea. In spring the snow melts and the water rises; in summer the river
is calm and warm. Birds sing in the trees along the banks, and deer come down to drink in the evening light.
People have lived beside rivers for thousands of years, because water brings life, food, and a road to travel.
"""

# A Qwen3-style ChatML template: system/user/assistant/tool turns, <think> blocks stripped from earlier assistant
# turns, ``add_generation_prompt`` and ``enable_thinking`` (false → an empty think block, as Qwen3 does).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if '</think>' in content and not loop.last %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# hidden 64, 2 layers, 4 q heads / 2 kv heads of 16, MLP 128 (vocab and token ids are filled in from the tokenizer)
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


# ------------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(corpus: str, vocab_size: int, out_path, special_tokens=SPECIAL_TOKENS,
                    extra_tokens=EXTRA_TOKENS):
    """Train a Qwen-style byte-level BPE on ``corpus`` and save it as ``tokenizer.json`` at ``out_path``.

    ``vocab_size`` counts the 256 byte tokens plus merges; ``special_tokens`` and ``extra_tokens`` are appended
    after them (ids ``vocab_size`` …), as Qwen3 places ``<|endoftext|>`` etc. after its BPE vocabulary.  Every
    UTF-8 string encodes (unknown characters fall back to their bytes).  Returns the ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def _tokenizer_config(tok, max_len: int) -> dict:
    added = {}
    for t in (*SPECIAL_TOKENS, *EXTRA_TOKENS):
        added[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": t in SPECIAL_TOKENS}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": max_len, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
    }


# ------------------------------------------------------------------------------------------------ weights
def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def qwen3_tensor_shapes(cfg: dict, tie: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor names → shapes of a dense Qwen3 described by the config dict ``cfg``."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes["model.norm.weight"] = (h,)
    if not tie:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_random_qwen3(folder, config_overrides: dict | None = None, seed: int = 0, tie: bool = True,
                       dtype: str = "bfloat16", shards: int = 1, quiet_rows=()) -> Path:
    """Write ``config.json`` and random weights of a tiny dense Qwen3 into ``folder`` (created if needed).

    ``config_overrides`` update ``TINY_QWEN3`` (e.g. ``{"num_hidden_layers": 3, "vocab_size": 256}``).
    Weights: projections ~ N(0, 1/fan_in) so activations stay O(1); embeddings ~ N(0, 0.5²) so logits are
    peaked enough for greedy decoding to be stable under bf16 rounding; norm weights 1 + N(0, 0.1²) so a norm
    whose weight is ignored is caught.  ``quiet_rows``: token ids whose embedding (and LM head) rows are scaled by
    ``QUIET_ROW_SCALE``, so the model rarely emits them.  ``dtype``: "bfloat16" | "float16" | "float32" on disk.
    ``shards > 1`` writes ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.  Returns the
    folder."""
    import ml_dtypes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_QWEN3, **(config_overrides or {}), "tie_word_embeddings": bool(tie), "torch_dtype": dtype}
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[dtype]
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in qwen3_tensor_shapes(cfg, tie).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or "lm_head" in name:
            w = 0.5 * rng.standard_normal(shape)
            w[list(quiet_rows)] *= QUIET_ROW_SCALE
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = np.ascontiguousarray(w.astype(np.float32).astype(np_dtype))

    names = list(tensors)
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for k in range(shards):
            part = {n: tensors[n] for n in names[k::shards]}
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
            total += sum(t.nbytes for t in part.values())
        _write_json(folder / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(folder / "config.json", cfg)
    return folder


# ------------------------------------------------------------------------------------------------ the demo
def demo_dir(cache_dir=None) -> Path:
    base = cache_dir or os.environ.get("PEGAINFER_CACHE") or Path.home() / ".cache" / "pegainfer"
    return Path(base).expanduser() / DEMO_NAME


def _is_current(folder: Path) -> bool:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (cfg.get("pegainfer_demo") is True and cfg.get("pegainfer_demo_version") == DEMO_VERSION
            and all((folder / f).is_file() for f in ("model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json", "generation_config.json")))


def prints_visibly(text: str) -> bool:
    """Whether a token's text shows something on its own: whole characters (no ``�``), at least one that is not
    whitespace, none that is a control character (a newline is allowed)."""
    return (bool(text) and "\ufffd" not in text and any(not c.isspace() for c in text)
            and all(c.isprintable() or c == "\n" for c in text))


def quiet_token_ids(tok, vocab_size: int) -> list[int]:
    """The ids below ``vocab_size`` that print nothing visible on their own: the tokenizer's tokens that fail
    ``prints_visibly``, its special and added tokens, and the spare ids it does not know."""
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    added = {tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *EXTRA_TOKENS)}
    return [i for i in range(vocab_size)
            if i >= n_tokens or i in added or not prints_visibly(tok.decode([i], skip_special_tokens=False))]


def _build(folder: Path) -> None:
    tok = train_tokenizer(DEMO_CORPUS, TOKENIZER_VOCAB, folder / "tokenizer.json")
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-(n_tokens + 16) // 64) * 64  # ≥ 16 spare ids, a multiple of 64, as Qwen3 pads its embedding
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    write_random_qwen3(folder, {"vocab_size": vocab, "bos_token_id": endoftext, "eos_token_id": im_end}, seed=0,
                       quiet_rows=quiet_token_ids(tok, vocab))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update({"pegainfer_demo": True, "pegainfer_demo_version": DEMO_VERSION})
    _write_json(folder / "config.json", cfg)
    _write_json(folder / "generation_config.json", {
        "bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext,
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(tok, cfg["max_position_embeddings"]))
    (folder / "README.md").write_text(
        "# pegainfer demo model (random weights)\n\n"
        "A tiny Qwen3 (hidden 64, 2 layers, 4 query / 2 KV heads, vocabulary "
        f"{vocab} with {n_tokens} tokenizer tokens) built by `pegainfer.demo.ensure_demo_model()`.\n\n"
        "**The weights are random**: the model produces gibberish.  It exists so pegainfer's CLI, server and tests\n"
        "run without downloading anything.  The tokenizer is a byte-level BPE trained on a few English paragraphs;\n"
        "the embedding rows of tokens that print nothing visible on their own are scaled down, so the gibberish is\n"
        "made of printable word pieces.\n"
        "Delete this folder to rebuild it.\n", encoding="utf-8")


def ensure_demo_model(cache_dir=None) -> Path:
    """Return the demo model folder, building it first if it is missing or outdated.

    Built in a temporary sibling folder and renamed into place, so a crash or a concurrent build never leaves a
    half-written model behind (the loser of a race keeps the winner's copy)."""
    folder = demo_dir(cache_dir)
    if _is_current(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=folder.parent))
    try:
        _build(tmp)
        if folder.exists() and not _is_current(folder):  # an outdated or broken copy: move it away first
            old = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.old-", dir=folder.parent))
            try:
                os.rename(folder, old / DEMO_NAME)
            except OSError:
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _is_current(folder):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
