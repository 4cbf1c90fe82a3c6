"""The requests of a serving benchmark: how long each prompt and each output is, what the prompt holds, and when
each request is sent.

**Lengths** (``request_lengths``), one ``(input tokens, output tokens)`` pair per request:

* ``random``: ``--input-len`` / ``--output-len`` exactly when ``--range-ratio`` is 0, else each drawn uniformly
  from ``[len × (1 - r), len × (1 + r)]`` (at least 1), as ``vllm bench serve``'s random dataset does;
* ``sharegpt``: a built-in synthetic mix shaped like the ShareGPT conversations that serving papers benchmark with
  (no download, no text: only the lengths).  Input and output lengths are drawn independently from log-normal
  distributions, rounded, and clipped to ``[4, 1024]`` each (so input + output ≤ 2048, the filter vLLM applies to
  ShareGPT):

  ========  ================  ======  ======  =====  ===============
  length    log-normal μ, σ   median  mean    p90    clipped at 1024
  ========  ================  ======  ======  =====  ===============
  input     4.45, 1.20        86      ≈ 162   ≈ 400  ≈ 2 %
  output    5.55, 0.85        257     ≈ 342   ≈ 770  ≈ 5 %
  ========  ================  ======  ======  =====  ===============

  The means sit near the ShareGPT statistics of the vLLM paper (161 input / 338 output tokens on average); the
  long right tails (a few prompts ten times the median) are what makes the mix harder to schedule than fixed
  lengths.

**Prompts** (``build_prompts``): ``ids`` sends ``prompt`` as a list of token ids (``/v1/completions`` accepts them),
so the input length is exact; ``text`` sends text made of the tokenizer's own word pieces (tokens that are a space
followed by letters, which re-tokenize to themselves), trimmed so that it encodes to the wanted length — the
server's ``usage.prompt_tokens`` is what the report counts either way.  Token ids are drawn at random (seeded)
from the tokenizer's ordinary tokens, never special ones; without a tokenizer, from ``[0, 256)`` (the byte tokens
every byte-level BPE vocabulary has).

**A shared prefix** (``--prefix-len P``, vLLM's ``--random-prefix-len``): every prompt starts with the same P
tokens (ids, or text of P word pieces), drawn once, then its own tokens: a system prompt many users share, the
load a prefix cache is for (``usage.prompt_tokens_details.cached_tokens`` says how much the server reused).

**Arrivals** (``arrival_times``): all at once for ``--request-rate inf``, else a Poisson process — exponential gaps
of mean ``1 / rate`` seconds, seeded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

SHAREGPT_INPUT = (4.45, 1.20)    # log-normal (μ, σ) of the input length, tokens
SHAREGPT_OUTPUT = (5.55, 0.85)   # log-normal (μ, σ) of the output length, tokens
SHAREGPT_CLIP = (4, 1024)        # each length clipped to this range
FALLBACK_VOCAB = 256             # ids drawn below this without a tokenizer (the byte tokens)


@dataclass
class BenchRequest:
    """One request: ``prompt`` (a list of token ids, or text) of ``input_len`` tokens, asking for exactly
    ``output_len`` tokens (``ignore_eos``)."""
    index: int
    prompt: Union[list, str]
    input_len: int
    output_len: int


def request_lengths(dataset: str, num: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator) -> list[tuple[int, int]]:
    """``num`` (input, output) token counts for ``dataset`` ``random`` or ``sharegpt`` (module docstring)."""
    if dataset == "sharegpt":
        lo, hi = SHAREGPT_CLIP
        ins = np.clip(np.rint(np.exp(rng.normal(*SHAREGPT_INPUT, size=num))), lo, hi).astype(int)
        outs = np.clip(np.rint(np.exp(rng.normal(*SHAREGPT_OUTPUT, size=num))), lo, hi).astype(int)
        return [(int(a), int(b)) for a, b in zip(ins, outs)]
    if dataset != "random":
        raise ValueError(f"unknown dataset {dataset!r}")

    def draw(length: int) -> np.ndarray:
        if range_ratio == 0:
            return np.full(num, length)
        lo = max(1, int(math.floor(length * (1 - range_ratio))))
        hi = max(lo, int(math.ceil(length * (1 + range_ratio))))
        return rng.integers(lo, hi + 1, size=num)
    return [(int(a), int(b)) for a, b in zip(draw(input_len), draw(output_len))]


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """The ids of ``tokenizer`` that are plain tokens: below its ``vocab_size``, neither special nor added."""
    skip = set(getattr(tokenizer, "special_ids", ())) | set(getattr(tokenizer, "_added_ids", ()))
    return np.array([i for i in range(tokenizer.vocab_size) if i not in skip], dtype=np.int64)


def word_token_ids(tokenizer, ids: np.ndarray) -> np.ndarray:
    """Of ``ids``, those whose text is one space followed by ASCII letters (" the", " river"): joined, such pieces
    split back into the same tokens under a GPT-2 / Qwen pre-tokenizer, so text built from them has a known length."""
    keep = []
    for i in ids.tolist():
        s = tokenizer.decode([i], skip_special_tokens=False)
        if len(s) > 1 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            keep.append(i)
    return np.array(keep, dtype=np.int64)


def _text_of_length(tokenizer, pieces: np.ndarray, length: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text of word pieces that encodes to ``length`` tokens where the tokenizer allows (re-encoded and trimmed a
    few times); returns (text, its token count)."""
    ids = rng.choice(pieces, size=length).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=False)
    n = len(tokenizer.encode(text))
    for _ in range(4):
        if n == length:
            break
        enc = tokenizer.encode(text)
        if n > length:
            enc = enc[:length]
        else:
            enc = enc + rng.choice(pieces, size=length - n).tolist()
        text = tokenizer.decode(enc, skip_special_tokens=False)
        n = len(tokenizer.encode(text))
    return text, n


