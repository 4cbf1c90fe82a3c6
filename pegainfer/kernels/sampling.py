"""Token selection on the GPU: greedy argmax, temperature / top-k / top-p / min-p sampling, and log-sum-exp.

The decode step is captured in a CUDA graph with sampling inside it, so every per-request knob lives in device
arrays (``SamplingBuffers``) that the engine refreshes before each replay; only the chosen token ids ``[B]`` int32
cross back to the host.  Logits are bf16 bits ``[B, V]`` (``B`` rows = sequences of the step, ``V`` = vocabulary;
a row-strided view is fine).

What a row's draw means
-----------------------
With ``z = logits / T`` and ``p = softmax(z)``:

* ``T == 0``: greedy, the argmax (ties → the smallest index).
* otherwise a token is kept when it passes every active filter, each computed on the full distribution ``p``:
  **top-k** (``k > 0``): logit ≥ the k-th largest logit — ties with the k-th all stay, as in vLLM;
  **top-p** (``p < 1``): the smallest set of largest-probability tokens whose mass reaches ``p`` (ties at the
  boundary all stay; never empty); **min-p** (``min_p > 0``): ``p_i ≥ min_p · p_max``.  One token is drawn from
  the kept set in proportion to ``p`` (renormalised).  vLLM applies the filters one after another (top-p on the
  renormalised top-k / min-p survivors); here they intersect, which keeps the same tokens except when top-p is the
  binding filter, where it can keep a few more.

All three filters keep an *upper set* of the logits, so the kept set is ``{i : logit_i ≥ θ}`` for one threshold
``θ``.  Because logits are bf16, ``θ`` takes at most 65536 values: the kernel searches it on the **ordered 16-bit
key** of a bf16 (``_key_of``: integer order = float order, -0 = +0), where a key ``t`` is ≤ ``θ`` exactly when
``count(logit ≥ t) ≥ k`` (top-k on), or ``mass(logit ≥ t) ≥ p · Z`` (top-p on, ``Z`` = the row's total mass),
or ``t ≤ t_min_p`` (min-p on; ``t_min_p`` is found without touching memory).  Each search step tests 7 keys spread
over the current range ``[lo, hi)`` at once — one pass histogramming the logits (count and mass) into the 8 buckets
they cut — so ``θ`` is exact after at most 6 steps (8^6 > 65536).  Ties need no special care: equal logits have
equal keys and fall on the same side of every probe.

The draw is the Gumbel-max trick: ``argmax_i (z_i + g_i)`` over kept tokens, with ``g_i = -log(-log u_i)`` and
``u_i`` a counter-based hash of ``(seed, step, i)`` — one pass, no sort, no random state, and the same
``(seed, step)`` always gives the same token.

Cost (one block of 512 threads per sampled row; every full pass re-reads the row, from L2)
-------------------------------------------------------------------------------------------
A greedy row (``T == 0``) is one pass for its max, split over ``GREEDY_PARTS`` blocks that each read a slice and
merge through the workspace (one SM reading a whole 152k-logit row took ~14 µs on the H200).  A sampled row:
1. one pass: the max and its index (each thread also keeps its own max);
2. one pass counting the tokens at or above a *lower bound* ``lo`` of ``θ`` and, when top-p is on, summing ``Z``
   (one ``exp`` per token).  ``lo`` is the largest of: ``t_min_p``; the k-th largest of the threads' maxima (k
   distinct tokens are at least that large, so it is ≤ the k-th largest logit); for top-p, the smallest logit of
   probability ≥ ``(1 - p) / (2V)`` (all lighter tokens together carry under ``(1 - p) / 2`` of the mass, so the
   top-p set cannot end below it; first with ``Z ≥ 1``, then — one more cheap counting pass if that was not
   enough — with the true ``Z``);
3. when at most ``CANDIDATE_CAPACITY`` (4096) tokens lie at or above ``lo`` (the usual case: a few hundred for
   top-p 0.9 or top-k 50 on a language model's logits), one more pass copies them (logit, index) into shared
   memory, and the search and the Gumbel draw finish there (≤ 8 candidates per thread per step).  A typical row
   thus costs 3–4 passes over ``V`` (one with an ``exp`` per token): roughly 10–20 µs on one H200 SM for
   V = 151936; ``B`` rows run on ``B`` SMs at once.
4. otherwise (near-flat distributions, top-p near 1, k > 512) the search steps are full passes (≤ 6, each a
   compare loop plus an ``exp`` per token above the lowest probe) until the tokens at or above ``lo`` fit; a draw
   that still keeps more than 4096 tokens (e.g. no filter at all) takes one more full pass (a hash and two logs
   per kept token that could still win).
``benchmarks/bench_sampling.py`` measures it.

Log-probabilities
-----------------
``logsumexp`` is one pass per row (online max and sum of ``exp`` in f32); ``top_logprobs`` turns a host copy of
one row plus its ``lse`` into the chosen token's logprob and the top-N — the raw model distribution
(temperature 1, before any filter), as vLLM reports it.

Reading a row
-------------
``_fold_row`` walks one row with the whole block: 16-byte loads of 8 bf16s, four loads in flight per thread,
handing every logit (as f32) and its index to a *visitor* device function that updates a per-thread state tuple.
Rows whose start or stride is not 16-byte aligned fall back to 2-byte loads.  Each thread sees its tokens in
increasing index order (so a strict ``>`` keeps the first of equal values).
"""
from __future__ import annotations

