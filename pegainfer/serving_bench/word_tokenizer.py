"""A view of a model folder whose tokenizer turns every token id into a word, so that every generated token is
one stream event.

A server sends no stream event for a token whose text is empty or held back (a special token, an id the
tokenizer does not know, part of a UTF-8 character).  A real model rarely emits those; a model with random
weights may emit them often, or nothing else, and then inter-token gaps measured at the client merge.  The view
links every file of the folder (weights, config) except the tokenizer's, and writes a ``tokenizer.json`` that maps
id ``i`` of the embedding to the word ``w{i}`` (decoded with spaces between), so every token has visible text.
Prompts must then be token ids: the model's own tokenizer is gone."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from pegainfer.jsonfile import read_json


def word_tokenizer_view(folder, dest: Optional[str] = None) -> Path:
    """Make the view of ``folder`` (in ``dest``, else a new temporary folder) and return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    src = Path(folder).expanduser().resolve()
    dst = Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="pegainfer-word-tokenizer-"))
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.iterdir():      # a view made before (of this or another model): its links go
        if old.is_symlink():
            old.unlink()
    for name in os.listdir(src):
        if not name.startswith("tokenizer") and name != "chat_template.jinja":
            os.symlink(src / name, dst / name)
    cfg = read_json(src / "config.json")
    vocab_size = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins the words with spaces
    tok.save(str(dst / "tokenizer.json"))
    return dst
