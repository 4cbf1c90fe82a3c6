"""The one-pass row kernels: the greedy token (argmax) and the log-sum-exp of each logits row.

A block per row walks it once (``rows._fold_row``): ``argmax`` keeps the first index of the largest logit (NaN never
wins); ``logsumexp`` keeps an online (max, sum of ``exp``) per thread in f32, then the block combines them -- the
normaliser of the raw model distribution (temperature 1, before any filter) that ``logprobs.top_logprobs`` uses.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (NO_INDEX, cuda, device_fn, float32, grid, int32, math, pdl_prologue,
                                          threads)
from pegainfer.kernels.sampling.block import _block_argmax, _block_sum
from pegainfer.kernels.sampling.rows import _check_rows_out, _fold_row, _kernel_with_block, _row_words

ARGMAX_THREADS = 1024              # block size of the one-pass kernels (argmax, logsumexp)

_NEG_INF = float32(-math.inf)


@device_fn
def _visit_argmax(state, args, x, j):
    """state (max, its index): the first index of the largest logit this thread saw (NaN never wins)."""
    best, best_j = state
    if x > best:
        best = x
        best_j = int32(j)
    return best, best_j


@device_fn
def _visit_logsumexp(state, args, x, j):
    """state (running max m, Σ exp(x - m)) — the online softmax update; -inf and NaN logits add nothing."""
    m, s = state
    if x > m:
        s = float32(s * math.exp(float32(m - x)) + float32(1.0))
        m = x
    elif x > _NEG_INF:
        s += float32(math.exp(float32(x - m)))
    return m, s


@_kernel_with_block(ARGMAX_THREADS)
def argmax_kernel(words, logits, n_vec, out_ids):
    """``out_ids[r] = argmax_j logits[r, j]`` (ties → the smallest j; a row of -inf/NaN gives 0).

    words ``[B, V // 2]`` uint32 = the same memory as logits ``[B, V]`` uint16 bf16 bits; ``n_vec`` groups of 8
    read with 16-byte loads (0 when rows are not 16-byte aligned); out_ids ``[≥B]`` int32.

    Geometry: one block per row (grid-stride over rows), 1024 threads striding over ``V`` (``_fold_row``), then
    ``warp_argmax`` and a shared-memory combine of the warps.
    """
    pdl_prologue()
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):
        best, best_j = _fold_row(_visit_argmax, (_NEG_INF, int32(NO_INDEX)), (), words[row], logits, row, n_vec)
        best, best_j = _block_argmax(best, best_j)
        if cuda.threadIdx.x == 0:
            out_ids[row] = best_j if best_j != NO_INDEX else 0


@_kernel_with_block(ARGMAX_THREADS)
def logsumexp_kernel(words, logits, n_vec, out_lse):
    """``out_lse[r] = log Σ_j exp(logits[r, j])`` in f32 (the raw distribution, temperature 1).

    words / logits / n_vec as in ``argmax_kernel``; out_lse ``[≥B]`` f32.  A row of -inf gives -inf.

    Geometry: one block per row, 1024 threads: one pass of online (max, sum) per thread, then the block combines
    ``Σ s_t · exp(m_t - m)`` with ``m`` the block max.
    """
    pdl_prologue()
    for row in range(cuda.blockIdx.x, logits.shape[0], cuda.gridDim.x):
        m_t, s_t = _fold_row(_visit_logsumexp, (_NEG_INF, float32(0.0)), (), words[row], logits, row, n_vec)
        m, _ = _block_argmax(m_t, 0)
        scaled = float32(0.0)
        if m_t > _NEG_INF:
            scaled = float32(s_t * math.exp(float32(m_t - m)))
        s = _block_sum(scaled)
        if cuda.threadIdx.x == 0:
            out_lse[row] = float32(m + math.log(s)) if m > _NEG_INF else _NEG_INF


def argmax(logits, out_ids, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out_ids[r] = argmax(logits[r])`` for logits ``[B, V]`` bf16 bits (ties → the smallest index), out_ids
    ``[≥B]`` int32."""
    words, n_vec = _row_words(logits)
    _check_rows_out("out_ids", out_ids, np.int32, logits.shape[0])
    if logits.shape[0] == 0:
        return
    launch(argmax_kernel, grid(logits.shape[0]), threads(gpu=ARGMAX_THREADS, sim=32), words, logits, n_vec, out_ids,
           name="argmax", policy=policy)


def logsumexp(logits, out_lse, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out_lse[r] = log Σ exp(logits[r])`` (f32) for logits ``[B, V]`` bf16 bits, out_lse ``[≥B]`` f32 — the
    normaliser of the raw model distribution, for ``top_logprobs``."""
    words, n_vec = _row_words(logits)
    _check_rows_out("out_lse", out_lse, np.float32, logits.shape[0])
    if logits.shape[0] == 0:
        return
    launch(logsumexp_kernel, grid(logits.shape[0]), threads(gpu=ARGMAX_THREADS, sim=32), words, logits, n_vec, out_lse,
           name="logsumexp", policy=policy)
