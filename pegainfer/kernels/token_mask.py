"""What a row's grammar and its penalties make of its logits, right before the sampler.

Structured output (``text/structured.py``) computes, on the CPU, which tokens may come next for each constrained
row and packs that as a bitmask; this kernel applies it to those rows only, so the sampler then draws (or picks the
greedy token) among allowed tokens, whatever its filters::

    allowed(r, j) = (bitmask[r, j // 32] >> (j % 32)) & 1          (llguidance's layout)
    logits[r, j]  = -inf   where flags[r] & MASKED and not allowed(r, j)   (untouched elsewhere)

A row flagged ``PENALIZED`` first gets its sequence's logit bias and repetition / frequency / presence penalties
(``penalties.py``, from the state of the row's slot, ``token_slots[logit_rows[r]]``), counting the row's newest
output token there first.

* logits  ``[B, V]`` bf16 bits (uint16; a row-strided view is fine), written in place;
* bitmask ``[≥B, W]`` int32, ``W = ceil(V / 32)`` (``mask_words``); a token past ``32 W`` counts as disallowed;
* flags   ``[≥B]`` int32: ``MASKED`` | ``PENALIZED`` bits, 0 → the row is left alone.

Every buffer is preallocated and read on the device, so the launch sits in the captured decode graph: the host
rewrites a constrained row's bitmask and the flags before the step, and a step with neither costs one launch whose
blocks read a flag and leave.

The one-sequence LM head (``sampling.HeadArgmax``, ``LaunchPolicy.head_argmax``) picks a greedy row's token in its
own launch, before this one, from the raw logits; the sampler then skips that row.  So for a flagged greedy row 0
after such a head (``head_done``) this kernel also writes what the head wrote -- the token, its logit as the kept
threshold, a kept count of 1 -- from the processed row, with the sampler's greedy rule (the first index of the
largest allowed logit; NaN never wins).

Geometry: ``parts`` blocks per row (grid-stride over (row, part)), each owning ``V / parts`` consecutive tokens
(penalties, then the mask with coalesced 2-byte stores: a warp's 32 tokens share one bitmask word); the head's row
is one block over the whole row, which then reduces its argmax.  Starts with ``pdl_prologue`` (nothing to read
before the logits are ready).
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.penalties import PenaltyState, add_bias, apply_penalties, count_newest
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (NO_INDEX, bits_f32, block_argmax, cuda, float32, grid, int32, kernel, math,
                                          pdl_prologue, threads, uint16, uint32)

NEG_INF_BF16 = 0xFF80              # bf16 bits of -inf
MASKED = 1                         # flags bit: apply the row's grammar bitmask
PENALIZED = 2                      # flags bit: apply the row's slot's bias and penalties (``penalties.py``)
TOKEN_MASK_THREADS = 256
PARTS = threads(gpu=4, sim=1)      # blocks per row (the head's row: one)


def mask_words(vocab: int) -> int:
    """32-bit words of one row's bitmask for a vocabulary of ``vocab`` tokens."""
    return -(-int(vocab) // 32)


@kernel
def token_mask_kernel(logits, bitmask, flags, parts, temperature, head_done, head_token, head_threshold, head_kept,
                      counts, seen, counted, params, bias_tokens, bias_values, n_bias, step, ids, logit_rows,
                      token_slots):
    """Penalize and mask the flagged rows (module docstring); fix the LM head's greedy row 0 when ``head_done``.
    ``counts`` .. ``n_bias``: the slots' ``PenaltyState``; ``step``: the sampler's per-row output counts; ``ids``,
    ``logit_rows``, ``token_slots``: the step's input tokens, each row's token and each token's slot."""
    pdl_prologue()
    n_rows = logits.shape[0]
    vocab = logits.shape[1]
    n_words = bitmask.shape[1]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for work in range(cuda.blockIdx.x, n_rows * parts, cuda.gridDim.x):
        row = work // parts
        part = work % parts
        flag = flags[row]
        if flag == 0:
            continue                                        # (uniform across the block)
        fix_head = head_done != 0 and row == 0 and not (temperature[0] > float32(0.0))
        if fix_head and part != 0:
            continue
        lo = 0 if fix_head else vocab * part // parts
        hi = vocab if fix_head else vocab * (part + 1) // parts
        if flag & PENALIZED:
            t = logit_rows[row]
            slot = token_slots[t]
            if slot >= 0:
                if tid == 0:
                    count_newest(counts, seen, counted, slot, ids[t], step[row], lo, hi)
                cuda.syncthreads()
                add_bias(logits, row, bias_tokens, bias_values, n_bias, slot, lo, hi, tid, nt)
                cuda.syncthreads()
                apply_penalties(logits, row, counts, seen, params, slot, lo, hi, tid, nt)
                cuda.syncthreads()
        masked = (flag & MASKED) != 0
        if not masked and not fix_head:
            continue
        best = float32(-math.inf)
        best_j = int32(NO_INDEX)
        for j in range(lo + tid, hi, nt):
            w = j >> 5
            allowed = not masked or (w < n_words and (bitmask[row, w] >> int32(j & 31)) & int32(1) != 0)
            if not allowed:
                logits[row, j] = uint16(NEG_INF_BF16)
            elif fix_head:
                x = bits_f32(uint32(logits[row, j]) << uint32(16))
                if x > best:                                # this thread's first largest (indices ascend)
                    best = x
                    best_j = int32(j)
        if fix_head:
            best, best_j = block_argmax(best, best_j)
            if tid == 0:
                head_token[0] = best_j if best_j != NO_INDEX else 0
                head_threshold[0] = best
                head_kept[0] = 1


def allocate_bitmask(rows: int, vocab: int):
    """A zeroed device bitmask ``[rows, mask_words(vocab)]`` int32."""
    return cuda.to_device(np.zeros((int(rows), mask_words(vocab)), np.int32))


class PenaltyInputs:
    """What the penalized rows read besides the logits: the slots' ``PenaltyState`` and the step's views of the
    sampler's output counts (``SamplingBuffers.step``), input ids, logits rows and token slots (``StepInputs``)."""

    def __init__(self, state: PenaltyState, step, ids, logit_rows, token_slots):
        self.state, self.step, self.ids, self.logit_rows, self.token_slots = state, step, ids, logit_rows, token_slots

    @classmethod
    def unused(cls) -> "PenaltyInputs":
        """For launches with no ``PENALIZED`` row (tests, benchmarks): never read, the same dtypes."""
        z = cuda.to_device(np.zeros(1, np.int32))
        return cls(PenaltyState.unused(), z, z, z, z)


@functools.cache
def _unused_penalties() -> PenaltyInputs:
    return PenaltyInputs.unused()


def apply_token_mask(logits, bitmask, flags, temperature, head=None, penalties: PenaltyInputs | None = None,
                     policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Apply each flagged row's penalties and grammar bitmask to the logits ``[B, V]``, in place (module
    docstring).  ``temperature`` ``[≥B]`` f32: the sampler's (``SamplingBuffers.temperature``); ``head``: the
    ``sampling.HeadArgmax`` the LM head of this step wrote row 0's greedy token through, or None; ``penalties``:
    needed when a row is flagged ``PENALIZED``."""
    n_rows, vocab = logits.shape
    assert logits.dtype == np.uint16 and bitmask.dtype == np.int32 and flags.dtype == np.int32, \
        (logits.dtype, bitmask.dtype, flags.dtype)
    assert bitmask.shape[0] >= n_rows and flags.shape[0] >= n_rows and bitmask.shape[1] == mask_words(vocab), \
        (logits.shape, bitmask.shape, flags.shape)
    if n_rows == 0:
        return
    if head is not None:
        assert n_rows == 1, "the LM head's argmax serves one row"
        token, threshold, kept = head.token, head.threshold, head.kept
    else:   # never written (head_done = 0); same dtypes, so one compiled kernel serves both
        token, threshold, kept = flags[:1], temperature[:1], flags[:1]
    penalties = penalties if penalties is not None else _unused_penalties()
    p = penalties.state
    launch(token_mask_kernel, grid(n_rows * PARTS), threads(gpu=TOKEN_MASK_THREADS, sim=32), logits, bitmask,
           flags[:n_rows], np.int32(PARTS), temperature, np.int32(head is not None), token, threshold, kept,
           p.counts, p.seen, p.counted, p.params, p.bias_tokens, p.bias_values, p.n_bias, penalties.step,
           penalties.ids, penalties.logit_rows, penalties.token_slots, name="token_mask", policy=policy)


def reference_token_mask(logits, bitmask, flags):
    """NumPy: the masked copy of host logits ``[B, V]`` (bf16 bits) -- what ``apply_token_mask`` writes."""
    logits = np.array(logits, dtype=np.uint16, copy=True)
    n_rows, vocab = logits.shape
    j = np.arange(vocab)
    for r in range(n_rows):
        if flags[r] & MASKED:
            words = np.asarray(bitmask[r], dtype=np.int64)
            allowed = (j // 32 < words.shape[0]) & ((words[np.minimum(j // 32, words.shape[0] - 1)] >> (j % 32)) & 1
                                                    == 1)
            logits[r, ~allowed] = NEG_INF_BF16
    return logits