import types as _pytypes

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import current_stream, launch
from pegainfer.kernels.primitives import (pdl_prologue, FULL_MASK, NO_INDEX, WARP, bf16x2_hi, bf16x2_lo, bits_f32,
                                          block_argmax, block_sum, cuda, device_fn, f32_bits, float32, from_bf16_bits,
                                          grid, int32, kernel, load_u32x4, math, threads, uint32, warp_argmax,
                                          warp_sum)

CANDIDATE_CAPACITY = 4096          # tokens a sampling block can hold in shared memory (logit f32 + index i32)
GUMBEL_MAX = 17.0                  # > the largest Gumbel value the 23-bit uniforms can give (16.64)
GREEDY_BELOW = 1e-5                # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
EXACT_TOP_P_MARGIN = 1e-4          # the top-p lower bound is used only when 1 - p leaves room for f32 sums
PROBES = 7                         # thresholds a search step tests at once: an 8-way split of the key range
BUCKETS = PROBES + 1
_TOTAL_ROWS = 2 * BUCKETS          # bucket counts then masses, in the block-total scratch
KEY_FLOOR = 0x007F                 # ordered key of -inf: the lowest threshold (keeps every non-NaN logit)

ARGMAX_THREADS = 1024              # block size of the one-pass kernels (argmax, logsumexp)
GREEDY_PARTS = threads(gpu=16, sim=3)   # blocks per greedy row in ``sample`` (each takes 1/GREEDY_PARTS of V)
SAMPLE_THREADS = 512               # block size of the sampling kernel
SAMPLE_THREADS_SIM = 8             # ... in the simulator, where every thread is a Python thread (any size works)

_INF = float32(math.inf)
_NEG_INF = float32(-math.inf)
_M32 = np.uint64(0xFFFFFFFF)
_U23_SCALE = float32(2.0 ** -23)
_HALF = float32(0.5)


def _kernel_with_block(max_threads: int):
    """``@kernel`` that on the GPU also declares the block size as a launch bound, so the compiler keeps each thread
    within the registers a full block may have (65536 / max_threads) and the launch cannot fail for lack of them."""
    return kernel if SIMULATOR else cuda.jit(cache=True, launch_bounds=max_threads)


# ------------------------------------------------------------------------------------------ walking one row
@device_fn
def _visit_group(visit, state, args, w, j0):
    """Visit the 8 bf16s packed in the four words ``w`` (logits ``j0 .. j0+7``, lower index in the low half)."""
    state = visit(state, args, bf16x2_lo(w[0]), j0)
    state = visit(state, args, bf16x2_hi(w[0]), j0 + 1)
    state = visit(state, args, bf16x2_lo(w[1]), j0 + 2)
    state = visit(state, args, bf16x2_hi(w[1]), j0 + 3)
    state = visit(state, args, bf16x2_lo(w[2]), j0 + 4)
    state = visit(state, args, bf16x2_hi(w[2]), j0 + 5)
    state = visit(state, args, bf16x2_lo(w[3]), j0 + 6)
    state = visit(state, args, bf16x2_hi(w[3]), j0 + 7)
    return state


@device_fn
def _fold_row(visit, state, args, words_row, logits, row, n_vec):
    """``state = visit(state, args, logit_f32, index)`` over this thread's share of row ``row``; returns the state.

    words_row ``[V // 2]`` uint32 (the row as packed bf16 pairs), logits ``[B, V]`` uint16; the first ``8 * n_vec``
    logits are read as 16-byte groups (group ``g`` = logits ``8g .. 8g+7``), groups ``tid, tid + nt, ...``, four
    loads issued before any is used (the clamped extra loads past the end re-read the last group and are not
    visited); the rest with 2-byte loads.  No block-wide operation inside: threads may run different trip counts.
    """
    return _fold_range(visit, state, args, words_row, logits, row, 0, n_vec, 8 * n_vec)


