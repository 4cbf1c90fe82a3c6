"""A tiny Qwen3-like model folder for text and server tests: a byte-level BPE ``tokenizer.json`` (trained here on a
few sentences, so no download), a ``tokenizer_config.json`` with Qwen3's special tokens, and Qwen3's real chat
template (``qwen3_chat_template.jinja``, Qwen/Qwen3-4B's ``chat_template``, Apache-2.0)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
QWEN3_TEMPLATE = (HERE / "qwen3_chat_template.jinja").read_text(encoding="utf-8")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<think>", "</think>"]  # added but not special in Qwen3: they survive skip_special_tokens
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small model that answered questions.",
    "user assistant system think tool response <tool_call> </tool_call>",
    "héllo wörld, naïve café — 你好，世界 😀 🚀",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    return tok


def make_model_folder(folder: Path, chat_template: str | None = QWEN3_TEMPLATE, template_in_jinja_file=False) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ chat_template.jinja) into ``folder``; return it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL} for t in SPECIAL + PLAIN_ADDED},
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    if chat_template is not None:
        if template_in_jinja_file:
            (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
        else:
            config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
