"""A model folder's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, plus what
``tokenizer_config.json`` says about special tokens and the chat template.

Only the fast-tokenizer file is read (no sentencepiece ``.model``, no Python tokenizer classes): every Qwen3 /
Qwen3.5 checkpoint ships one.  Two details the rest of pegainfer relies on:

* Token ids the tokenizer does not know decode to ``""`` and never raise.  Qwen3's embedding has 151936 rows but its
  tokenizer only 151669 tokens, so an (unlikely) sample from the padding rows must not crash a request.
* ``token_str`` / ``token_bytes`` give one token's text and exact bytes for logprob displays: a byte-level BPE token
  may hold half of a UTF-8 character, whose text is U+FFFD but whose bytes are the real ones.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional, Union

import tokenizers
from tokenizers import decoders

from pegainfer.errors import ModelFolderError
from pegainfer.text.folder import read_chat_template_source, read_tokenizer_config, special_tokens

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: byte-level BPE writes byte b as one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _byte_level_bytes(piece: str) -> Optional[bytes]:
    """A byte-level BPE piece's bytes (every character through ``_byte_level_decoder``), or None when a character
    is not in the table (the piece is not byte-level, e.g. an added token's text)."""
    table = _byte_level_decoder()
    return bytes(table[ch] for ch in piece) if all(ch in table for ch in piece) else None


class Tokenizer:
    """Text ↔ token ids for one model.

    ``vocab_size`` counts every id the tokenizer knows, added tokens included (ids ``0 .. vocab_size-1``; there
    may be holes, which decode to ``""``).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: Optional[dict] = None,
                 chat_template: Optional[str] = None, name: str = "tokenizer"):
        self._tk = tokenizer
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.name = name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        # The tokenizers library may number added tokens past get_vocab_size when the base vocabulary has holes.
        added = tokenizer.get_added_tokens_decoder()
        if added:
            self.vocab_size = max(self.vocab_size, max(added) + 1)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        # special token strings (for chat templates: HF passes bos_token, eos_token, ... into the template)
        self.special_tokens: dict[str, str] = special_tokens(self.config)
        self.eos_token_id = self.token_to_id(self.special_tokens.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.pad_token_id = self.token_to_id(self.special_tokens.get("pad_token"))
        self._byte_level = self._is_byte_level(tokenizer.decoder)
        # decode() is the concatenation of each token's bytes, read as UTF-8, when the decoder is ByteLevel alone
        # (Qwen3's and Qwen3.5's): then text can be streamed a token at a time from ``piece_bytes``
        self.decodes_by_bytes = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._piece_bytes: dict[int, bytes] = {}

    @staticmethod
    def _is_byte_level(decoder) -> bool:
        if isinstance(decoder, decoders.ByteLevel):
            return True
        if isinstance(decoder, decoders.Sequence):
            return "ByteLevel" in repr(decoder)
        return False

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: Union[str, Path]) -> "Tokenizer":
        """Load ``tokenizer.json`` and (optionally) ``tokenizer_config.json`` / ``chat_template.jinja``."""
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {folder} does not exist or is not a directory")
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFolderError(f"{folder} has no tokenizer.json: pegainfer needs the fast-tokenizer file that "
                                   f"Hugging Face model repositories ship; download it into the folder")
        try:
            tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for every parse problem
            raise ModelFolderError(f"tokenizer.json in {folder} cannot be read by the tokenizers library "
                                   f"({str(e).strip() or type(e).__name__}): fix or re-download the file") from None
        config = read_tokenizer_config(folder)
        return cls(tk, config, read_chat_template_source(folder, config), name=folder.name)

    # ------------------------------------------------------------------------------------------------ ids
    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        if token is None:
            return None
        return self._tk.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.  Special-token strings in the text (``<|im_start|>``) become their ids, as in HF."""
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def _known(self, ids: Iterable[int]) -> list[int]:
        v = self.vocab_size
        return [int(i) for i in ids if 0 <= int(i) < v]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; unknown ids contribute nothing."""
        known = self._known(ids)
        if not known:
            return ""
        return self._tk.decode(known, skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token's text for logprob displays (special tokens included; U+FFFD for a partial character)."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's exact bytes (a byte-level token may hold part of a UTF-8 character)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            return b""
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._added_ids:
            if self._byte_level:
                got = _byte_level_bytes(piece)
                if got is not None:
                    return got
            m = _BYTE_FALLBACK.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return self.token_str(token_id).encode("utf-8")

    def piece_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes a ByteLevel decoder makes of one token (``decodes_by_bytes`` tokenizers: ``decode(ids)`` is
        these bytes of every id, concatenated, read as UTF-8 with U+FFFD for what is not): each character of the
        token's piece through the byte table, or the piece's own UTF-8 when a character is not in it (an added
        token); ``b""`` for unknown ids and, with ``skip_special_tokens``, for special tokens."""
        token_id = int(token_id)
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        got = self._piece_bytes.get(token_id)
        if got is None:
            piece = self._tk.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
            if piece is None:
                got = b""
            else:
                got = _byte_level_bytes(piece)
                if got is None:
                    got = piece.encode()
            self._piece_bytes[token_id] = got
        return got

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what llguidance builds its vocabulary view from)."""
        return self._tk.to_str()

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"
