"""vLLM's ``bad_words``: words the output must not contain, as a per-step mask of the tokens that would complete one.

Each word becomes token sequences (``word_token_sequences``, vLLM's rule): its tokens as written, and -- when a
leading space makes a different first token of as many tokens -- those of `` word`` too.  Before each step that
samples the request's next token, ``BadWordsConstraint.fill`` allows every token but a one-token word's and the
last token of each longer word whose other tokens the output ends with; ``accept`` records each token drawn.  It
rides the grammar masks' path (``runner._fill_masks``, ``kernels/token_mask.py``): a request's constraint, filled
on the host, applied on the device.
"""
from __future__ import annotations

import numpy as np


def word_token_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences that spell each of ``words`` (module docstring)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip())
        if not plain:
            continue
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class BadWordsConstraint:
    """A request's bad words as a constraint of ``text/structured.py``'s shape: ``masks``, ``fill``, ``accept``,
    ``finished`` (never: the words only forbid), ``extra_token`` and ``error``."""

    masks = True
    finished = False
    extra_token = None
    error = ""

    def __init__(self, sequences: list[list[int]], vocab_size: int):
        self.single = sorted({s[0] for s in sequences if len(s) == 1 and s[0] < vocab_size})
        self.longer = [s for s in sequences if len(s) > 1]
        self.vocab_size = int(vocab_size)
        self.output: list[int] = []

    def banned(self) -> list[int]:
        """The tokens the next step may not draw."""
        out = set(self.single)
        for s in self.longer:
            k = len(s) - 1
            if len(self.output) >= k and self.output[-k:] == s[:-1] and s[-1] < self.vocab_size:
                out.add(s[-1])
        return sorted(out)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of an int32 bitmask: every token of the vocabulary but the banned ones."""
        words = bitmask[row].view(np.uint32)
        words[:] = np.uint32(0xFFFFFFFF)
        full, rest = divmod(self.vocab_size, 32)
        if rest:
            words[full] = np.uint32((1 << rest) - 1)
        words[full + (1 if rest else 0):] = 0
        for t in self.banned():
            words[t // 32] &= ~np.uint32(1 << (t % 32))

    def accept(self, token: int) -> bool:
        self.output.append(int(token))
        return True
