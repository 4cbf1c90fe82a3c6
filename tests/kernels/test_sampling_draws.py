"""The sampler's draws, against a NumPy model of them written from the definition, and that model against the exact
distribution.

``gumbel.py`` defines a draw: the kept token with the largest ``(x_j - x_max) / T + g(seed, step, j)``, ``g`` a
Gumbel variate from a counter-based hash.  ``numpy_gumbel`` recomputes that noise in NumPy (the same hash, in uint64
arithmetic), ``numpy_draw`` the Gumbel-max choice over the NumPy kept set (``test_sampling.kept_mask``):

* exact: the tuned sampler must draw the NumPy model's token for every row of a mix of temperatures, filters and
  seeds, except where the model's two best scores lie within the f32 rounding of ``log`` (the kernel's ``logf`` and
  NumPy's may differ by an ulp), which is counted and must stay rare.  A sampler that ignores the temperature, uses
  the wrong keys or token index, or draws outside the kept set picks another token in most rows: it fails.
* statistical: the NumPy model's draws (100,000 seeds per case) against ``softmax(x[kept] / T)``, a chi-square test
  per case at the 1 - 1e-4 quantile, for four temperatures and each filter (none, top-k, top-p, min-p).  A correct
  sampler fails a case with probability 1e-4 (1.6e-3 over the 16 cases; the seeds are fixed, so a run passes or fails
  for good).  The test also computes, per case with T != 1, the non-centrality that a draw ignoring the temperature
  would have (asserted >= 500): its miss probability is below 1e-25 (normal approximation of the non-central
  chi-square).  With the exact check above, the kernel's draws follow the same distribution."""
import numpy as np

from tests.kernels.test_sampling import _mixed_rows, kept_mask, pick_min_p, pick_top_p, run_sample
from tests.util import bf16_randn, from_bf16_bits

M32 = np.uint64(0xFFFFFFFF)
CHI2_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.877}  # chi2.ppf(1 - 1e-4, df)


def _mix32(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & M32
    return h ^ (h >> np.uint64(16))


def numpy_gumbel(seeds, step: int, vocab: int) -> np.ndarray:
    """The draw's Gumbel noise ``[len(seeds), vocab]`` (float32, as the kernel rounds it) for 64-bit ``seeds`` at
    ``step``: murmur3's finaliser over (seed, step) keys and the token index, 23 bits to a uniform in (0, 1)."""
    seeds = np.asarray(seeds, np.uint64)[:, None]
    with np.errstate(over="ignore"):
        key1 = _mix32((seeds & M32) ^ _mix32((np.uint64(step) & M32) ^ np.uint64(0x27D4EB2F)))
        key2 = _mix32((seeds >> np.uint64(32)) ^ _mix32(key1 ^ np.uint64(0x165667B1)))
        j = np.arange(vocab, dtype=np.uint64)[None, :]
        h = _mix32((j * np.uint64(0x9E3779B9) + key1) & M32)
        h = _mix32(h ^ key2)
    u = ((h >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)
    return -np.log(-np.log(u)).astype(np.float32)


def numpy_draw(x, temperature, keep, g):
    """(token, margin): the kept token with the largest f32 score ``(x - x_max) · (1/T) + g`` (ties → the smaller
    index), and how far the runner-up's score is below it; greedy (the argmax) at T = 0."""
    if temperature == 0.0:
        return int(np.argmax(x)), np.inf
    x32 = x.astype(np.float32)
    xmax = x32[np.isfinite(x32)].max()
    score = ((x32 - xmax) * np.float32(1.0 / np.float32(temperature))).astype(np.float32) + g
    score = np.where(keep, score, -np.inf)
    order = np.argsort(-score, kind="stable")
    return int(order[0]), float(score[order[0]] - score[order[1]])


def test_tuned_sampler_draws_the_numpy_gumbel_max_token(rng):
    """Catches a sampler that draws from any other distribution than the definition's (temperature ignored or
    misapplied, wrong noise keys, a shifted token index, a draw outside the kept set): for 32 rows of temperatures
    0.3-2.5 with top-k / top-p / min-p, ties and masked tokens, the tuned sampler must pick exactly the token the
    NumPy model of the same (seed, step) picks."""
    bits, rows, masks = _mixed_rows(rng)
    plain, _ = bf16_randn((8, bits.shape[1]), rng, scale=2.0)
    for i, temperature in enumerate((0.3, 0.8, 1.3, 2.5) * 2):
        rows.append(dict(temperature=temperature, top_k=0, seed=int(rng.integers(2**63)), step=int(rng.integers(2**31))))
        masks.append(np.ones(bits.shape[1], bool))
    bits = np.concatenate([bits, plain])
    tokens, _, _ = run_sample(bits, rows)
    close, x_all = 0, from_bf16_bits(bits).astype(np.float64)
    for i, row in enumerate(rows):
        g = numpy_gumbel([row["seed"]], row["step"], bits.shape[1])[0]
        want, margin = numpy_draw(x_all[i], row["temperature"], masks[i], g)
        if margin < 1e-4:        # within the f32 rounding of log: either token is the definition's
            close += 1
            continue
        assert tokens[i] == want, (i, row, tokens[i], want, margin)
    assert close <= 2, f"{close} rows with two scores within 1e-4: the exact check covers too few"
    assert len(set(tokens.tolist())) > 16


def test_numpy_draws_follow_the_tempered_filtered_softmax():
    """Catches a noise function or a Gumbel-max formula whose draws are not distributed as softmax(x[kept] / T):
    chi-square per (temperature, filter) over 100,000 seeds (rates in the module docstring)."""
    x = np.array([1.0, 0.5, 0.0, -0.25, 0.75, -1.0, 0.25, -0.5])
    n, step = 100_000, 7
    g = numpy_gumbel(np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15), step, x.size)

    def softmax(v):
        e = np.exp(v - v.max())
        return e / e.sum()

    for temperature in (0.3, 0.7, 1.0, 1.6):
        filters = {"none": {}, "top_k": dict(top_k=3), "top_p": dict(top_p=pick_top_p(x, temperature, 0.8)),
                   "min_p": dict(min_p=pick_min_p(x, temperature, 0.3))}
        for name, f in filters.items():
            keep = kept_mask(x, temperature, **f)
            assert 1 < keep.sum() < x.size or name == "none", (temperature, name, keep)
            x32 = x.astype(np.float32)
            score = ((x32 - x32.max()) * np.float32(1.0 / np.float32(temperature))).astype(np.float32) + g
            draws = np.argmax(np.where(keep, score, -np.inf), axis=1)
            assert keep[draws].all(), (temperature, name)
            support = np.nonzero(keep)[0]
            counts = np.bincount(draws, minlength=x.size)[support].astype(np.float64)
            p = softmax(x[support] / temperature)
            chi2 = float(np.sum((counts - n * p) ** 2 / (n * p)))
            assert chi2 < CHI2_1E4[support.size - 1], (temperature, name, chi2, counts, n * p)
            if temperature != 1.0:       # the power against a draw that ignores the temperature
                untempered = softmax(x[support])
                assert n * np.sum((untempered - p) ** 2 / p) >= 500, (temperature, name)
