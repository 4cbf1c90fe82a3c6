"""Incremental detokenization: turn a stream of token ids into a stream of text, one token at a time.

Decoding each token on its own is wrong in two ways: a byte-level BPE token can hold part of a UTF-8 character
(its text alone is U+FFFD), and tokenizers that mark word starts (SentencePiece's "▁") drop the leading space of
the first token of a decode.  So, like vLLM's ``detokenize_incrementally``, we decode a short window of the
previous tokens twice::

    ids:   ... | prefix_offset ........ read_offset | new tokens
    prefix_text = decode(ids[prefix_offset:read_offset])     text already sent, seen in context
    full_text   = decode(ids[prefix_offset:])                the same context plus what is new
    delta       = full_text[len(prefix_text):]

and send ``delta`` only when it grew and does not end in U+FFFD (an unfinished character: wait for the next token).
Then the window slides: ``prefix_offset, read_offset = read_offset, len(ids)``.  Each push decodes a few tokens, so
the cost per token is constant however long the output gets.

Byte-level BPE tokenizers whose decoder is ByteLevel alone (Qwen3's and Qwen3.5's, ``Tokenizer.decodes_by_bytes``)
take a shorter way to the same text: their decode is the tokens' bytes concatenated and read as UTF-8, so each push
feeds one token's bytes (``Tokenizer.piece_bytes``) to an incremental UTF-8 decoder, which returns the whole
characters and holds an unfinished one back -- a dictionary lookup instead of two decodes of the window, for every
token of every stream on the engine's thread.
"""
from __future__ import annotations

import codecs
from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5   # prompt tokens kept as context for the first output token (vLLM uses 5 too)
_TRIM_AT = 256              # drop ids before the window once this many have piled up


class IncrementalDetokenizer:
    """``push(token_id) -> str`` gives the newly completed text (whole characters only); ``flush()`` the rest."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = (codecs.getincrementaldecoder("utf-8")("replace")
                      if getattr(tokenizer, "decodes_by_bytes", False) else None)
        context = [int(t) for t in list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # everything returned so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (not final and full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self._prefix_offset >= _TRIM_AT:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is unfinished)."""
        if self._utf8 is not None:
            delta = self._utf8.decode(self.tokenizer.piece_bytes(token_id, self.skip_special_tokens))
            self.text += delta
            return delta
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD): call once when the output ends."""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
            self.text += delta
            return delta
        if self._read_offset >= len(self._ids):
            return ""
        return self._advance(final=True)
