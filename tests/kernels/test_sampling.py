"""Token selection: argmax, seeded top-k / top-p / min-p sampling, log-sum-exp.

The tuned kernels are checked against the reference kernels (``sampling.reference``): the same token for the same
``(seed, step)``, exactly, over many rows of temperatures and filter settings; the same argmax; log-sum-exp within the
f32 rounding of a sum.  The reference is checked against float64 NumPy: its kept set exactly, and its draws against
the exact tempered softmax with a chi-square test.  The tuned sampler's kept set (``kept`` and ``threshold`` of
``workspace_views``) is also checked against NumPy; filter parameters there are picked midway between two
neighbouring cumulative masses / probabilities so that f32 vs float64 rounding cannot move the boundary.  Simulator
runs of the tuned sampler cost ~30 ms per row, so one launch mixes many rows, each with its own logits, parameters
and seed.
"""
import numpy as np
import pytest

from tests.util import bf16_randn, from_bf16_bits
from numba import cuda

from pegainfer.kernels.primitives import to_bf16_bits
from pegainfer.kernels.sampling import (CANDIDATE_CAPACITY, SamplingBuffers, allocate_sample_workspace, argmax,
                                        logsumexp, reference_argmax, reference_logsumexp, reference_sample, sample,
                                        top_logprobs, workspace_views)
from pegainfer.kernels.sampling.buffers import _workspace_parts
from pegainfer.kernels.sampling.rows import _row_words


# ------------------------------------------------------------------------------------------ NumPy references
def bf16(value):
    """bf16 bits of one float."""
    return to_bf16_bits(np.array([value], np.float32))[0]


def mass_at_or_above(x, temperature):
    """(distinct logit values, descending; the fraction of softmax(x / T) mass at or above each)."""
    vals, inverse = np.unique(x, return_inverse=True)
    per_value = np.bincount(inverse, weights=np.exp((x - x.max()) / temperature))
    return vals[::-1], np.cumsum(per_value[::-1]) / per_value.sum()


