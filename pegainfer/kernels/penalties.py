"""Repetition, frequency and presence penalties and logit bias: what a request's past tokens do to its next logits.

The math, per row of a sequence that asks for any of them (vLLM's order and meanings), on the bf16 logits ``l``::

    l[j] = bf16(l[j] + bias[j])                               for each token j of the request's logit_bias
    x    = l[j] / rep  if l[j] > 0  else  l[j] · rep          when j is in the prompt or the output (rep = 1: no-op)
    l[j] = bf16(x - freq · count[j] - pres · (count[j] > 0))  count[j]: how often the output holds j

Why the state lives on the device, one row per sequence slot: the token a step samples is only known to the host
after the step, and the engine launches the next step before it reads it (async scheduling).  So each slot keeps
``counts[slot, V]`` (uint16, saturating at 65,535), ``seen[slot, ⌈V/32⌉]`` (a bit per token of the prompt or the
output, llguidance's bitmask layout), ``counted[slot]`` (how many output tokens the counts hold), the penalties and
the bias entries; and a step counts its row's newest output token itself before it applies them.  A step's input
token of a decode row *is* the sequence's newest output token (the one sampled the step before) and the sampler's
step counter says how many output tokens there are, so::

    if step[row] > counted[slot]:  count ids[logit_rows[row]];  counted[slot] = step[row]

counts each output token once, in the step that first samples after it; a prompt chunk's rows (``step`` ≤
``counted``) count nothing.  ``initialize_slot`` (one block, launched in stream order before the sequence's first
sampled step, and again when its slot was taken by another penalized sequence while it was preempted) clears the
slot and writes the prompt's distinct tokens (seen; only with a repetition penalty) and the output so far with
its counts.

Applied inside the grammar-mask launch (``token_mask.py``), whose blocks each own a range of a row's tokens: the
block that owns the newest token counts it, then every block adds the bias entries and applies the penalties to
its own range, so no two blocks write one logit.  The same functions serve the NumPy reference
(``reference_penalties``), which rounds where the kernel does.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (bits_f32, cuda, device_fn, f32_to_bf16, float32, int32, kernel,
                                          pdl_prologue, threads, uint16, uint32)

MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries a request may carry (each slot keeps them in a fixed row)."""
MAX_COUNT = 65535
"""Counts saturate here (uint16): more repetitions of one token than a context holds."""
INIT_THREADS = 512


