"""The kept set's threshold, searched on ordered bf16 keys.

Every filter of the sampler keeps an *upper set* of the logits, so the kept set is ``{i : logit_i ≥ θ}`` for one
threshold ``θ``.  Because logits are bf16, ``θ`` takes at most 65536 values: the sampler searches it on the
**ordered 16-bit key** of a bf16 (``_key_of``: integer order = float order, -0 = +0), where a key ``t`` is
≤ ``θ`` exactly when ``count(logit ≥ t) ≥ k`` (top-k on), or ``mass(logit ≥ t) ≥ p · Z`` (top-p on, ``Z`` = the row's
total mass), or ``t ≤ t_min_p`` (min-p on; ``t_min_p`` is found without touching memory:
``_lowest_key_with_weight``).  Each search step tests ``PROBES`` = 7 keys spread over the current range ``[lo, hi)``
at once -- one pass histogramming the logits (count and mass) into the 8 buckets they cut -- so ``θ`` is exact after
at most 6 steps (8^6 > 65536).  Ties need no special care: equal logits have equal keys and fall on the same side of
every probe.
"""
from __future__ import annotations

from pegainfer.kernels.primitives import bits_f32, device_fn, f32_bits, float32, int32, math, uint32

PROBES = 7                         # thresholds a search step tests at once: an 8-way split of the key range
BUCKETS = PROBES + 1
KEY_FLOOR = 0x007F                 # ordered key of -inf: the lowest threshold (keeps every non-NaN logit)


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
