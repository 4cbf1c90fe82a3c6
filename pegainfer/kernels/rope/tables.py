"""Rotary position embedding tables (host side): ``rope_tables`` builds the bf16 cos / sin rows the kernels read, as
transformers' rotary embeddings compute them (default, linear and YaRN scaling)."""
from __future__ import annotations

import math as pymath

import numpy as np

from pegainfer.kernels.primitives import to_bf16_bits


def _inverse_frequencies(rotary_dim: int, theta: float, rope_scaling: dict | None) -> tuple[np.ndarray, float]:
    """float32 ``inv_freq`` ``[rotary_dim // 2]`` and the cos/sin scale, as transformers' ``modeling_rope_utils``
    computes them (float32 arithmetic at the same steps; pow in float64 then rounded, i.e. correctly rounded)."""
    f32 = np.float32
    exponents = (np.arange(0, rotary_dim, 2, dtype=np.int64).astype(f32) / f32(rotary_dim)).astype(f32)
    # base ** exponent, a float32 tensor in torch: computed here correctly rounded to float32.
    pos_freqs = np.power(np.float64(theta), exponents.astype(np.float64)).astype(f32)
    inv_freq = (f32(1.0) / pos_freqs).astype(f32)

    rope_type = None if rope_scaling is None else (rope_scaling.get("rope_type") or rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq, 1.0
    if rope_type == "linear":
        factor = float(rope_scaling["factor"])
        return (inv_freq / f32(factor)).astype(f32), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(rotary_dim, theta, pos_freqs, rope_scaling)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, yarn)")


def _yarn_inverse_frequencies(dim: int, base: float, pos_freqs: np.ndarray, params: dict) -> tuple[np.ndarray, float]:
    """YaRN (https://arxiv.org/abs/2309.00071) as in transformers' ``_compute_yarn_parameters``: low-frequency dims
    are interpolated (divided by ``factor``), high-frequency dims extrapolated, with a linear ramp between."""
    f32 = np.float32
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / original_max
    factor = float(factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * pymath.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * pymath.log(original_max / (num_rotations * 2 * pymath.pi))) / (2 * pymath.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = pymath.floor(low), pymath.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp

    ramp = ((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low)).astype(f32)
    extrapolation_weight = (f32(1.0) - np.clip(ramp, f32(0.0), f32(1.0))).astype(f32)
    inv_freq_extrapolation = (f32(1.0) / pos_freqs).astype(f32)
    inv_freq_interpolation = (f32(1.0) / (f32(factor) * pos_freqs).astype(f32)).astype(f32)
    inv_freq = (inv_freq_interpolation * (f32(1.0) - extrapolation_weight)
                + inv_freq_extrapolation * extrapolation_weight).astype(f32)
    return inv_freq, float(attention_factor)


def rope_tables(max_len: int, rotary_dim: int, theta: float, rope_scaling: dict | None = None):
    """cos and sin tables for positions ``0 .. max_len-1``: two ``[max_len, rotary_dim // 2]`` uint16 arrays (bf16
    bits, host).  Row ``p``, column ``i`` holds ``cos(p · inv_freq[i]) · attention_scaling`` (dims ``i`` and
    ``i + rotary_dim/2`` share it).  Matches HF's Qwen3/Qwen3.5 rotary embedding bit for bit up to the last-ulp
    differences between libm and torch's float32 ``pow``/``cos``: ``freqs = float32(pos) * inv_freq`` in float32,
    cos/sin of that float32 value, times ``attention_scaling`` in float32, rounded to bf16.

    ``rope_scaling``: ``None`` / ``{"rope_type": "default"}``, ``"linear"`` (``factor``) or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``,
    ``mscale_all_dim``, ``truncate``); any other type raises ``ValueError``.
    """
    assert rotary_dim > 0 and rotary_dim % 2 == 0, rotary_dim
    inv_freq, attention_scaling = _inverse_frequencies(rotary_dim, theta, rope_scaling)
    positions = np.arange(max_len, dtype=np.float32)
    freqs = (positions[:, None] * inv_freq[None, :]).astype(np.float32)   # float32 product, as in torch
    # cos/sin of the float32 angle, evaluated in float64 and rounded once to float32 (torch's float32 cos is
    # accurate to ~1 ulp; the bf16 rounding below hides that almost always)
    cos = np.cos(freqs.astype(np.float64)).astype(np.float32)
    sin = np.sin(freqs.astype(np.float64)).astype(np.float32)
    scale = np.float32(attention_scaling)
    if scale != np.float32(1.0):
        cos = (cos * scale).astype(np.float32)
        sin = (sin * scale).astype(np.float32)
    return to_bf16_bits(cos), to_bf16_bits(sin)
