"""The reference token selection: one thread per logits row, the math of the sampler stated plainly.

Logits are bf16 bits ``[B, V]`` (a row-strided view is fine); each row ``r`` has its own parameters
(``SamplingBuffers``): temperature ``T``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``step``.

What a row's draw means
-----------------------
With ``z = logits / T`` and ``p = softmax(z)``:

* ``T == 0`` (or a row whose max is ±inf, or that has no logit but NaN): greedy, the argmax -- the first index of
  the largest logit; NaN never wins; a row of -inf / NaN gives 0.
* otherwise a token is kept when it passes every active filter, each computed on the full distribution ``p``:
  **top-k** (``k > 0``): fewer than ``k`` logits are larger than its own (the k largest, and every tie of the k-th,
  as in vLLM); **top-p** (``p < 1``): the mass of the tokens larger than it is still short of ``p`` (the smallest
  set of largest-probability tokens whose mass reaches ``p``, ties at the boundary all kept; never empty);
  **min-p** (``min_p > 0``): ``p_i ≥ min_p · p_max``.  vLLM applies the filters one after another (top-p on the
  renormalised top-k / min-p survivors); here they intersect, which keeps the same tokens except when top-p is the
  binding filter, where it can keep a few more.  NaN logits are never kept.
* one kept token is drawn in proportion to ``p`` with the Gumbel-max trick: the kept ``j`` with the largest
  ``(x_j - x_max) / T + g(seed, step, j)`` (``gumbel.py``: a counter-based Gumbel variate; ties → the smaller
  index), so the same ``(seed, step)`` always draws the same token.

The arithmetic is the tuned sampler's (``sampler.py``), in f32: ``1/T`` rounded once, the weight of a logit
``w(x) = exp((x - x_max) · (1/T))``, ``Z = Σ w``, the top-p bound ``p · Z``, the score ``(x - x_max) · (1/T) + g``.
So both kernels pick the same token, except where ``p · Z`` falls within the f32 rounding of their sums of ``w``
(added in another order) -- never in the tests, whose ``top_p`` values are not that close to a boundary.

Also here: ``argmax`` (the greedy token of each row) and ``logsumexp`` (``log Σ_j exp(x_j)``, the normaliser of the
raw distribution, with the exponentials summed in float64).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import bf16_to_f32, cuda, device_fn, float32, grid, int32, kernel, math, threads
from pegainfer.kernels.sampling.gumbel import _gumbel, _row_keys

_INF = float32(math.inf)
_NEG_INF = float32(-math.inf)


@device_fn
def _logit(logits, row, j):
    return bf16_to_f32(logits[row, j])


@device_fn
def _first_argmax(logits, row):
    """(the largest logit of the row, its first index; -1 when every logit is -inf or NaN)."""
    best = _NEG_INF
    best_j = int32(-1)
    for j in range(logits.shape[1]):
        x = _logit(logits, row, j)
        if x > best:                       # strict: the first of equal maxima; NaN compares false
            best = x
            best_j = int32(j)
    return best, best_j


@device_fn
def _weight(x, xmax, inv_t):
    """``exp((x - x_max) / T)`` in f32: the unnormalised probability (1 for the largest logit, 0 for -inf)."""
    return float32(math.exp(float32((x - xmax) * inv_t)))


@kernel
def reference_sample_kernel(logits, temperature, top_k, top_p, min_p, seed, step, out_ids, out_kept):
    """The module docstring's draw for each row (a thread per row, grid-stride): ``out_ids[r]`` the token,
    ``out_kept[r]`` how many tokens its filters kept (1 for a greedy row).  Per-row parameters ``[≥B]``: temperature
    f32, top_k i32, top_p f32, min_p f32, seed uint64, step i32."""
    vocab = logits.shape[1]
    for row in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        xmax, jmax = _first_argmax(logits, row)
        greedy = jmax if jmax >= 0 else int32(0)
        temp = temperature[row]
        if not (temp > float32(0.0)) or not (xmax > _NEG_INF and xmax < _INF):
            out_ids[row] = greedy
            out_kept[row] = 1
            continue
        inv_t = float32(float32(1.0) / temp)
        k = top_k[row]
        p = top_p[row]
        mp = min_p[row]

        z = float32(0.0)                                  # Z = Σ w(x) over every logit but NaN
        for i in range(vocab):
            x = _logit(logits, row, i)
            if x >= _NEG_INF:
                z += _weight(x, xmax, inv_t)
        pz = float32(p * z)

        key1, key2 = _row_keys(seed[row], step[row])
        best = _NEG_INF
        best_j = int32(-1)
        kept = 0
        for j in range(vocab):
            x = _logit(logits, row, j)
            if not (x >= _NEG_INF):
                continue                                  # NaN: never kept
            above = 0                                     # the logits larger than x, and their mass
            mass_above = float32(0.0)
            for i in range(vocab):
                xi = _logit(logits, row, i)
                if xi > x:
                    above += 1
                    mass_above += _weight(xi, xmax, inv_t)
            if k > 0 and above >= k:
                continue                                  # top-k: k larger logits already
            if p < float32(1.0) and mass_above >= pz:
                continue                                  # top-p: the larger tokens already reach p · Z
            if mp > float32(0.0) and _weight(x, xmax, inv_t) < mp:
                continue                                  # min-p: p_j < min_p · p_max
            kept += 1
            score = float32(float32((x - xmax) * inv_t) + _gumbel(key1, key2, j))
            if score > best:                              # strict: ties → the smaller index
                best = score
                best_j = int32(j)
        out_ids[row] = best_j if best_j >= 0 else greedy
        out_kept[row] = kept


@kernel
def reference_argmax_kernel(logits, out_ids):
    """``out_ids[r]`` = the first index of the largest logit of row ``r`` (NaN never wins; 0 when there is none)."""
    for row in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        _, j = _first_argmax(logits, row)
        out_ids[row] = j if j >= 0 else int32(0)


@kernel
def reference_logsumexp_kernel(logits, out_lse):
    """``out_lse[r] = m + log Σ_j exp(x_j - m)`` with ``m`` the row's max (the sum in float64; NaN logits add nothing;
    a row of -inf gives -inf)."""
    for row in range(cuda.grid(1), logits.shape[0], cuda.gridsize(1)):
        m, _ = _first_argmax(logits, row)
        if not (m > _NEG_INF):
            out_lse[row] = _NEG_INF
            continue
        s = 0.0                                           # float64
        for j in range(logits.shape[1]):
            x = _logit(logits, row, j)
            if x > _NEG_INF:
                s += math.exp(float(x) - float(m))
        out_lse[row] = float32(float(m) + math.log(s))


def _launch_rows(kern, n_rows, *args):
    block = threads(gpu=128, sim=32)
    launch(kern, grid(n_rows, per_block=block, sim_cap=4), block, *args)


def _check(logits, arr, dtype):
    assert logits.ndim == 2 and logits.dtype == np.uint16, (logits.shape, logits.dtype)
    assert arr.ndim == 1 and arr.dtype == dtype and arr.shape[0] >= logits.shape[0], (arr.shape, arr.dtype)


def reference_sample(logits, params, out_ids, out_kept) -> None:
    """Draw one token per row of logits ``[B, V]`` (bf16 bits) with row ``r``'s parameters from ``params``
    (a ``SamplingBuffers``) into out_ids ``[≥B]`` int32; out_kept ``[≥B]`` int32 gets the size of each kept set."""
    _check(logits, out_ids, np.int32)
    _check(logits, out_kept, np.int32)
    assert params.max_batch >= logits.shape[0], (params.max_batch, logits.shape)
    if logits.shape[0]:
        _launch_rows(reference_sample_kernel, logits.shape[0], logits, params.temperature, params.top_k,
                     params.top_p, params.min_p, params.seed, params.step, out_ids, out_kept)


def reference_argmax(logits, out_ids) -> None:
    """``out_ids[r] = argmax(logits[r])`` (first index of the max) for logits ``[B, V]`` bf16 bits."""
    _check(logits, out_ids, np.int32)
    if logits.shape[0]:
        _launch_rows(reference_argmax_kernel, logits.shape[0], logits, out_ids)


def reference_logsumexp(logits, out_lse) -> None:
    """``out_lse[r] = log Σ exp(logits[r])`` (f32) for logits ``[B, V]`` bf16 bits."""
    _check(logits, out_lse, np.float32)
    if logits.shape[0]:
        _launch_rows(reference_logsumexp_kernel, logits.shape[0], logits, out_lse)
