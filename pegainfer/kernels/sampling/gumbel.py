"""The draw's noise: a counter-based Gumbel variate per (seed, step, token).

The draw is the Gumbel-max trick: ``argmax_i (z_i + g_i)`` over kept tokens, with ``g_i = -log(-log u_i)`` and
``u_i`` a hash of ``(seed, step, i)`` -- one pass, no sort, no random state, and the same ``(seed, step)`` always
gives the same token.  The tuned sampler and the reference sampler both draw with these functions.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.primitives import device_fn, float32, math

GUMBEL_MAX = 17.0                  # > the largest Gumbel value the 23-bit uniforms can give (16.64)

_M32 = np.uint64(0xFFFFFFFF)
_U23_SCALE = float32(2.0 ** -23)
_HALF = float32(0.5)


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