def build_prompts(lengths: list[tuple[int, int]], prompt_format: str, tokenizer,
                  rng: np.random.Generator, prefix_len: int = 0) -> list[BenchRequest]:
    """One ``BenchRequest`` per (input, output) pair: prompts as token ids or text (module docstring), each after
    the same ``prefix_len`` tokens (its ``input_len`` counts them).  ``tokenizer``: a
    ``pegainfer.text.tokenizer.Tokenizer`` or None (ids only)."""
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"unknown prompt format {prompt_format!r}")
    if tokenizer is None:
        if prompt_format == "text":
            raise ValueError("text prompts need the model's tokenizer")
        pool = np.arange(FALLBACK_VOCAB, dtype=np.int64)
    else:
        pool = ordinary_token_ids(tokenizer)
    out = []
    if prompt_format == "ids":
        prefix = rng.choice(pool, size=prefix_len).tolist()
        for i, (n_in, n_out) in enumerate(lengths):
            out.append(BenchRequest(i, prefix + rng.choice(pool, size=n_in).tolist(), prefix_len + n_in, n_out))
        return out
    words = word_token_ids(tokenizer, pool)
    pieces = words if len(words) >= 16 else pool    # a tiny tokenizer may have few whole words
    prefix, n_prefix = _text_of_length(tokenizer, pieces, prefix_len, rng) if prefix_len else ("", 0)
    for i, (n_in, n_out) in enumerate(lengths):
        text, n = _text_of_length(tokenizer, pieces, n_in, rng)
        out.append(BenchRequest(i, prefix + text, n_prefix + n, n_out))
    return out


def arrival_times(num: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: zeros for an infinite rate, else the cumulative sum of exponential
    gaps of mean ``1 / request_rate`` (a Poisson process), the first request at 0."""
    if math.isinf(request_rate):
        return np.zeros(num)
    gaps = rng.exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def prompt_token_ids(req: BenchRequest, tokenizer) -> Optional[list]:
    """The token ids the server sees for ``req`` (text is encoded as the server encodes it); None when text and
    no tokenizer."""
    if isinstance(req.prompt, list):
        return list(req.prompt)
    if tokenizer is None:
        return None
    return tokenizer.encode(req.prompt, True)
