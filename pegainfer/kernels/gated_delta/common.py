"""What every Gated DeltaNet kernel shares: the family's size limits, the per-token scalar math (l2 norms, decay,
write strength, the gated norm's roundings) as device functions, and the host-side argument checks."""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.primitives import (WARP, bf16_to_f32, cuda, device_fn, f32_to_bf16, float32, math,
                                          warp_sum)

L2NORM_EPS = 1e-6  # HF ``l2norm(x, eps=1e-6)``: x · rsqrt(Σx² + eps)
MAX_KEY_DIM = 128  # largest key head dim Dk the shared-memory tiles hold (Qwen3.5: 128)
MAX_CHUNK = 64  # largest chunk length C of the chunked form (HF and FLA use 64)
COL_TILE = WARP  # value columns per block in the rule kernels: one per lane
MAX_WARPS = 32  # 1024 threads


# ------------------------------------------------------------------------------------------------ scalar helpers
@device_fn
def silu(x):
    """x · sigmoid(x) in f32."""
    x = float32(x)
    return x / (float32(1.0) + float32(math.exp(-x)))


@device_fn
def softplus(x):
    """torch ``F.softplus`` (beta 1, threshold 20): log(1 + eˣ), or x itself above 20."""
    x = float32(x)
    if x > float32(20.0):
        return x
    return float32(math.log1p(math.exp(x)))


@device_fn
def log_decay(a_bits, a_log, dt_bias):
    """``g = −exp(A_log) · softplus(a + dt_bias)`` in f32 (a as bf16 bits; A_log and dt_bias f32)."""
    return -float32(math.exp(float32(a_log))) * softplus(bf16_to_f32(a_bits) + float32(dt_bias))


@device_fn
def write_strength(b_bits):
    """``beta = sigmoid(b)`` rounded to bf16, as HF's bf16 ``b.sigmoid()`` does; returned as f32."""
    s = float32(1.0) / (float32(1.0) + float32(math.exp(-bf16_to_f32(b_bits))))
    return bf16_to_f32(f32_to_bf16(s))


@device_fn
def inverse_l2_norm(sum_squares):
    """HF ``l2norm``'s factor ``1 / sqrt(Σx² + 1e-6)`` in f32."""
    return float32(1.0) / float32(math.sqrt(float32(sum_squares) + float32(L2NORM_EPS)))


@device_fn
def token_gates(lane_ssq, lane_ssk, q_scale, a_bits, b_bits, a_log_h, dt_bias_h):
    """What the delta rule needs besides q, k, v for a token and value head ``h`` (``a_bits``, ``b_bits``: its
    ``a[t, h]``, ``b[t, h]``; ``a_log_h``, ``dt_bias_h``: head ``h``'s parameters), from each lane's partial sums of
    q² and k²: ``(q_mul, k_mul, decay, beta)`` = (l2norm factor of q times ``q_scale``, l2norm factor of k,
    ``exp(g)``, ``beta``).  Every lane of the warp calls it (a warp reduction) and gets the same values."""
    q_mul, k_mul = token_qk_scales(lane_ssq, lane_ssk, q_scale)
    decay, beta = token_decay_beta(a_bits, b_bits, a_log_h, dt_bias_h)
    return q_mul, k_mul, decay, beta


@device_fn
def token_qk_scales(lane_ssq, lane_ssk, q_scale):
    """``token_gates``'s ``(q_mul, k_mul)``: the l2norm factors of q (times ``q_scale``) and k, from each lane's
    partial sums of q² and k² (a warp reduction: every lane calls it)."""
    return inverse_l2_norm(warp_sum(lane_ssq)) * q_scale, inverse_l2_norm(warp_sum(lane_ssk))


@device_fn
def token_decay_beta(a_bits, b_bits, a_log_h, dt_bias_h):
    """``token_gates``'s ``(decay, beta)`` = ``(exp(g), sigmoid(b))`` of a token and value head: no q or k needed."""
    return float32(math.exp(log_decay(a_bits, a_log_h, dt_bias_h))), write_strength(b_bits)


@device_fn
def gated_norm_value(x, inv_rms, w_bits, z_bits):
    """One output of HF's bf16 ``RMSNormGated``: ``bf16(bf16(w · bf16(x · inv_rms)) · silu(z))`` (x f32, w and z
    bf16 bits); returned as bf16 bits."""
    normed = bf16_to_f32(f32_to_bf16(x * inv_rms))
    weighted = bf16_to_f32(f32_to_bf16(bf16_to_f32(w_bits) * normed))
    return f32_to_bf16(weighted * silu(bf16_to_f32(z_bits)))