def seen_words(vocab: int) -> int:
    """32-bit words of one slot's ``seen`` bits."""
    return -(-int(vocab) // 32)


def penalty_state_bytes(num_slots: int, vocab: int) -> int:
    """Device bytes of a ``PenaltyState`` (the engine counts them before sizing the KV cache)."""
    S, V = max(1, int(num_slots)), int(vocab)
    return S * (2 * V + 4 * seen_words(V) + 4 + 12 + 8 * MAX_LOGIT_BIAS + 4) + 8 * V + 8 * MAX_LOGIT_BIAS


class PenaltyState:
    """The device state of every slot (module docstring), and staging buffers for ``initialize_slot``:
    ``counts [S, V]`` uint16, ``seen [S, ⌈V/32⌉]`` uint32, ``counted [S]`` int32, ``params [S, 3]`` f32 (rep, freq,
    pres), ``bias_tokens [S, MAX_LOGIT_BIAS]`` int32, ``bias_values`` f32, ``n_bias [S]`` int32.  Fixed for the
    life of the engine (captured graphs read them)."""

    def __init__(self, num_slots: int, vocab: int):
        S, V = max(1, int(num_slots)), int(vocab)
        self.num_slots, self.vocab = S, V
        self.counts = cuda.to_device(np.zeros((S, V), np.uint16))
        self.seen = cuda.to_device(np.zeros((S, seen_words(V)), np.uint32))
        self.counted = cuda.to_device(np.zeros(S, np.int32))
        self.params = cuda.to_device(np.tile(np.array([1.0, 0.0, 0.0], np.float32), (S, 1)))
        self.bias_tokens = cuda.to_device(np.zeros((S, MAX_LOGIT_BIAS), np.int32))
        self.bias_values = cuda.to_device(np.zeros((S, MAX_LOGIT_BIAS), np.float32))
        self.n_bias = cuda.to_device(np.zeros(S, np.int32))
        self.stage_tokens = cuda.to_device(np.zeros(V, np.int32))
        self.stage_counts = cuda.to_device(np.zeros(V, np.int32))
        self.stage_bias_tokens = cuda.to_device(np.zeros(MAX_LOGIT_BIAS, np.int32))
        self.stage_bias_values = cuda.to_device(np.zeros(MAX_LOGIT_BIAS, np.float32))

    @classmethod
    def unused(cls) -> "PenaltyState":
        """A one-slot, one-token state for launches with no penalized row (same dtypes: one compiled kernel)."""
        return cls(1, 1)


def slot_tokens(prompt_ids, output_ids, repetition_penalty: float) -> tuple[np.ndarray, np.ndarray]:
    """The (distinct tokens, their output counts) a slot starts from: the output's tokens, and with a repetition
    penalty the prompt's too (count 0 where only the prompt holds them)."""
    out = np.asarray(output_ids, np.int64)
    tokens = out if repetition_penalty == 1.0 else np.concatenate([np.asarray(prompt_ids, np.int64), out])
    distinct = np.unique(tokens)
    counts = np.zeros(distinct.shape[0], np.int64)
    if out.size:
        o, c = np.unique(out, return_counts=True)
        counts[np.searchsorted(distinct, o)] = c
    return distinct.astype(np.int32), np.minimum(counts, MAX_COUNT).astype(np.int32)


@kernel
def initialize_slot_kernel(counts, seen, counted, params, bias_tokens, bias_values, n_bias, slot, tokens,
                           token_counts, n_tokens, n_out, rep, freq, pres, new_bias_tokens, new_bias_values, nb):
    """One block: clear ``slot``, then mark ``tokens[:n_tokens]`` seen with their counts, store the bias entries and
    the penalties, and ``counted[slot] = n_out``."""
    pdl_prologue()                  # (if launched overlapped: the step before may still read the slot)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    vocab = counts.shape[1]
    for j in range(tid, vocab, nt):
        counts[slot, j] = uint16(0)
    for w in range(tid, seen.shape[1], nt):
        seen[slot, w] = uint32(0)
    cuda.syncthreads()
    for i in range(tid, n_tokens, nt):
        tok = tokens[i]
        counts[slot, tok] = uint16(token_counts[i])
        cuda.atomic.or_(seen, (slot, tok >> 5), uint32(1) << uint32(tok & 31))
    for e in range(tid, nb, nt):
        bias_tokens[slot, e] = new_bias_tokens[e]
        bias_values[slot, e] = new_bias_values[e]
    if tid == 0:
        counted[slot] = n_out
        n_bias[slot] = nb
        params[slot, 0] = rep
        params[slot, 1] = freq
        params[slot, 2] = pres


def initialize_slot(state: PenaltyState, slot: int, prompt_ids, output_ids, repetition_penalty: float,
                    frequency_penalty: float, presence_penalty: float, logit_bias: dict,
                    policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Start ``slot``'s penalty state for a sequence with ``prompt_ids`` and ``output_ids`` so far (module
    docstring), on the current stream: the staging copies and the kernel run in stream order before any later step."""
    tokens, token_counts = slot_tokens(prompt_ids, output_ids, repetition_penalty)
    n, nb = tokens.shape[0], len(logit_bias)
    assert n <= state.vocab and nb <= MAX_LOGIT_BIAS, (n, nb)
    from pegainfer.kernels.launch import current_stream
    stream = current_stream()
    if n:
        state.stage_tokens[:n].copy_to_device(tokens, stream=stream)
        state.stage_counts[:n].copy_to_device(token_counts, stream=stream)
    if nb:
        state.stage_bias_tokens[:nb].copy_to_device(np.fromiter(logit_bias.keys(), np.int32, nb), stream=stream)
        state.stage_bias_values[:nb].copy_to_device(np.fromiter(logit_bias.values(), np.float32, nb), stream=stream)
    launch(initialize_slot_kernel, 1, threads(gpu=INIT_THREADS, sim=32), state.counts, state.seen, state.counted,
           state.params, state.bias_tokens, state.bias_values, state.n_bias, np.int32(slot), state.stage_tokens,
           state.stage_counts, np.int32(n), np.int32(len(output_ids)), np.float32(repetition_penalty),
           np.float32(frequency_penalty), np.float32(presence_penalty), state.stage_bias_tokens,
           state.stage_bias_values, np.int32(nb), name="penalty_init", policy=policy)


# ------------------------------------------------------------------------------------------------ in the mask launch
@device_fn
def count_newest(counts, seen, counted, slot, token, n_out, lo, hi):
    """Called by thread 0 of the block that owns ``[lo, hi)``: count ``token`` (the row's input, its newest
    output token) when the slot holds fewer than ``n_out`` output tokens and the token is in the range."""
    if n_out > counted[slot] and lo <= token < hi:
        c = int32(counts[slot, token])
        counts[slot, token] = uint16(min(c + 1, MAX_COUNT))
        seen[slot, token >> 5] = seen[slot, token >> 5] | (uint32(1) << uint32(token & 31))
        counted[slot] = n_out


@device_fn
def add_bias(logits, row, bias_tokens, bias_values, n_bias, slot, lo, hi, tid, nt):
    """``logits[row, j] = bf16(l + bias)`` for the slot's bias entries with ``j`` in ``[lo, hi)``."""
    for e in range(tid, n_bias[slot], nt):
        j = bias_tokens[slot, e]
        if lo <= j < hi:
            x = bits_f32(uint32(logits[row, j]) << uint32(16))
            logits[row, j] = f32_to_bf16(x + bias_values[slot, e])


@device_fn
def apply_penalties(logits, row, counts, seen, params, slot, lo, hi, tid, nt):
    """The repetition, frequency and presence penalties of the slot on ``logits[row, lo:hi]`` (module docstring);
    a token neither seen nor counted is not touched."""
    rep, freq, pres = params[slot, 0], params[slot, 1], params[slot, 2]
    if rep == float32(1.0) and freq == float32(0.0) and pres == float32(0.0):
        return
    for j in range(lo + tid, hi, nt):
        c = int32(counts[slot, j])
        if c > 0 or (seen[slot, j >> 5] >> uint32(j & 31)) & uint32(1) != uint32(0):
            x = bits_f32(uint32(logits[row, j]) << uint32(16))
            x = x / rep if x > float32(0.0) else x * rep
            x = x - freq * float32(c)
            if c > 0:
                x = x - pres
            logits[row, j] = f32_to_bf16(x)


# ------------------------------------------------------------------------------------------------ reference
def reference_penalties(logits, prompt_ids, output_ids, repetition_penalty: float = 1.0,
                        frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logit_bias=None) -> np.ndarray:
    """NumPy: one row of bf16 logit bits ``[V]`` after the bias and the penalties of a sequence with ``prompt_ids``
    and ``output_ids`` so far -- what the kernel writes (the same f32 operations and bf16 roundings)."""
    from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits
    row = np.array(logits, np.uint16, copy=True)
    for j, b in (logit_bias or {}).items():
        row[j] = to_bf16_bits(np.array([from_bf16_bits(row[j:j + 1])[0] + np.float32(b)], np.float32))[0]
    if repetition_penalty == 1.0 and frequency_penalty == 0.0 and presence_penalty == 0.0:
        return row
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=row.shape[0])[:row.shape[0]]
    seen = counts > 0
    if repetition_penalty != 1.0:
        seen[np.asarray(prompt_ids, np.int64)] = True
    rep, freq, pres = np.float32(repetition_penalty), np.float32(frequency_penalty), np.float32(presence_penalty)
    for j in np.flatnonzero(seen):
        x = np.float32(from_bf16_bits(row[j:j + 1])[0])
        x = np.float32(x / rep) if x > 0 else np.float32(x * rep)
        x = np.float32(x - np.float32(freq * np.float32(min(int(counts[j]), MAX_COUNT))))
        if counts[j] > 0:
            x = np.float32(x - pres)
        row[j] = to_bf16_bits(np.array([x], np.float32))[0]
    return row
