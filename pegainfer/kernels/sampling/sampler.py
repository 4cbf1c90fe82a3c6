"""The tuned sampler: one launch draws a token for every row of the step's logits.

What a draw means (temperature, top-k / top-p / min-p, the seeded Gumbel-max draw, greedy rows) is stated in
``reference.py``; this kernel picks the same token.  Its three ideas: the kept set is found as a threshold on
ordered bf16 keys (``threshold.py``), the candidates above a lower bound of that threshold are gathered into shared
memory so the search and the draw finish there, and a greedy row is split over ``GREEDY_PARTS`` blocks.

Cost (one block of 512 threads per sampled row; every full pass re-reads the row, from L2)
-------------------------------------------------------------------------------------------
A greedy row (``T == 0``) is one pass for its max, split over ``GREEDY_PARTS`` blocks that each read a slice and
merge through the workspace (one SM reading a whole row is slow: docs/perf/sampling.md).  A sampled row:

1. one pass: the max and its index (each thread also keeps its own max);
2. one pass counting the tokens at or above a *lower bound* ``lo`` of ``θ`` and, when top-p is on, summing ``Z``
   (one ``exp`` per token).  ``lo`` is the largest of: ``t_min_p``; the k-th largest of the threads' maxima (k
   distinct tokens are at least that large, so it is ≤ the k-th largest logit); for top-p, the smallest logit of
   probability ≥ ``(1 - p) / (2V)`` (all lighter tokens together carry under ``(1 - p) / 2`` of the mass, so the
   top-p set cannot end below it; first with ``Z ≥ 1``, then -- one more cheap counting pass if that was not
   enough -- with the true ``Z``);
3. when at most ``CANDIDATE_CAPACITY`` (4096) tokens lie at or above ``lo`` (the usual case: a few hundred for
   top-p 0.9 or top-k 50 on a language model's logits), one more pass copies them (logit, index) into shared
   memory, and the search and the Gumbel draw finish there (≤ 8 candidates per thread per step).  A typical row
   thus costs 3-4 passes over ``V`` (one with an ``exp`` per token); ``B`` rows run on ``B`` SMs at once.
4. otherwise (near-flat distributions, top-p near 1, k > 512) the search steps are full passes (≤ 6, each a
   compare loop plus an ``exp`` per token above the lowest probe) until the tokens at or above ``lo`` fit; a draw
   that still keeps more than 4096 tokens (e.g. no filter at all) takes one more full pass (a hash and two logs
   per kept token that could still win).

``benchmarks/bench_sampling.py`` measures it (docs/perf/sampling.md).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (NO_INDEX, cuda, device_fn, float32, grid, int32, math, pdl_prologue,
                                          threads)
from pegainfer.kernels.sampling.block import (CANDIDATE_CAPACITY, _block_argmax, _block_bucket_totals,
                                              _block_exclusive_scan, _block_kth_largest_key, _block_sum, _block_sum3,
                                              _candidate_buffers)
from pegainfer.kernels.sampling.buffers import (GREEDY_PARTS, HeadArgmax, SamplingBuffers, _workspace_parts)
from pegainfer.kernels.sampling.gumbel import GUMBEL_MAX, _gumbel, _row_keys
from pegainfer.kernels.sampling.one_pass import _visit_argmax
from pegainfer.kernels.sampling.rows import (_check_rows_out, _fold_range, _fold_row, _kernel_with_block,
                                             _row_words)
from pegainfer.kernels.sampling.threshold import (BUCKETS, KEY_FLOOR, PROBES, _at_or_above, _clear_buckets, _key_of,
                                                  _lowest_key_with_weight, _search_step, _set_probes, _value_of,
                                                  _weight)

EXACT_TOP_P_MARGIN = 1e-4          # the top-p lower bound is used only when 1 - p leaves room for f32 sums
SAMPLE_THREADS = 512               # block size of the sampling kernel
SAMPLE_THREADS_SIM = 8             # ... in the simulator, where every thread is a Python thread (any size works)

_INF = float32(math.inf)
_NEG_INF = float32(-math.inf)
_HALF = float32(0.5)


@device_fn
def _visit_counts(state, args, x, j):
    """state (count of logits ≥ a, count of logits ≥ b, Σ exp((x - xmax) / T) over logits ≥ c);
    args (a, b, c, xmax, 1/T).  ``c = +inf`` skips every ``exp``."""
    n_a, n_b, mass = state
    a, b, c, xmax, inv_t = args
    if x >= a:
        n_a += int32(1)
    if x >= b:
        n_b += int32(1)
    if x >= c:
        mass += _weight(x, xmax, inv_t)
    return n_a, n_b, mass


@device_fn
def _visit_buckets(state, args, x, j):
    """Histogram of logits over the buckets cut at ascending probe values: bucket ``r`` (1..n) holds the logits with
    exactly ``r`` probes ≤ them, so the tokens ≥ probe ``q`` are buckets ``q+1 ..`` (bucket 0, below every probe,
    is dropped).  state (counts ``[BUCKETS]`` i32, masses ``[BUCKETS]`` f32: local arrays, updated in place);
    args (probe values ``[PROBES]``, n probes used, xmax, 1/T, with_mass — ``exp`` only when set)."""
    counts, masses = state
    probe_vals, n_probes, xmax, inv_t, with_mass = args
    r = 0
    while r < n_probes and x >= probe_vals[r]:
        r += 1
    if r > 0:
        counts[r] += 1
        if with_mass:
            masses[r] += _weight(x, xmax, inv_t)
    return state


@device_fn
def _visit_compact(state, args, x, j):
    """state (next free slot,); args (threshold, cand_x, cand_j): copy logits ≥ threshold and their indices."""
    pos = state[0]
    threshold, cand_x, cand_j = args
    if x >= threshold:
        cand_x[pos] = x
        cand_j[pos] = int32(j)
        pos += int32(1)
    return (pos,)


@device_fn
def _visit_gumbel(state, args, x, j):
    """state (best Gumbel score, its index); args (threshold θ, xmax, 1/T, key1, key2).

    For a kept logit (``x ≥ θ``): score ``(x - xmax) / T + g(key, j)``; the largest score wins, ties → the
    smaller index.  A token whose score cannot beat the best even with the largest possible Gumbel value is
    skipped without hashing (it cannot win, so the result does not depend on the visiting order)."""
    best, best_j = state
    threshold, xmax, inv_t, key1, key2 = args
    if x >= threshold:
        z = float32((x - xmax) * inv_t)
        if z + float32(GUMBEL_MAX) >= best:
            s = float32(z + _gumbel(key1, key2, j))
            if s > best or (s == best and int32(j) < best_j):
                best = s
                best_j = int32(j)
    return best, best_j


@_kernel_with_block(SAMPLE_THREADS)
def sample_kernel(words, logits, n_vec, temperature, top_k, top_p, min_p, seed, step, capacity,
                  out_ids, kept_threshold, kept_count, parts, part_max, part_index, counters, head_done):
    """Draw one token per row (``reference.py``: what the draw means; module docstring: how, and its cost).

    words / logits / n_vec as in ``argmax_kernel``; per-row parameters ``[≥B]``: temperature f32, top_k i32 (≤ 0
    off), top_p f32 (≥ 1 off), min_p f32 (≤ 0 off), seed uint64, step i32; ``capacity`` (≤ CANDIDATE_CAPACITY)
    is how many candidates the block may keep in shared memory.  Outputs ``[≥B]``: out_ids int32, kept_threshold
    f32 (a token is kept iff its logit ≥ it; the max for greedy rows), kept_count int32 (1 for greedy rows).
    Greedy scratch: part_max f32 / part_index i32 ``[B · parts]``, counters i32 ``[B]`` (zero at rest).
    ``head_done`` (int32, only with B = 1): the LM head already wrote row 0's greedy token, threshold and count
    (``HeadArgmax``), so a greedy row 0 has nothing left to do here.

    Geometry: ``parts`` blocks per row (grid-stride over (row, part)), 512 threads, ~37 KB of shared memory.  A
    greedy row (temperature 0) is split: block ``q`` takes groups ``[q·n/parts, (q+1)·n/parts)`` of the row (the
    last also the unaligned tail), writes its (max, first index) and bumps the row's counter; the last block to do
    so merges the parts and resets the counter, so a row costs a pass over ``V / parts`` logits instead of ``V``.
    The merge is one memory round trip: every thread loads one part's (max, index), then one block argmax (ties →
    the smaller index, i.e. the earlier part's: the token one block would pick).  A sampled row is one block,
    ``q = 0`` (the others return at once).  Every branch below depends only on per-row values all threads share, so
    the block-wide reductions stay uniform.
    """
    pdl_prologue()
    cand_x, cand_j = _candidate_buffers()
    probe_keys = cuda.local.array(PROBES, int32)
    probe_vals = cuda.local.array(PROBES, float32)
    counts = cuda.local.array(BUCKETS, int32)         # this thread's bucket histogram
    masses = cuda.local.array(BUCKETS, float32)
    tot_counts = cuda.local.array(BUCKETS, float32)   # the block's
    tot_masses = cuda.local.array(BUCKETS, float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    last_part = cuda.shared.array(1, int32)           # greedy: whether this block is the row's last part
    for work in range(cuda.blockIdx.x, logits.shape[0] * parts, cuda.gridDim.x):
        row = work // parts
        part = work % parts
        words_row = words[row]
        if head_done != 0 and row == 0 and not (temperature[row] > float32(0.0)):
            continue                                        # the LM head picked it (uniform across the block)
        if not (temperature[row] > float32(0.0)):
            # -- greedy: this block's slice, then the last block of the row merges the parts
            g_end = n_vec * (part + 1) // parts
            t_max, t_jmax = _fold_range(_visit_argmax, (_NEG_INF, int32(NO_INDEX)), (), words_row, logits, row,
                                        n_vec * part // parts, g_end, 8 * n_vec if part == parts - 1 else
                                        logits.shape[1])
            xmax, jmax = _block_argmax(t_max, t_jmax)
            if tid == 0:
                part_max[row * parts + part] = xmax
                part_index[row * parts + part] = jmax
                cuda.threadfence()                          # publish the part before counting it
                last_part[0] = 1 if cuda.atomic.add(counters, row, 1) == parts - 1 else 0
            cuda.syncthreads()
            if last_part[0] == 1:                           # the whole block merges: one round trip for all parts
                cuda.threadfence()
                p_max = _NEG_INF
                p_j = int32(NO_INDEX)
                for q in range(tid, parts, nt):             # (parts ≤ block size: one each)
                    if part_max[row * parts + q] > p_max:
                        p_max = part_max[row * parts + q]
                        p_j = part_index[row * parts + q]
                # parts cover increasing index ranges, so the smallest index among equal maxima is the first part's
                best, best_j = _block_argmax(p_max, p_j)
                if tid == 0:
                    out_ids[row] = best_j if best_j != NO_INDEX else 0
                    kept_threshold[row] = best
                    kept_count[row] = 1
                    counters[row] = 0                       # at rest again (graph replays)
            cuda.syncthreads()                              # last_part is reused by the next item
            continue
        if part > 0:
            continue                                        # a sampled row is one block's
        # -- pass 1: the max and where it is; each thread keeps its own max for the top-k bound
        t_max, t_jmax = _fold_row(_visit_argmax, (_NEG_INF, int32(NO_INDEX)), (), words_row, logits, row, n_vec)
        xmax, jmax = _block_argmax(t_max, t_jmax)
        temp = temperature[row]
        if not (temp > float32(0.0)) or not (xmax > _NEG_INF and xmax < _INF):
            if tid == 0:                                    # greedy (or a row no softmax can be taken of)
                out_ids[row] = jmax if jmax != NO_INDEX else 0
                kept_threshold[row] = xmax
                kept_count[row] = 1
            continue
        inv_t = float32(float32(1.0) / temp)
        kmax = _key_of(xmax)
        k = top_k[row]
        p = top_p[row]
        mp = min_p[row]
        k_on = k > 0
        p_on = p < float32(1.0)
        m_on = mp > float32(0.0)

        # -- θ lies in [lo, hi): lo from min-p (exact) and top-k (k-th largest thread max), hi above the max
        t_min_p = int32(KEY_FLOOR)
        if m_on:
            t_min_p = _lowest_key_with_weight(mp, kmax, xmax, inv_t)
        lo = t_min_p
        if k_on and k <= nt:
            lo = max(lo, _block_kth_largest_key(t_max, k))
        hi = kmax + 1
        if not (k_on or p_on):
            hi = lo + 1                                     # min-p alone (or no filter): θ = lo
        # top-p: tokens lighter than (1 - p) Z / (2V) cannot all be needed; Z ≥ 1 gives a first, looser bound
        use_p_bound = p_on and float32(1.0) - p >= float32(EXACT_TOP_P_MARGIN)
        p_scale = float32(_HALF * (float32(1.0) - p) / float32(logits.shape[1]))
        lo_loose = lo
        if use_p_bound:
            lo_loose = max(lo, _lowest_key_with_weight(p_scale, kmax, xmax, inv_t))

        # -- pass 2: the tokens ≥ lo and ≥ lo_loose, and Z when top-p is on
        n_lo, n_loose, z_t = _fold_row(_visit_counts, (int32(0), int32(0), float32(0.0)),
                                       (_value_of(lo), _value_of(lo_loose), _NEG_INF if p_on else _INF, xmax,
                                        inv_t), words_row, logits, row, n_vec)
        count_lo, count_loose, z = _block_sum3(float32(n_lo), float32(n_loose), z_t)
        pz = float32(p * z)
        n_t = n_lo
        if use_p_bound:
            lo_tight = max(lo, _lowest_key_with_weight(float32(p_scale * z), kmax, xmax, inv_t))
            lo = lo_loose
            n_t = n_loose
            count_lo = count_loose
            if count_lo > capacity and lo_tight > lo:       # one more counting pass at the tighter bound
                n_t, _, _ = _fold_row(_visit_counts, (int32(0), int32(0), float32(0.0)),
                                      (_value_of(lo_tight), _INF, _INF, xmax, inv_t), words_row, logits, row, n_vec)
                lo = lo_tight
                count_lo = _block_sum(float32(n_t))

        # -- too many tokens ≥ lo for shared memory: search with full passes until they fit (or θ is found)
        while count_lo > capacity and hi - lo > 1:
            _set_probes(probe_keys, probe_vals, lo, hi)
            _clear_buckets(counts, masses)
            _fold_row(_visit_buckets, (counts, masses), (probe_vals, PROBES, xmax, inv_t, p_on), words_row, logits,
                      row, n_vec)
            _block_bucket_totals(counts, masses, tot_counts, tot_masses)
            lo, hi, q = _search_step(lo, hi, probe_keys, tot_counts, tot_masses, k_on, k, p_on, pz, m_on, t_min_p)
            if q >= 0:
                n_t = int32(_at_or_above(counts, q))
                count_lo = _at_or_above(tot_counts, q)

        best = _NEG_INF
        best_j = int32(NO_INDEX)
        key1, key2 = _row_keys(seed[row], step[row])
        if count_lo <= capacity:
            # -- pass 3: copy the tokens ≥ lo into shared memory; finish the search and draw there
            start = _block_exclusive_scan(n_t)
            _fold_row(_visit_compact, (start,), (_value_of(lo), cand_x, cand_j), words_row, logits, row, n_vec)
            cuda.syncthreads()
            n_cand = int32(count_lo)
            while hi - lo > 1:
                _set_probes(probe_keys, probe_vals, lo, hi)
                _clear_buckets(counts, masses)
                for c in range(tid, n_cand, nt):
                    _visit_buckets((counts, masses), (probe_vals, PROBES, xmax, inv_t, p_on), cand_x[c], cand_j[c])
                _block_bucket_totals(counts, masses, tot_counts, tot_masses)
                lo, hi, q = _search_step(lo, hi, probe_keys, tot_counts, tot_masses, k_on, k, p_on, pz, m_on,
                                         t_min_p)
                if q >= 0:
                    count_lo = _at_or_above(tot_counts, q)
            gumbel_args = (_value_of(lo), xmax, inv_t, key1, key2)
            for c in range(tid, n_cand, nt):
                best, best_j = _visit_gumbel((best, best_j), gumbel_args, cand_x[c], cand_j[c])
        else:
            # -- θ = lo, and more than `capacity` tokens are kept: draw with one more full pass
            best, best_j = _fold_row(_visit_gumbel, (best, best_j), (_value_of(lo), xmax, inv_t, key1, key2),
                                     words_row, logits, row, n_vec)
        best, best_j = _block_argmax(best, best_j)
        if tid == 0:
            out_ids[row] = best_j if best_j != NO_INDEX else jmax
            kept_threshold[row] = _value_of(lo)
            kept_count[row] = int32(count_lo)


def sample(logits, params: SamplingBuffers, out_ids, workspace, *,
           candidate_capacity: int = CANDIDATE_CAPACITY, head: HeadArgmax | None = None,
           policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Draw one token per row of logits ``[B, V]`` (bf16 bits) with row ``r``'s parameters from ``params``
    (temperature 0 → greedy; top-k / top-p / min-p; seeded Gumbel-max draw) into out_ids ``[≥B]`` int32.
    ``workspace``: from ``allocate_sample_workspace(≥ B)`` (``workspace_views`` reads it).
    ``candidate_capacity`` (≤ CANDIDATE_CAPACITY) only changes speed, never the token: tests lower it to take the
    full-pass search path.  ``head``: one row, whose greedy token (if its temperature is 0) the LM head launch
    before already wrote through ``head`` (built over these ``out_ids`` and ``workspace``).  One kernel launch, no
    host round trip, no allocation: safe to capture in a CUDA graph."""
    words, n_vec = _row_words(logits)
    n_rows = logits.shape[0]
    _check_rows_out("out_ids", out_ids, np.int32, n_rows)
    assert params.max_batch >= n_rows, (params.max_batch, n_rows)
    threshold, kept, part_max, part_index, counters = _workspace_parts(workspace)
    assert threshold.shape[0] >= n_rows, (workspace.shape, n_rows)
    capacity = int(min(max(int(candidate_capacity), 1), CANDIDATE_CAPACITY))
    if n_rows == 0:
        return
    if head is not None:
        assert n_rows == 1, "the LM head's argmax serves one row"
    launch(sample_kernel, grid(n_rows * GREEDY_PARTS), threads(gpu=SAMPLE_THREADS, sim=SAMPLE_THREADS_SIM), words,
           logits, n_vec, params.temperature, params.top_k, params.top_p, params.min_p, params.seed, params.step,
           capacity, out_ids, threshold, kept, np.int32(GREEDY_PARTS), part_max, part_index, counters,
           np.int32(head is not None), name="sample", policy=policy)