@device_fn
def zero_rows_from(out, first):
    """``out[first:, :] = 0`` for a 2-D bf16 array, grid-strided over all threads of the launch (no barrier): the
    rows of tokens after the last sequence (padding), so that what reads them downstream stays finite."""
    width = out.shape[1]
    for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, (out.shape[0] - first) * width,
                     cuda.gridDim.x * cuda.blockDim.x):
        out[first + idx // width, idx % width] = 0


# ------------------------------------------------------------------------------------------------ the state in memory
# The delta-rule state ``S [slots, Hv, Dk, Dv]`` is kept in f32 (HF's ``mamba_ssm_dtype``) or as bf16 bits (uint16:
# half the bytes a decode step moves, vLLM's ``--mamba-ssm-cache-dtype bfloat16``).  Every kernel computes in f32:
# it widens what it loads and rounds (to nearest even) what it stores, so a bf16 state is rounded once per launch
# (the token-by-token reference: once per token).  A kernel builder picks the pair for its state's dtype.
@device_fn
def f32_state(x):
    """An f32 state's element as it is computed with, and an f32 value as such a state stores it: itself."""
    return float32(x)


def state_codec(bf16: bool):
    """``(load, store)``: the device functions that turn an element of the state (f32, or bf16 bits when ``bf16``)
    into the f32 the kernels compute with, and an f32 into what is stored."""
    return (bf16_to_f32, f32_to_bf16) if bf16 else (f32_state, f32_state)


def state_is_bf16(ssm_state) -> bool:
    """Whether ``ssm_state`` holds bf16 bits (uint16) rather than f32; anything else is refused."""
    assert ssm_state.dtype in (np.float32, np.uint16), (ssm_state.dtype, "the state is f32 or bf16 bits")
    return ssm_state.dtype == np.uint16


# ------------------------------------------------------------------------------------------------ argument checks
def check_bf16(arr, ndim):
    assert arr.ndim == ndim and arr.dtype == np.uint16, (arr.shape, arr.dtype, "expected bf16 bits", ndim)


def check_positions(positions, num_tokens):
    assert positions.ndim == 1 and positions.dtype == np.int32 and positions.shape[0] >= num_tokens, \
        (positions.shape, positions.dtype, num_tokens)


def check_sequences(slot_ids, token_offsets):
    assert slot_ids.ndim == 1 and slot_ids.dtype == np.int32, (slot_ids.shape, slot_ids.dtype)
    assert token_offsets.ndim == 1 and token_offsets.dtype == np.int32, (token_offsets.shape, token_offsets.dtype)
    assert token_offsets.shape[0] == slot_ids.shape[0] + 1, (token_offsets.shape, slot_ids.shape)


def num_k_heads_of(qkv, ssm_state):
    """``Hk`` from the width of ``qkv [tokens, 2·Hk·Dk + Hv·Dv]`` and ``ssm_state [slots, Hv, Dk, Dv]``."""
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    return (qkv.shape[1] - num_v_heads * value_dim) // (2 * key_dim)


def check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out):
    """The arguments of a delta-rule kernel (``reference_gated_delta``'s shapes)."""
    check_bf16(qkv, 2)
    check_bf16(a, 2)
    check_bf16(b, 2)
    check_bf16(out, 2)
    assert ssm_state.ndim == 4, ssm_state.shape
    state_is_bf16(ssm_state)
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    num_k_heads = num_k_heads_of(qkv, ssm_state)
    assert num_k_heads >= 1 and qkv.shape[1] == 2 * num_k_heads * key_dim + num_v_heads * value_dim, \
        (qkv.shape, ssm_state.shape)
    assert num_v_heads % num_k_heads == 0, (num_v_heads, num_k_heads)
    assert key_dim <= MAX_KEY_DIM and key_dim % 2 == 0, f"key head dim {key_dim}: even and ≤ {MAX_KEY_DIM}"
    num_tokens = qkv.shape[0]
    assert a.shape == (num_tokens, num_v_heads) and b.shape == a.shape, (a.shape, b.shape, num_tokens)
    for p in (a_log, dt_bias):
        assert p.shape == (num_v_heads,) and p.dtype == np.float32, (p.shape, p.dtype)
    assert out.shape == (num_tokens, num_v_heads * value_dim), (out.shape, num_tokens)
    check_sequences(slot_ids, token_offsets)