@device_fn
def _fold_range(visit, state, args, words_row, logits, row, g_begin, g_end, j_begin):
    """``_fold_row`` over the 16-byte groups ``g_begin .. g_end - 1`` and then the single logits from ``j_begin`` to
    the end of the row (``j_begin`` = V: none), as ``_fold_row`` reads them."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    last = g_end - 1
    for g in range(g_begin + tid, g_end, 4 * nt):
        a = load_u32x4(words_row, 4 * g)
        b = load_u32x4(words_row, 4 * min(g + nt, last))
        c = load_u32x4(words_row, 4 * min(g + 2 * nt, last))
        d = load_u32x4(words_row, 4 * min(g + 3 * nt, last))
        state = _visit_group(visit, state, args, a, 8 * g)
        if g + nt <= last:
            state = _visit_group(visit, state, args, b, 8 * (g + nt))
        if g + 2 * nt <= last:
            state = _visit_group(visit, state, args, c, 8 * (g + 2 * nt))
        if g + 3 * nt <= last:
            state = _visit_group(visit, state, args, d, 8 * (g + 3 * nt))
    for j in range(j_begin + tid, logits.shape[1], nt):
        state = visit(state, args, bits_f32(uint32(logits[row, j]) << uint32(16)), j)
    return state


# ------------------------------------------------------------------------------------------ visitors
@device_fn
def _visit_argmax(state, args, x, j):
    """state (max, its index): the first index of the largest logit this thread saw (NaN never wins)."""
    best, best_j = state
    if x > best:
        best = x
        best_j = int32(j)
    return best, best_j


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


# ------------------------------------------------------------------------------------------ block-wide helpers
# Every thread of the block calls these equally often and gets the same result.  On the GPU they use warp
# shuffles; in the simulator, where each barrier costs milliseconds, the same results come from numpy over a shared
# buffer with two barriers.  (The simulator hands out a shared array on the first call from each source line
# without a lock, so two threads racing there could get different arrays: its allocations here take a lock.)
if SIMULATOR:
    import threading

    _SIM_ALLOC_LOCK = threading.Lock()

    @device_fn
    def _candidate_buffers():
        """The sampling block's shared candidate arrays: logits (f32) and indices (i32), CANDIDATE_CAPACITY each."""
        with _SIM_ALLOC_LOCK:
            cand_x = cuda.shared.array(CANDIDATE_CAPACITY, float32)
            cand_j = cuda.shared.array(CANDIDATE_CAPACITY, int32)
        return cand_x, cand_j

    @device_fn
    def _block_argmax(v, i):
        """(max of ``v``, its index ``i``) over the block, ties → the smaller index."""
        with _SIM_ALLOC_LOCK:
            vals = cuda.shared.array(1024, np.float64)
            idxs = cuda.shared.array(1024, np.int64)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        vals[t] = v
        idxs[t] = i
        cuda.syncthreads()
        best = vals[:nt].max()
        best_i = idxs[:nt][vals[:nt] == best].min()
        cuda.syncthreads()
        return float32(best), int32(best_i)

    @device_fn
    def _block_sum(v):
        """Sum of the f32 ``v`` over the block."""
        with _SIM_ALLOC_LOCK:
            buf = cuda.shared.array(1024, np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t] = v
        cuda.syncthreads()
        s = buf[:nt].sum(dtype=np.float32)
        cuda.syncthreads()
        return float32(s)

    @device_fn
    def _block_sum3(a, b, c):
        """Sums of three f32 values over the block."""
        with _SIM_ALLOC_LOCK:
            buf = cuda.shared.array((1024, 3), np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t, 0] = a
        buf[t, 1] = b
        buf[t, 2] = c
        cuda.syncthreads()
        s = buf[:nt].sum(axis=0, dtype=np.float32)
        cuda.syncthreads()
        return float32(s[0]), float32(s[1]), float32(s[2])

    @device_fn
    def _block_exclusive_scan(v):
        """Exclusive prefix sum of the int ``v`` in thread order."""
        with _SIM_ALLOC_LOCK:
            buf = cuda.shared.array(1024, np.int64)
        t = cuda.threadIdx.x
        buf[t] = v
        cuda.syncthreads()
        s = buf[:t].sum()
        cuda.syncthreads()
        return int32(s)

    @device_fn
    def _block_bucket_totals(counts, masses, tot_counts, tot_masses):
        """Block-wide totals of the per-thread bucket histograms, into every thread's ``tot_*`` (f32)."""
        with _SIM_ALLOC_LOCK:
            buf = cuda.shared.array((1024, 2 * BUCKETS), np.float64)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t, :BUCKETS] = counts[:BUCKETS]
        buf[t, BUCKETS:] = masses[:BUCKETS]
        cuda.syncthreads()
        tot = buf[:nt].sum(axis=0)
        cuda.syncthreads()
        tot_counts[:BUCKETS] = tot[:BUCKETS]
        tot_masses[:BUCKETS] = tot[BUCKETS:]

    @device_fn
    def _block_kth_largest_key(v, k):
        """Ordered key of the k-th largest (1 ≤ k ≤ threads) of the threads' values ``v``."""
        with _SIM_ALLOC_LOCK:
            buf = cuda.shared.array(1024, np.float32)
        t, nt = cuda.threadIdx.x, cuda.blockDim.x
        buf[t] = v
        cuda.syncthreads()
        kth = np.sort(buf[:nt])[nt - k]
        cuda.syncthreads()
        return _key_of(float32(kth))