def kept_mask(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The kept set in float64: each active filter on softmax(x / T) keeps an upper set of the logits (ties with the
    boundary value all kept); the kept set is their intersection."""
    keep = np.ones(x.shape, bool)
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(top_k, x.size) - 1]
    if top_p < 1.0:
        vals, frac = mass_at_or_above(x, temperature)
        keep &= x >= vals[np.argmax(frac >= top_p)]       # the largest value whose upper set reaches top_p
    if min_p > 0.0:
        keep &= np.exp((x - x.max()) / temperature) >= min_p
    return keep


def pick_top_p(x, temperature, target, gap=4e-3):
    """A top_p (f32-exact) near ``target`` midway between two neighbouring cumulative masses at least ``gap`` apart."""
    _, frac = mass_at_or_above(x, temperature)
    a, b = frac[:-1], frac[1:]
    mids = ((a + b) / 2)[b - a > gap]
    return float(np.float32(mids[np.argmin(np.abs(mids - target))]))


def pick_min_p(x, temperature, target):
    """A min_p (f32-exact) near ``target`` at the geometric middle of two neighbouring relative probabilities."""
    w = np.unique(np.exp((x - x.max()) / temperature))[::-1]
    w = w[w > 0]
    mids = [np.sqrt(a * b) for a, b in zip(w[:-1], w[1:]) if a / b > 1.02]
    return float(np.float32(min(mids, key=lambda m: abs(np.log(m / target)))))


def strided_rows(bits, pad=4):
    """Device ``[B, V]`` view with a row stride of ``V + pad`` elements (a row-strided view, as the engine may pass)."""
    n, v = bits.shape
    buf = np.zeros((n, v + pad), np.uint16)
    buf[:, :v] = bits
    return cuda.to_device(buf)[:, :v]


def sampling_buffers(rows):
    params = SamplingBuffers(len(rows))
    for i, r in enumerate(rows):
        params.set_row(i, **r)
    params.upload()
    return params


def run_sample(bits_rows, rows, capacity=CANDIDATE_CAPACITY):
    """Launch ``sample`` once over logits rows with per-row parameter dicts; returns (tokens, kept, threshold)."""
    n = len(rows)
    out = cuda.to_device(np.full(n, -1, np.int32))
    workspace = allocate_sample_workspace(n, bits_rows.shape[1])
    sample(strided_rows(bits_rows), sampling_buffers(rows), out, workspace, candidate_capacity=capacity)
    threshold, kept = workspace_views(workspace)
    return out.copy_to_host(), kept.copy_to_host(), threshold.copy_to_host()


def run_reference(bits_rows, rows):
    """Launch ``reference_sample`` once over logits rows with per-row parameter dicts; returns (tokens, kept)."""
    n = len(rows)
    out = cuda.to_device(np.full(n, -1, np.int32))
    kept = cuda.to_device(np.full(n, -1, np.int32))
    reference_sample(strided_rows(bits_rows), sampling_buffers(rows), out, kept)
    return out.copy_to_host(), kept.copy_to_host()


# ------------------------------------------------------------------------------------------ argmax
def test_argmax_ties_infinities_and_both_load_paths(rng):
    vocab = 300                                    # 37 groups of 8 (16-byte loads) + a 4-logit tail
    bits, _ = bf16_randn((3, vocab), rng, scale=2.0)
    top = bf16(9.5)
    bits[1, [298, 40, 170]] = top                  # tied maxima, one in the tail: the smallest index wins
    bits[2, :] = bf16(-np.inf)
    bits[2, 299] = bf16(-3.0)  # a row of -inf except one (in the tail)
    expected = np.argmax(from_bf16_bits(bits), axis=1)
    assert list(expected) == [expected[0], 40, 299]

    strided = strided_rows(bits)                   # row stride 608 bytes: 16-byte loads
    contiguous = cuda.to_device(bits)              # row stride 600 bytes: 2-byte loads only
    assert _row_words(strided)[1] == vocab // 8 and _row_words(contiguous)[1] == 0
    for fn in (argmax, reference_argmax):
        for logits in (strided, contiguous):
            out = cuda.to_device(np.full(3, -1, np.int32))
            fn(logits, out)
            np.testing.assert_array_equal(out.copy_to_host(), expected, err_msg=fn.__name__)

    odd = np.full((2, 16), bf16(-np.inf), np.uint16)  # a row of -inf, a row of NaN but one -inf and one 1.0
    odd[1, :] = 0x7FC0
    odd[1, 3], odd[1, 9] = bf16(-np.inf), bf16(1.0)
    for fn in (argmax, reference_argmax):
        out = cuda.to_device(np.full(2, -1, np.int32))
        fn(cuda.to_device(odd), out)
        np.testing.assert_array_equal(out.copy_to_host(), [0, 9], err_msg=fn.__name__)   # NaN never wins


# ------------------------------------------------------------------------------------------ sampling
def test_greedy_rows_and_top_k_1_equal_argmax(rng):
    vocab = 296
    bits, x = bf16_randn((4, vocab), rng, scale=3.0)
    rows = [dict(temperature=0.0, seed=1), dict(temperature=0.0, top_k=5, top_p=0.5, seed=2),
            dict(temperature=1.3, top_k=1, seed=3), dict(temperature=0.7, top_k=1, top_p=0.9, seed=4)]
    assert all(np.sum(x[i] == x[i].max()) == 1 for i in range(4))   # no tie at the top
    tokens, kept, threshold = run_sample(bits, rows)
    np.testing.assert_array_equal(tokens, np.argmax(x, axis=1))
    np.testing.assert_array_equal(kept, [1, 1, 1, 1])
    np.testing.assert_array_equal(threshold, x.max(axis=1))


def test_greedy_rows_split_over_blocks(rng):
    """Greedy rows run on ``GREEDY_PARTS`` blocks each (a slice of the row per block, the last block merges):
    tied maxima in different slices and in the unaligned tail give the smallest index, a row of -inf gives 0 with
    threshold -inf, both load paths agree, and the per-row counters are back at zero after every launch (the same
    workspace serves three launches, as in a replayed graph)."""
    vocab = 300                                    # 37 groups of 8 (16-byte loads) + a 4-logit tail
    bits, x = bf16_randn((3, vocab), rng, scale=2.0)
    bits[1, [298, 170, 40]] = bf16(9.5)            # groups 5 and 21 and the tail: three different slices
    bits[2, :] = bf16(-np.inf)
    expected = [int(np.argmax(x[0])), 40, 0]
    params = SamplingBuffers(3)
    for i in range(3):
        params.set_row(i, temperature=0.0, seed=i)
    params.upload()
    workspace = allocate_sample_workspace(3, vocab)
    for logits in (strided_rows(bits), cuda.to_device(bits), strided_rows(bits)):
        out = cuda.to_device(np.full(3, -1, np.int32))
        sample(logits, params, out, workspace)
        np.testing.assert_array_equal(out.copy_to_host(), expected)
        threshold, kept = workspace_views(workspace)
        np.testing.assert_array_equal(kept.copy_to_host(), [1, 1, 1])
        assert threshold.copy_to_host()[1] == 9.5 and threshold.copy_to_host()[2] == -np.inf
        np.testing.assert_array_equal(_workspace_parts(workspace)[4].copy_to_host(), [0, 0, 0])


def test_seed_and_step_make_draws_reproducible(rng):
    """Same (seed, step) → same token, launch after launch and row after row; the step alone, the seed's high 32
    bits alone and other seeds each change the draw (several of each, so a chance collision cannot pass a sampler
    that ignores one of them)."""
    vocab = 64
    bits, _ = bf16_randn((1, vocab), rng, scale=0.5)       # flat: many tokens are likely
    seeds = [7, 7] + [7] * 5 + [7 + (h << 32) for h in (1, 2, 3, 2**31, 2**32 - 1)] + list(range(11, 19))
    steps = [0, 0] + [1, 2, 3, 4, 5] + [0] * 5 + [0] * 8
    bits = np.repeat(bits, len(seeds), axis=0)
    rows = [dict(temperature=1.0, seed=s, step=t) for s, t in zip(seeds, steps)]
    first, _, _ = run_sample(bits, rows)
    again, _, _ = run_sample(bits, rows)
    np.testing.assert_array_equal(first, again)               # same (seed, step) → same token, launch after launch
    assert first[0] == first[1]
    by_step, by_high_half, by_seed = first[2:7].tolist(), first[7:12].tolist(), first[12:].tolist()
    assert len(set(by_step) - {first[0]}) >= 3, (first[0], by_step)           # other steps of seed 7
    assert len(set(by_high_half) - {first[0]}) >= 3, (first[0], by_high_half)  # seeds differing in bits 32.. only
    assert len(set(by_seed)) >= 5, by_seed                                     # 8 other seeds


def _mixed_rows(rng, vocab=300):
    """24 rows of logits (some full of ties, some with -inf) with a mix of filters, temperatures and seeds; + their
    NumPy kept sets."""
    bits = np.zeros((24, vocab), np.uint16)
    rows, masks = [], []
    configs = [dict(top_k=7), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=12, top_p=0.9),
               dict(top_p=0.95, min_p=0.01), dict(top_k=20, top_p=0.7, min_p=0.1), dict(top_k=3), dict(top_p=0.5)]
    for i in range(24):
        cfg = configs[i % len(configs)]
        temperature = float(np.float32([0.6, 1.0, 1.7][i // len(configs)]))
        if i % len(configs) >= 6:           # tie-heavy rows: logits from 13 distinct values
            bits[i] = to_bf16_bits(rng.integers(-6, 7, vocab).astype(np.float32) * 0.5)
        else:
            bits[i], _ = bf16_randn((vocab,), rng, scale=2.5)
            if i % 3 == 0:                  # masked tokens (-inf) are never kept by a filter, never drawn
                bits[i, ::5] = bf16(-np.inf)
        x = from_bf16_bits(bits[i]).astype(np.float64)
        row = dict(temperature=temperature, top_k=cfg.get("top_k", 0), seed=1000 + i, step=i)
        if "top_p" in cfg:
            row["top_p"] = pick_top_p(x, temperature, cfg["top_p"])
        if "min_p" in cfg:
            row["min_p"] = pick_min_p(x, temperature, cfg["min_p"])
        rows.append(row)
        masks.append(kept_mask(x, temperature, row["top_k"], row.get("top_p", 1.0), row.get("min_p", 0.0)))
    return bits, rows, masks


def test_reference_keeps_exactly_the_numpy_set_and_draws_inside_it(rng):
    bits, rows, masks = _mixed_rows(rng, vocab=48)     # (the reference is quadratic in V: a small vocabulary)
    tokens, kept = run_reference(bits, rows)
    for i, mask in enumerate(masks):
        assert kept[i] == mask.sum(), (i, rows[i], kept[i], mask.sum())
        assert mask[tokens[i]], (i, rows[i], tokens[i])
    assert any(m.sum() > 1 and np.sum(b == b[m].min()) > 1 for b, m in zip(from_bf16_bits(bits), masks))  # ties cut


def test_filters_keep_exactly_the_numpy_set_and_draw_inside_it(rng):
    bits, rows, masks = _mixed_rows(rng)
    x = from_bf16_bits(bits)
    tokens, kept, threshold = run_sample(bits, rows)
    for i, mask in enumerate(masks):
        assert kept[i] == mask.sum(), (i, rows[i], kept[i], mask.sum())
        np.testing.assert_array_equal(x[i] >= threshold[i], mask, err_msg=f"row {i}: {rows[i]}")
        assert mask[tokens[i]], (i, rows[i], tokens[i])
    assert any(m.sum() > 1 and np.sum(x[i] == x[i][m].min()) > 1 for i, m in enumerate(masks))  # ties were cut
    # the full-pass search path (candidates don't fit in shared memory) keeps the same set and draws the same token
    tokens_small, kept_small, threshold_small = run_sample(bits, rows, capacity=4)
    np.testing.assert_array_equal(tokens_small, tokens)
    np.testing.assert_array_equal(kept_small, kept)
    np.testing.assert_array_equal(threshold_small, threshold)


def test_many_seeds_stay_inside_the_top_p_set(rng):
    vocab = 296
    bits, _ = bf16_randn((1, vocab), rng, scale=2.0)
    x = from_bf16_bits(bits[0]).astype(np.float64)
    top_p = pick_top_p(x, 1.0, 0.6)
    mask = kept_mask(x, 1.0, top_p=top_p)
    n = 24
    tokens, kept, _ = run_sample(np.repeat(bits, n, axis=0),
                                 [dict(temperature=1.0, top_p=top_p, seed=s, step=3) for s in range(n)])
    assert np.all(kept == mask.sum())
    assert np.all(mask[tokens]), tokens[~mask[tokens]]
    assert len(set(tokens.tolist())) > 1


def _draw_mix(rng, n_rows, vocab):
    """``n_rows`` rows of logits and parameters covering the sampler's cases: temperatures from 0.05 to 5 (and
    greedy), every combination of top-k (1, small, larger than the vocabulary), top-p (random, close to 1, tiny) and
    min-p, rows full of ties, rows with -inf and NaN logits, seeds with the high half set."""
    bits = np.zeros((n_rows, vocab), np.uint16)
    rows = []
    temperatures = [0.05, 0.3, 0.7, 1.0, 1.6, 5.0]
    for i in range(n_rows):
        kind = i % 8
        if kind == 6:                                   # ties: logits from 9 distinct values
            bits[i] = to_bf16_bits(rng.integers(-4, 5, vocab).astype(np.float32) * 0.75)
        else:
            bits[i], _ = bf16_randn((vocab,), rng, scale=float(rng.choice([0.3, 1.0, 3.0])))
        if kind == 7:                                   # masked tokens and a NaN: never kept, never drawn
            bits[i, rng.choice(vocab, vocab // 4, replace=False)] = bf16(-np.inf)
            bits[i, rng.integers(vocab)] = 0x7FC0
        row = dict(temperature=float(temperatures[i % len(temperatures)]),
                   seed=int(rng.integers(2**64, dtype=np.uint64)), step=int(rng.integers(2**31)))
        if i % 17 == 5:
            row["temperature"] = 0.0
        if rng.random() < 0.5:
            row["top_k"] = int(rng.choice([1, 2, 5, 12, vocab + 3]))
        if rng.random() < 0.5:
            row["top_p"] = float(np.float32(rng.choice([rng.uniform(0.05, 0.98), 0.99995, 0.01])))
        if rng.random() < 0.4:
            row["min_p"] = float(np.float32(rng.choice([rng.uniform(0.001, 0.5), 0.9])))
        rows.append(row)
    return bits, rows


def test_tuned_sampler_picks_the_reference_token(rng):
    """For the same (seed, step) the tuned sampler draws exactly the reference's token and keeps as many tokens,
    over 96 rows of mixed temperatures and filters, on both of its search paths (candidates in shared memory, and
    full passes when they do not fit)."""
    bits, rows = _draw_mix(rng, 96, 44)                # 5 groups of 8 (16-byte loads) + a 4-logit tail
    ref_tokens, ref_kept = run_reference(bits, rows)
    for capacity in (CANDIDATE_CAPACITY, 3):
        tokens, kept, _ = run_sample(bits, rows, capacity=capacity)
        for i, row in enumerate(rows):
            assert tokens[i] == ref_tokens[i] and kept[i] == ref_kept[i], (i, row, capacity, tokens[i], ref_tokens[i],
                                                                          kept[i], ref_kept[i])
    assert len(set(ref_tokens.tolist())) > 10 and len(set(ref_kept.tolist())) > 10    # the draws were varied


def _chi_square(counts, p):
    expected = counts.sum() * p
    return float(np.sum((counts - expected) ** 2 / expected))


def test_reference_draws_follow_the_tempered_softmax():
    """The reference's draws against the exact distribution: 500 draws (one row each: seeds 0..499) at T = 0.5
    from 8 logits, and 1000 at T = 0.4 with top-k 3 (the 3 largest logits, renormalised), each a chi-square test at
    the 1 - 1e-4 quantile (29.88 with 7 degrees of freedom, 18.42 with 2).  A sampler whose draws were independent
    would fail either test with probability 1e-4 (the seeds are fixed: this run passes or fails for good).  A
    sampler that ignores the temperature (draws from softmax(x) instead of softmax(x / T)) has non-centrality 163
    and 94 there, so it passes them with probability 1e-14 and 2e-8."""
    x = np.array([1.0, 0.5, 0.0, -0.25, 0.75, -1.0, 0.25, -0.5])
    bits = to_bf16_bits(x.astype(np.float32))[None, :]

    def softmax(v):
        e = np.exp(v - v.max())
        return e / e.sum()

    for temperature, top_k, n, threshold in ((0.5, 0, 500, 29.88), (0.4, 3, 1000, 18.42)):
        rows = [dict(temperature=temperature, top_k=top_k, seed=s, step=0) for s in range(n)]
        tokens, kept = run_reference(np.repeat(bits, n, axis=0), rows)
        assert np.all(kept == (top_k or x.size))
        support = np.argsort(-x)[:top_k] if top_k else np.arange(x.size)
        assert set(tokens.tolist()) <= set(support.tolist())
        counts = np.bincount(tokens, minlength=x.size)[support].astype(np.float64)
        p = softmax(x[support] / temperature)
        assert _chi_square(counts, p) < threshold, (temperature, counts, n * p)
        untempered = softmax(x[support])
        assert n * np.sum((untempered - p) ** 2 / p) > 90      # the non-centrality the docstring's miss rate uses


def test_sampling_buffers_validate_and_upload():
    buf = SamplingBuffers(3)
    buf.set_row(1, temperature=0.8, top_k=-1, top_p=0.9, min_p=0.05, seed=-1, step=42)
    buf.upload()
    assert buf.temperature.copy_to_host()[1] == np.float32(0.8)
    assert buf.top_k.copy_to_host()[1] == 0 and buf.seed.copy_to_host()[1] == 2**64 - 1
    assert buf.step.copy_to_host()[1] == 42 and buf.temperature.copy_to_host()[0] == 0.0   # untouched rows: greedy
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(step=-1)):
        with pytest.raises(ValueError):
            buf.set_row(0, **bad)
    with pytest.raises(IndexError):
        buf.set_row(3)


# ------------------------------------------------------------------------------------------ log-probabilities
def test_logsumexp_and_top_logprobs(rng):
    bits, x = bf16_randn((3, 300), rng, scale=4.0)
    bits[2, ::3] = bf16(-np.inf)
    x = from_bf16_bits(bits).astype(np.float64)
    expected = np.log(np.sum(np.exp(x), axis=1))
    ref = cuda.to_device(np.zeros(3, np.float32))
    reference_logsumexp(strided_rows(bits), ref)
    ref = ref.copy_to_host()
    np.testing.assert_allclose(ref, expected, rtol=1e-6)          # float64 sum, one f32 rounding
    for logits in (strided_rows(bits), cuda.to_device(bits)):
        lse = cuda.to_device(np.zeros(3, np.float32))
        logsumexp(logits, lse)
        got = lse.copy_to_host()
        # the tuned f32 sum (another order, f32 exponentials) differs by at most V·2⁻²⁴ relative, plus an f32 ulp
        np.testing.assert_allclose(got, ref, rtol=2 ** -22, atol=300 * 2.0 ** -24)
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    neg_inf = cuda.to_device(np.full((1, 16), bf16(-np.inf), np.uint16))
    for fn in (logsumexp, reference_logsumexp):
        lse = cuda.to_device(np.zeros(1, np.float32))
        fn(neg_inf, lse)
        assert lse.copy_to_host()[0] == -np.inf, fn.__name__

    row = x[0].astype(np.float32)
    row[[10, 20]] = row.max() + 1.0                               # a tie at the top: smaller id first
    lse0 = float(np.log(np.sum(np.exp(row.astype(np.float64)))))
    chosen, top = top_logprobs(row, lse0, 5, 20)
    assert chosen == pytest.approx(row[5] - lse0, abs=1e-6)
    ids = [i for i, _ in top]
    assert len(top) == 20 and ids[:2] == [10, 20]
    assert ids == sorted(range(300), key=lambda i: (-row[i], i))[:20]
    assert all(lp == pytest.approx(row[i] - lse0, abs=1e-6) for i, lp in top)
    assert top_logprobs(bits[0], lse0, 0, 0) == (pytest.approx(x[0, 0] - lse0, abs=1e-5), [])


# ------------------------------------------------------------------------------------------ GPU, full vocabulary
@pytest.mark.gpu
def test_full_vocab_on_gpu(rng):
    vocab, n = 151936, 8
    bits, x = bf16_randn((n, vocab), rng, scale=3.0)
    bits[5] = to_bf16_bits(np.zeros(vocab, np.float32))             # flat row: every token kept
    bits[6] = to_bf16_bits(rng.standard_normal(vocab).astype(np.float32) * 0.3)   # near-flat: top-p set > 4096
    x = from_bf16_bits(bits).astype(np.float64)
    logits = cuda.to_device(bits)
    out = cuda.to_device(np.zeros(n, np.int32))
    argmax(logits, out)
    np.testing.assert_array_equal(out.copy_to_host(), np.argmax(x, axis=1))
    lse = cuda.to_device(np.zeros(n, np.float32))
    logsumexp(logits, lse)
    np.testing.assert_allclose(lse.copy_to_host(), np.log(np.sum(np.exp(x), axis=1)), rtol=1e-5)

    targets = [dict(top_p=0.9), dict(top_k=50), dict(top_k=40, top_p=0.95), dict(min_p=0.05),
               dict(top_p=0.99, min_p=0.001), dict(), dict(top_p=0.9), dict(top_k=5000)]
    rows = []
    for i, t in enumerate(targets):
        row = dict(temperature=0.8, top_k=t.get("top_k", 0), seed=i, step=1)
        if "top_p" in t:
            row["top_p"] = pick_top_p(x[i], 0.8, t["top_p"], gap=1e-4)
        if "min_p" in t:
            row["min_p"] = pick_min_p(x[i], 0.8, t["min_p"])
        rows.append(row)
    for capacity in (CANDIDATE_CAPACITY, 64):
        tokens, kept, threshold = run_sample(bits, rows, capacity=capacity)
        for i, row in enumerate(rows):
            mask = kept_mask(x[i], 0.8, row["top_k"], row.get("top_p", 1.0), row.get("min_p", 0.0))
            assert kept[i] == mask.sum(), (i, row, kept[i], mask.sum())
            assert mask[tokens[i]], (i, row)

    # the draw distribution over many rows: 20000 draws from a small vocabulary
    small = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    m = 20000
    tokens, _, _ = run_sample(np.repeat(to_bf16_bits(small.astype(np.float32))[None, :], m, axis=0),
                              [dict(temperature=1.0, top_p=1.0, seed=s, step=9) for s in range(m)])
    p = np.exp(small) / np.exp(small).sum()
    counts = np.bincount(tokens, minlength=8)
    assert np.sum((counts - m * p) ** 2 / (m * p)) < 24.3, counts


def test_sample_takes_the_lm_heads_greedy_pick(rng):
    """``sample(head=)``: a greedy row keeps the token, threshold and count the LM head wrote through ``HeadArgmax``
    (here planted by hand: the sampler must not touch them); a sampled row is drawn as without ``head``."""
    from pegainfer.kernels.sampling import HeadArgmax
    vocab = 64
    bits, _ = bf16_randn((1, vocab), rng, scale=2.0)
    for row, expect_planted in (({}, True), ({"temperature": 1.0, "seed": 3}, False)):
        params = SamplingBuffers(1)
        params.set_row(0, **row)
        params.upload()
        out = cuda.to_device(np.full(1, 17, np.int32))
        workspace = allocate_sample_workspace(1, vocab)
        head = HeadArgmax(out, workspace)
        threshold, kept = workspace_views(workspace)
        threshold.copy_to_device(np.full(1, 0.5, np.float32))
        kept.copy_to_device(np.full(1, 1, np.int32))
        sample(strided_rows(bits), params, out, workspace, head=head)
        plain_out = cuda.to_device(np.full(1, -1, np.int32))
        sample(strided_rows(bits), params, plain_out, allocate_sample_workspace(1, vocab))
        if expect_planted:
            assert out.copy_to_host()[0] == 17 and threshold.copy_to_host()[0] == 0.5
        else:
            assert out.copy_to_host()[0] == plain_out.copy_to_host()[0]