else:
    @device_fn
    def _candidate_buffers():
        """The sampling block's shared candidate arrays: logits (f32) and indices (i32), CANDIDATE_CAPACITY each."""
        return cuda.shared.array(CANDIDATE_CAPACITY, float32), cuda.shared.array(CANDIDATE_CAPACITY, int32)

    _block_argmax = block_argmax

    @device_fn
    def _block_sum(v):
        """Sum of the f32 ``v`` over the block."""
        return block_sum(v)

    @device_fn
    def _block_sum3(a, b, c):
        """Sums of three f32 values over the block (one shared round for the three)."""
        part = cuda.shared.array((3, 32), float32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        a = warp_sum(float32(a))
        b = warp_sum(float32(b))
        c = warp_sum(float32(c))
        cuda.syncthreads()
        if lane == 0:
            part[0, wid] = a
            part[1, wid] = b
            part[2, wid] = c
        cuda.syncthreads()
        a = float32(0.0)
        b = float32(0.0)
        c = float32(0.0)
        if lane < (cuda.blockDim.x + WARP - 1) // WARP:
            a = part[0, lane]
            b = part[1, lane]
            c = part[2, lane]
        return warp_sum(a), warp_sum(b), warp_sum(c)

    @device_fn
    def _block_exclusive_scan(v):
        """Exclusive prefix sum of the int ``v`` in thread order: a shuffle scan per warp, then the warp totals."""
        warp_total = cuda.shared.array(32, int32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        s = int32(v)
        for d in (1, 2, 4, 8, 16):
            other = cuda.shfl_up_sync(FULL_MASK, s, d)
            if lane >= d:
                s += other
        cuda.syncthreads()
        if lane == WARP - 1:
            warp_total[wid] = s
        cuda.syncthreads()
        for w in range(wid):
            s += warp_total[w]
        return int32(s - v)

    @device_fn
    def _block_bucket_totals(counts, masses, tot_counts, tot_masses):
        """Block-wide totals of the per-thread bucket histograms, into every thread's ``tot_*`` (f32)."""
        part = cuda.shared.array((_TOTAL_ROWS, 32), float32)
        totals = cuda.shared.array(_TOTAL_ROWS, float32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        for b in range(BUCKETS):
            c = warp_sum(float32(counts[b]))
            m = warp_sum(masses[b])
            if lane == 0:
                part[b, wid] = c
                part[BUCKETS + b, wid] = m
        cuda.syncthreads()
        if cuda.threadIdx.x < _TOTAL_ROWS:
            t = float32(0.0)
            for w in range((cuda.blockDim.x + WARP - 1) // WARP):
                t += part[cuda.threadIdx.x, w]
            totals[cuda.threadIdx.x] = t
        cuda.syncthreads()
        for b in range(BUCKETS):
            tot_counts[b] = totals[b]
            tot_masses[b] = totals[BUCKETS + b]

    @device_fn
    def _block_kth_largest_key(v, k):
        """Ordered key of the k-th largest (1 ≤ k ≤ threads) of the threads' values ``v``: a bisection on the key,
        counting the threads at or above each probe with warp ballots (16 steps)."""
        warp_counts = cuda.shared.array(32, int32)
        lane = cuda.threadIdx.x % WARP
        wid = cuda.threadIdx.x // WARP
        key = _key_of(v)
        lo = 0               # count(key ≥ lo) ≥ k
        hi = 0x10000         # count(key ≥ hi) = 0 < k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            c = cuda.popc(cuda.ballot_sync(FULL_MASK, key >= mid))
            cuda.syncthreads()
            if lane == 0:
                warp_counts[wid] = c
            cuda.syncthreads()
            total = 0
            for w in range((cuda.blockDim.x + WARP - 1) // WARP):
                total += warp_counts[w]
            if total >= k:
                lo = mid
            else:
                hi = mid
        return int32(lo)


# ------------------------------------------------------------------------------------------ bf16 keys, weights
@device_fn
def _key_of(x):
    """Ordered 16-bit key of a (non-NaN) bf16 value held in an f32: integer order = float order, -0 = +0."""
    b = int32(f32_bits(x) >> uint32(16))
    if b == 0x8000:
        b = int32(0)
    if b & 0x8000:
        return int32(0xFFFF - b)
    return int32(b | 0x8000)


@device_fn
def _value_of(key):
    """The bf16 value (as f32) of an ordered key."""
    if key >= 0x8000:
        b = key & 0x7FFF
    else:
        b = 0xFFFF - key
    return bits_f32(uint32(b) << uint32(16))


@device_fn
def _weight(x, xmax, inv_t):
    """Unnormalised probability ``exp((x - xmax) / T)`` in f32 (1 for the largest logit)."""
    return float32(math.exp(float32((x - xmax) * inv_t)))


@device_fn
def _lowest_key_with_weight(c, kmax, xmax, inv_t):
    """The smallest key in ``[KEY_FLOOR, kmax]`` whose value has weight ≥ ``c`` (``kmax`` when none does): 16
    scalar bisection steps, no memory traffic."""
    lo = KEY_FLOOR - 1
    hi = kmax
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _weight(_value_of(mid), xmax, inv_t) >= c:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------------------------------ the threshold search
@device_fn
def _set_probes(probe_keys, probe_vals, lo, hi):
    """PROBES keys spread evenly over ``(lo, hi)`` (ascending; repeats when the range is small), and their values."""
    span = hi - lo
    for q in range(PROBES):
        key = min(lo + max(1, ((q + 1) * span) // BUCKETS), hi - 1)
        probe_keys[q] = key
        probe_vals[q] = _value_of(key)


@device_fn
def _clear_buckets(counts, masses):
    for b in range(BUCKETS):
        counts[b] = 0
        masses[b] = float32(0.0)


@device_fn
def _at_or_above(buckets, q):
    """Total (f32) of buckets ``q+1 ..``: the tokens (or mass) ≥ probe ``q``."""
    s = float32(0.0)
    for b in range(q + 1, BUCKETS):
        s += float32(buckets[b])
    return s


@device_fn
def _keeps_threshold(count, mass, t, k_on, k, p_on, pz, m_on, t_min_p):
    """Whether key ``t`` is ≤ the kept set's threshold θ, from count / mass of the logits ≥ value(t)."""
    return (k_on and count >= k) or (p_on and mass >= pz) or (m_on and t <= t_min_p)


@device_fn
def _search_step(lo, hi, probe_keys, tot_counts, tot_masses, k_on, k, p_on, pz, m_on, t_min_p):
    """Narrow ``[lo, hi)`` (θ ≥ lo, θ < hi) with the block totals of a probe pass: the largest probe still ≤ θ
    becomes ``lo``, the next one ``hi``.  Returns (lo, hi, that probe's index or -1)."""
    chosen = -1
    for q in range(PROBES):
        if _keeps_threshold(_at_or_above(tot_counts, q), _at_or_above(tot_masses, q), probe_keys[q],
                            k_on, k, p_on, pz, m_on, t_min_p):
            lo = probe_keys[q]
            chosen = q
        else:
            hi = probe_keys[q]
            break
    return lo, hi, chosen


# ------------------------------------------------------------------------------------------ counter-based RNG
@device_fn
def _mix32(h):
    """murmur3's 32-bit finaliser (a bijection on 32-bit values), computed in uint64 without overflow."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    return h ^ (h >> np.uint64(16))


@device_fn
def _row_keys(seed, step):
    """Two 32-bit keys (in uint64) from a row's 64-bit seed and its step."""
    seed = np.uint64(seed)
    key1 = _mix32((seed & _M32) ^ _mix32((np.uint64(step) & _M32) ^ np.uint64(0x27D4EB2F)))
    key2 = _mix32((seed >> np.uint64(32)) ^ _mix32(key1 ^ np.uint64(0x165667B1)))
    return key1, key2


@device_fn
def _gumbel(key1, key2, j):
    """Standard Gumbel variate for token ``j``: ``-log(-log u)``, ``u = (h >> 9 + 1/2) / 2^23`` in (0, 1) from the
    hash ``h`` of (keys, j) — 23 bits keep ``u`` below 1 in f32 (the largest value is 16.64 < GUMBEL_MAX)."""
    h = _mix32((np.uint64(j) * np.uint64(0x9E3779B9) + key1) & _M32)
    h = _mix32(h ^ key2)
    u = (float32(h >> np.uint64(9)) + _HALF) * _U23_SCALE
    return float32(-math.log(float32(-math.log(u))))


# ------------------------------------------------------------------------------------------ kernels
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


@_kernel_with_block(SAMPLE_THREADS)
def sample_kernel(words, logits, n_vec, temperature, top_k, top_p, min_p, seed, step, capacity,
                  out_ids, kept_threshold, kept_count, parts, part_max, part_index, counters, head_done):
    """Draw one token per row (module docstring: filters, threshold search, Gumbel-max draw, cost).

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
    The merge is one memory round trip (thread 0 used to read the parts one after another): every thread loads
    one part's (max, index), then one block argmax (ties → the smaller index, i.e. the earlier part's: the token
    one block would pick).  A sampled row is one block, ``q = 0`` (the others return at once).  Every branch below depends only on per-row
    values all threads share, so the block-wide reductions stay uniform.
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


# ------------------------------------------------------------------------------------------ host side
def _address(arr) -> int:
    if SIMULATOR:
        return int(arr.ctypes.data)
    return int(arr.device_ctypes_pointer.value or 0)


def _row_words(logits):
    """(``[B, V // 2]`` uint32 view of the first ``V - V % 2`` logits of each row, number of 16-byte groups per row
    the kernels may read: ``V // 8`` when the data and the row stride are 16-byte aligned, else 0)."""
    assert logits.ndim == 2 and logits.dtype == np.uint16, (logits.shape, logits.dtype)
    assert logits.strides[1] == 2, "logits rows must be contiguous (a row-strided view is fine)"
    n_rows, vocab = logits.shape
    even = logits[:, : vocab - vocab % 2]
    if SIMULATOR or even.is_c_contiguous():
        words = even.view(np.uint32)
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        words = DeviceNDArray(shape=(n_rows, vocab // 2), strides=(logits.strides[0], 4), dtype=np.uint32,
                              gpu_data=even.gpu_data, stream=even.stream)
    aligned = _address(logits) % 16 == 0 and (n_rows == 1 or logits.strides[0] % 16 == 0)
    return words, (vocab // 8 if aligned else 0)


def _check_rows_out(name, arr, dtype, n_rows):
    assert arr.ndim == 1 and arr.dtype == dtype and arr.shape[0] >= n_rows, (name, arr.shape, arr.dtype, n_rows)


def argmax(logits, out_ids) -> None:
    """``out_ids[r] = argmax(logits[r])`` for logits ``[B, V]`` bf16 bits (ties → the smallest index), out_ids
    ``[≥B]`` int32."""
    words, n_vec = _row_words(logits)
    _check_rows_out("out_ids", out_ids, np.int32, logits.shape[0])
    if logits.shape[0] == 0:
        return
    launch(argmax_kernel, grid(logits.shape[0]), threads(gpu=ARGMAX_THREADS, sim=32), words, logits, n_vec, out_ids,
           name="argmax", pdl=True)


def logsumexp(logits, out_lse) -> None:
    """``out_lse[r] = log Σ exp(logits[r])`` (f32) for logits ``[B, V]`` bf16 bits, out_lse ``[≥B]`` f32 — the
    normaliser of the raw model distribution, for ``top_logprobs``."""
    words, n_vec = _row_words(logits)
    _check_rows_out("out_lse", out_lse, np.float32, logits.shape[0])
    if logits.shape[0] == 0:
        return
    launch(logsumexp_kernel, grid(logits.shape[0]), threads(gpu=ARGMAX_THREADS, sim=32), words, logits, n_vec, out_lse,
           name="logsumexp", pdl=True)


class SamplingBuffers:
    """Per-row sampling parameters as device arrays (read by ``sample`` inside the captured decode graph), with a
    pinned host mirror: ``set_row`` writes the mirror, ``upload`` copies all of it to the device in one copy.

    Device arrays ``[max_batch]``: ``temperature`` f32 (0 = greedy), ``top_k`` i32 (0 = off), ``top_p`` f32
    (1 = off), ``min_p`` f32 (0 = off), ``seed`` uint64, ``step`` i32 (the draw's position, so every step of a
    seeded request gets a fresh but reproducible variate).  The host mirror is ``host.<same name>``.  Rows start
    greedy.  ``storage``: (pinned host bytes, device bytes) of ``nbytes(max_batch)`` each to lay the fields out in
    (the engine's ``StepInputs`` passes a prefix of its own buffer, so one copy uploads a whole step's inputs);
    by default the buffers allocate their own.
    """

    FIELDS = (("temperature", np.float32, 0.0), ("top_k", np.int32, 0), ("top_p", np.float32, 1.0),
              ("min_p", np.float32, 0.0), ("seed", np.uint64, 0), ("step", np.int32, 0))

    @classmethod
    def _layout(cls, max_batch: int) -> tuple[list[int], int]:
        """Byte offset of each field (8-byte aligned slices) and the total."""
        offsets, nbytes = [], 0
        for _, dtype, _ in cls.FIELDS:
            offsets.append(nbytes)
            nbytes += -(-int(max_batch) * np.dtype(dtype).itemsize // 8) * 8
        return offsets, nbytes

    @classmethod
    def nbytes(cls, max_batch: int) -> int:
        """Bytes of the fields for ``max_batch`` rows (the size of ``storage``)."""
        return cls._layout(max_batch)[1]

    def __init__(self, max_batch: int, storage=None):
        self.max_batch = int(max_batch)
        self.host = _pytypes.SimpleNamespace()
        # All fields live in one byte buffer so ``upload`` is a single copy per step.
        offsets, nbytes = self._layout(self.max_batch)
        if storage is None:
            self._host_bytes = cuda.pinned_array(nbytes, dtype=np.uint8)
            self._device_bytes = cuda.to_device(self._host_bytes)
        else:
            self._host_bytes, self._device_bytes = storage
            assert self._host_bytes.nbytes == nbytes == self._device_bytes.nbytes, (nbytes, self._host_bytes.nbytes)
        for (name, dtype, default), off in zip(self.FIELDS, offsets):
            n = self.max_batch * np.dtype(dtype).itemsize
            mirror = self._host_bytes[off:off + n].view(dtype)
            mirror[:] = default
            setattr(self.host, name, mirror)
            setattr(self, name, self._device_bytes[off:off + n].view(dtype))
        self._device_bytes.copy_to_device(self._host_bytes)

    def set_row(self, i: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                seed: int = 0, step: int = 0) -> None:
        """Set row ``i`` of the host mirror.  ``temperature`` below 1e-5 means greedy (as in vLLM), ``top_k <= 0``
        means off (vLLM's -1), any int seed is taken mod 2^64."""
        if not 0 <= i < self.max_batch:
            raise IndexError(f"row {i} outside [0, {self.max_batch})")
        if not (math.isfinite(temperature) and temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if not 0 <= step < 2**31:
            raise ValueError(f"step must be in [0, 2^31), got {step}")
        h = self.host
        h.temperature[i] = temperature if temperature >= GREEDY_BELOW else 0.0
        h.top_k[i] = min(max(int(top_k), 0), 2**31 - 1)
        h.top_p[i] = top_p
        h.min_p[i] = min_p
        h.seed[i] = int(seed) % 2**64
        h.step[i] = step

    def upload(self, stream=None) -> None:
        """Copy the host mirror to the device arrays (asynchronous on ``stream``, default: the launch stream)."""
        stream = current_stream() if stream is None else stream
        self._device_bytes.copy_to_device(self._host_bytes, stream=stream)


_WORDS_PER_ROW = 3 + 2 * GREEDY_PARTS   # threshold, kept, greedy counter + each part's (max, index)


def sample_workspace_size(max_rows: int, vocab: int = 0) -> int:
    """f32 elements of the ``workspace`` that ``sample`` needs for up to ``max_rows`` rows: per-row statistics
    (``workspace_views``) and the greedy rows' per-part maxima and counters.  Allocate it with
    ``allocate_sample_workspace`` (the counters must start at zero)."""
    return _WORDS_PER_ROW * int(max_rows)


def allocate_sample_workspace(max_rows: int, vocab: int = 0):
    """A zeroed device workspace for ``sample`` (``sample_workspace_size`` elements, at least one)."""
    return cuda.to_device(np.zeros(max(1, sample_workspace_size(max_rows, vocab)), np.float32))


def _workspace_parts(workspace):
    """(threshold ``[R]`` f32, kept ``[R]`` i32, part_max ``[R · P]`` f32, part_index ``[R · P]`` i32, counters
    ``[R]`` i32) views, ``R = size // (3 + 2P)``, ``P = GREEDY_PARTS``."""
    assert workspace.ndim == 1 and workspace.dtype == np.float32, (workspace.shape, workspace.dtype)
    r = workspace.shape[0] // _WORDS_PER_ROW
    rp = r * GREEDY_PARTS
    return (workspace[:r], workspace[r:2 * r].view(np.int32), workspace[2 * r:2 * r + rp],
            workspace[2 * r + rp:2 * r + 2 * rp].view(np.int32),
            workspace[2 * r + 2 * rp:3 * r + 2 * rp].view(np.int32))


def workspace_views(workspace):
    """(threshold ``[R]`` f32, kept ``[R]`` int32) views of a ``sample`` workspace: after ``sample``, row ``r``
    kept exactly the ``kept[r]`` tokens whose logit is ≥ ``threshold[r]`` (greedy rows: the max and 1) — for
    tests, tracing and debugging."""
    return _workspace_parts(workspace)[:2]


MAX_HEAD_BLOCKS = 1024
class HeadArgmax:
    """Where the LM head of a one-sequence step (``linear.linear_add_rms_norm(head=)``) writes the greedy token of
    its logits row, so that ``sample(head=)`` has nothing left to do for a greedy row: the head's blocks' (max,
    column) pairs with a counter after them (zero at rest), and views of what ``sample`` writes for a greedy row 0
    -- the token (``out_ids[0]``), the workspace's threshold and kept count.  The head's blocks merge the pairs
    with ``sample``'s rules (the first index of the largest logit, NaN never wins), so the token is the same."""

    def __init__(self, out_ids, workspace):
        threshold, kept, *_ = _workspace_parts(workspace)
        self.token, self.threshold, self.kept = out_ids[:1], threshold[:1], kept[:1]
        self.part_max = cuda.to_device(np.zeros(MAX_HEAD_BLOCKS, np.float32))
        self.part_index = cuda.to_device(np.zeros(MAX_HEAD_BLOCKS + 1, np.int32))


def sample(logits, params: SamplingBuffers, out_ids, workspace, *,
           candidate_capacity: int = CANDIDATE_CAPACITY, head: HeadArgmax | None = None, policy=None) -> None:
    """Draw one token per row of logits ``[B, V]`` (bf16 bits) with row ``r``'s parameters from ``params``
    (temperature 0 → greedy; top-k / top-p / min-p; seeded Gumbel-max draw) into out_ids ``[≥B]`` int32.
    ``workspace``: from ``allocate_sample_workspace(≥ B)`` (``workspace_views`` reads it).
    ``candidate_capacity`` (≤ CANDIDATE_CAPACITY) only changes speed, never the token: tests lower it to take the
    full-pass search path.  ``head``: one row, whose greedy token (if its temperature is 0) the LM head launch
    before already wrote through ``head`` (built over these ``out_ids`` and ``workspace``).  One kernel launch, no
    host round trip, no allocation: safe to capture in a CUDA graph.

    Tried and dropped (session 17): extra blocks of this launch asking the copy engine to bring the next decode
    step's first 24 MB of weights into L2 (``cp.async.bulk.prefetch.L2``, after the wait), meant to use the GPU
    memory's idle time between two steps: TPOT +2.5 % on both 4B models (``benchmarks/RESULTS.md``)."""
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
           np.int32(head is not None), name="sample", pdl=True)


def top_logprobs(logits_row, lse: float, token_id: int, n: int):
    """Log-probabilities of the raw distribution from one row's logits on the host (f32, or bf16 bits as uint16)
    and its ``lse`` (from ``logsumexp``): returns ``(logprob of token_id, [(id, logprob)] × n)``, the n most
    likely tokens in decreasing order (ties → smaller id first)."""
    row = np.asarray(logits_row)
    if row.dtype == np.uint16:
        row = from_bf16_bits(row)
    row = row.astype(np.float32, copy=False).reshape(-1)
    lse = np.float32(lse)
    chosen = float(row[token_id] - lse)
    n = int(min(max(n, 0), row.shape[0]))
    if n == 0:
        return chosen, []
    nth = np.partition(row, row.shape[0] - n)[row.shape[0] - n]       # the n-th largest logit
    above = np.flatnonzero(row > nth)
    top = np.concatenate([above, np.flatnonzero(row == nth)[: n - above.shape[0]]])
    top = top[np.lexsort((top, -row[top]))]
    return chosen, [(int(i), float(row[i] - lse)) for i in top]
