"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers (three of every four layers).

One layer, for a token with hidden state ``x`` (HF ``Qwen3_5GatedDeltaNet.forward``; weights are GEMVs elsewhere)::

    mixed = in_proj_qkv(x)                 # [conv_dim] = [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)], bf16
    mixed = silu(causal_conv1d(mixed))     # depthwise, kernel K=4, over this sequence's last K inputs
    q, k  = l2norm(q), l2norm(k)           # per key head, f32; q also scaled by 1/sqrt(Dk)
    g     = -exp(A_log) · softplus(a + dt_bias)     # log decay per value head, a = in_proj_a(x)
    beta  = sigmoid(b)                              # write strength per value head, b = in_proj_b(x)
    o     = gated delta rule(q, k, v, g, beta; state S)
    y     = out_proj(RMSNormGated(o, z = in_proj_z(x)))

**The gated delta rule.**  Each value head ``h`` keeps a state ``S[h]`` of shape ``[Dk, Dv]`` (f32) and uses key
head ``h // (Hv / Hk)`` (grouped like GQA, HF's ``repeat_interleave``).  Per token::

    S      = S · exp(g)                    # forget
    kv_mem = Sᵀ k                          # what the state currently returns for key k   [Dv]
    delta  = (v − kv_mem) · beta           # correction towards v                          [Dv]
    S      = S + k ⊗ delta                 # write it
    o      = Sᵀ q                          # read                                          [Dv]

``gated_delta_recurrent`` runs exactly this, token after token (decode).  ``gated_delta_chunked`` gets the same
result for a prompt in chunks of C tokens (the "WY / UT-transform" form of flash-linear-attention): inside a chunk,
with ``G_i`` the cumulative log decay from the chunk start, ``S`` the state before the chunk, ``k, q`` normalised::

    L[i,m]     = beta_i · exp(G_i − G_m) · (k_i·k_m)      m < i      (strictly lower triangular)
    Tinv       = (I + L)⁻¹                                            (unit lower triangular)
    intra[i,m] = exp(G_i − G_m) · (q_i·k_m)               m ≤ i
    R_i        = beta_i · (v_i − exp(G_i) · Sᵀ k_i)                   delta-rule targets against the old state
    U          = Tinv · R                                             the deltas actually written, all at once
    o_i        = exp(G_i) · Sᵀ q_i + Σ_m intra[i,m] · U_m
    S_next     = exp(G_C) · S + Σ_i exp(G_C − G_i) · k_i ⊗ U_i

(Unrolling the recurrence inside a chunk gives ``U_i = R_i − Σ_{m<i} L[i,m] U_m``, i.e. ``(I + L) U = R``.)  The
parts that do not depend on the state (``Tinv``, ``intra``, ``G``, ``beta``, norms) are computed for every chunk in
parallel by one kernel; a second kernel walks the chunks of each sequence in order, carrying ``S``.

**Sequences and state slots.**  Every kernel takes a batch of sequences laid out as in vLLM/FLA: ``token_offsets
[B+1]`` int32 (sequence ``b`` owns tokens ``token_offsets[b] : token_offsets[b+1]`` of the token-major inputs) and
``slot_ids [B]`` int32 (the row of the per-sequence state buffers it reads and updates).  A decode step is B
sequences of one token each (``token_offsets = arange(B+1)``); a prefill is one (or more) sequences of many tokens.
Both come from device arrays, so a decode step can be captured in a CUDA graph and replayed.  Empty sequences
(padding: equal offsets) are skipped and leave their slot alone; ``sequence_table`` builds the table on the device
from per-token slots.

**Padding tokens.**  A prefill chunk padded to a CUDA-graph bucket has its padding tokens (slot -1) after the real
ones.  They belong to no sequence: ``sequence_table`` ends the table at the first of them (``token_offsets[B]``),
so the state after the step is bit for bit the state an unpadded step leaves, and the chunking of the real tokens
is unchanged.  The rule kernels write zeros to the output rows from ``token_offsets[B]`` on (what reads them
downstream stays finite); the conv leaves its output rows there as they were (only the rule reads them, and it
does not).  State buffers::

    conv_state [slots, conv_dim, K]    bf16   ring of the conv's inputs by position: entry ``p % K`` holds the input
                                              at position ``p`` (the last K-1 of them are the ones still needed)
    ssm_state  [slots, Hv, Dk, Dv]     f32    S per value head, HF's layout (``recurrent_states``)

**Positions and the conv ring.**  The conv kernels also take ``positions [tokens]`` int32 (the engine's: a token's
index in its sequence).  The token at position ``p`` reads its K-1 predecessors at ring entries ``(p-K+1) % K ..
(p-1) % K`` (or from ``x`` when they are in the same step; positions < 0 read as zero, HF's left padding) and a
step leaves each of its last K-1 inputs at entry ``p % K``.  A one-token step therefore writes an entry that no
reader of that step touches, which is what lets two blocks of the fused decode step (two value heads sharing a key
head, hence the same q/k channels) update the same channels' ring with no ordering between them: both write the
same value to the same entry.  (A shift register, oldest first, would be overwritten under the other block's feet.)

A new sequence's slot must start from zeros (``clear_state_slots``), as HF starts without a cache.

**Decode in one launch.**  ``gated_delta_decode_step`` fuses, for a batch of one-token sequences, the conv + SiLU,
the recurrent rule and the gated RMSNorm (``causal_conv1d_silu`` → ``gated_delta_recurrent`` → ``gated_rms_norm``)
into one kernel with bit-identical results; the three kernels stay for prompts and as its reference.

**bf16 rounding** follows HF's bf16 forward: conv output rounded, then SiLU rounded; ``beta = bf16(sigmoid(b))``;
``g`` in f32 from bf16 ``a``; the rule runs in f32 and its output is rounded to bf16; the gated norm rounds
``bf16(x·r)``, then ``bf16(w · that)``, then ``bf16(that · silu(z))``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.errors import PegainferError
from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import inverse_rms
from pegainfer.kernels.primitives import (WARP, as_words, bf16_to_f32, bf16x2_hi, bf16x2_lo, bits_f32,
                                          cp_async_16, cp_async_commit, cp_async_wait_group, cuda, device_fn,
                                          f32_bits, f32_to_bf16, float32, global_timer, grid, grid_dependency_wait,
                                          int32, kernel, launch_dependents, load_f32x2, load_f32x4, math,
                                          pdl_prologue, store_f32x2, store_f32x4, threads,
                                          uint16, uint32, warp_sum)
from pegainfer.kernels import timeline

uint64 = np.uint64

L2NORM_EPS = 1e-6  # HF ``l2norm(x, eps=1e-6)``: x · rsqrt(Σx² + eps)
MAX_KEY_DIM = 128  # largest key head dim Dk the shared-memory tiles hold (Qwen3.5: 128)
MAX_CHUNK = 64  # largest chunk length C of the chunked form (HF and FLA use 64)
COL_TILE = WARP  # value columns per block in the rule kernels: one per lane
MAX_WARPS = 32  # 1024 threads
K_ROW_WORDS = MAX_KEY_DIM // 2 + 1  # a staged k row: Dk/2 packed bf16 pairs + one spare word (bank offset)
STAGE_WORDS = MAX_CHUNK * max(MAX_KEY_DIM // 2, MAX_CHUNK)  # the scan's staged rows: q/k rows (pairs) or (I+L)⁻¹
RULE_WARPS = threads(gpu=256, sim=32) // WARP
SCAN_THREADS = 512  # threads per block of the chunked form's scan on the GPU (H200, Qwen3.5-4B's 2048-token
#                    prefill: 3.73 ms per layer for prepare + scan, 4.11 with 256)
"""Warps per block of ``gated_delta_recurrent``: warp ``w`` sums key rows ``d ≡ w (mod RULE_WARPS)``, so this sets
the f32 summation order of ``Sᵀk`` and ``Sᵀq``, which ``gated_delta_decode_step`` reproduces (its ``row_groups``)."""

__all__ = ["causal_conv1d_silu", "gated_delta_recurrent", "gated_delta_chunked", "gated_rms_norm",
           "gated_delta_decode_step", "clear_state_slots", "sequence_table", "ChunkScratch", "allocate_chunk_scratch",
           "MAX_KEY_DIM", "MAX_CHUNK"]


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


# ------------------------------------------------------------------------------------------------ conv1d + SiLU
@device_fn
def conv_silu(x, weight, conv_state, slot, c, start, i, first_pos):
    """One output of the causal depthwise conv + SiLU, as bf16 bits: channel ``c`` of token ``i`` of the sequence
    whose tokens start at row ``start`` of ``x`` and at position ``first_pos``, in ``slot``::

        bf16(silu(bf16(Σ_k weight[c, k] · input[i − (K−1) + k, c])))

    ``input[s]`` is ``x[start + s]`` for ``s ≥ 0`` (this step's tokens) and, before the step, the ring entry
    ``conv_state[slot, c, (first_pos + s) % K]`` (zero at positions below 0).  Shared by the conv kernel and the
    fused decode step, so both compute every output with the very same instructions."""
    taps = weight.shape[1]
    hist = taps - 1
    acc = float32(0.0)
    for k in range(taps):
        s = i - hist + k
        if s >= 0:
            v = bf16_to_f32(x[start + s, c])
        elif first_pos + s >= 0:
            v = bf16_to_f32(conv_state[slot, c, (first_pos + s) % taps])
        else:
            v = float32(0.0)
        acc += bf16_to_f32(weight[c, k]) * v
    return conv_output(acc)


@device_fn
def conv_output(acc):
    """``bf16(silu(bf16(acc)))`` of a conv sum ``acc`` (f32), as bf16 bits: HF's two roundings."""
    return f32_to_bf16(silu(bf16_to_f32(f32_to_bf16(acc))))


@device_fn
def conv_ring_store(x, conv_state, slot, c, start, n, first_pos):
    """Leave the last ``K-1`` inputs of channel ``c`` of an ``n``-token sequence (rows ``start ..`` of ``x``, first
    position ``first_pos``) at their ring entries ``position % K``.  Only after every read of the slot's old
    entries by the same step: an entry written here may be one a token of this step still reads."""
    taps = conv_state.shape[2]
    for s in range(max(0, n - (taps - 1)), n):
        conv_state[slot, c, (first_pos + s) % taps] = x[start + s, c]


@kernel
def causal_conv1d_silu_kernel(x, weight, conv_state, slot_ids, token_offsets, positions, out, tokens_per_thread,
                              max_pieces):
    """Causal depthwise conv1d over each sequence's tokens, then SiLU; reads and updates the slot's conv ring.

    x ``[tokens, channels]`` bf16 (in_proj_qkv output), weight ``[channels, K]`` bf16 (HF ``conv1d.weight`` with
    its middle axis dropped), conv_state ``[slots, channels, K]`` bf16 (the ring, module docstring), slot_ids
    ``[B]`` / token_offsets ``[B+1]`` / positions ``[tokens]`` int32, out ``[tokens, channels]`` bf16 (must not
    alias x).  For token ``t`` of a sequence (``t`` counted from the sequence start, at position ``P + t``) and
    channel ``c`` (``conv_silu``)::

        out[t, c] = bf16(silu(bf16(Σ_k weight[c, k] · input[t − (K−1) + k, c])))

    where ``input[s]`` is ``x`` for ``s ≥ 0`` and the ring entry of position ``P + s`` before the sequence
    (zero below position 0).  Afterwards the ring holds the sequence's last ``K−1`` inputs at their entries (with
    fewer tokens than that, the older entries stay as they are).  Rows of ``out`` after the last sequence
    (padding) are not written.

    Geometry: one work item per (sequence, channel, piece of ``tokens_per_thread`` consecutive tokens), flattened
    channel-fastest (coalesced) and grid-strided; ``max_pieces`` bounds the pieces per sequence.  Only the thread
    of piece 0 touches ``conv_state`` (it reads the old entries, then writes the new ones), so there is no race:
    the other pieces start at least ``K−1`` tokens in (``tokens_per_thread ≥ K−1``) and see only ``x``.
    """
    pdl_prologue()
    channels = x.shape[1]
    items = slot_ids.shape[0] * max_pieces * channels
    for item in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, items,
                      cuda.gridDim.x * cuda.blockDim.x):
        c = item % channels
        piece = (item // channels) % max_pieces
        seq = item // (channels * max_pieces)
        start = token_offsets[seq]
        n = token_offsets[seq + 1] - start
        first = piece * tokens_per_thread
        if first >= n:
            continue
        slot = slot_ids[seq]
        first_pos = positions[start]
        for t in range(first, min(first + tokens_per_thread, n)):
            out[start + t, c] = conv_silu(x, weight, conv_state, slot, c, start, t, first_pos)
        if piece == 0:
            conv_ring_store(x, conv_state, slot, c, start, n, first_pos)


def causal_conv1d_silu(x, weight, conv_state, slot_ids, token_offsets, positions, out,
                       max_seq_tokens: int | None = None, tokens_per_thread: int = 8, *, policy=None) -> None:
    """``out = silu(causal_conv1d(x))`` per sequence, continuing from and updating the ring ``conv_state[slot_ids]``.

    x, out ``[T, C]`` bf16 bits; weight ``[C, K]`` bf16; conv_state ``[slots, C, K]`` bf16; slot_ids ``[B]``,
    token_offsets ``[B+1]``, positions ``[T]`` int32.  ``max_seq_tokens`` is an upper bound on any sequence's token
    count (sizes the grid only; pass 1 for decode; defaults to T, always safe)."""
    _check_bf16(x, 2)
    _check_bf16(weight, 2)
    _check_bf16(conv_state, 3)
    _check_bf16(out, 2)
    channels, taps = weight.shape
    assert x.shape[1] == channels and out.shape == x.shape, (x.shape, out.shape, weight.shape)
    assert conv_state.shape[1:] == (channels, taps), (conv_state.shape, weight.shape)
    _check_sequences(slot_ids, token_offsets)
    _check_positions(positions, x.shape[0])
    assert tokens_per_thread >= taps - 1, "pieces after the first must not need the old state"
    if x.shape[0] == 0 or slot_ids.shape[0] == 0:
        return
    max_tokens = x.shape[0] if max_seq_tokens is None else max_seq_tokens
    max_pieces = max(1, -(-max_tokens // tokens_per_thread))
    block = threads(gpu=256, sim=32)
    items = slot_ids.shape[0] * max_pieces * channels
    launch(causal_conv1d_silu_kernel, grid(items, per_block=block, sim_cap=2), block, x, weight, conv_state,
           slot_ids, token_offsets, positions, out, np.int32(tokens_per_thread), np.int32(max_pieces), pdl=True)


# ------------------------------------------------------------------------------------------------ recurrent form
@kernel
def gated_delta_recurrent_kernel(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out):
    """Gated delta rule, one token after another (decode; also the reference for the chunked form).

    qkv ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (conv output: q | k | v), a, b ``[tokens, Hv]`` bf16 (in_proj_a/b
    outputs), a_log, dt_bias ``[Hv]`` f32, ssm_state ``[slots, Hv, Dk, Dv]`` f32 (updated in place), slot_ids
    ``[B]``, token_offsets ``[B+1]`` int32, out ``[tokens, Hv·Dv]`` bf16.  Fused per token: l2norm of q and k (q
    also · 1/sqrt(Dk)), ``g`` and ``beta`` (module docstring), then the rule::

        S = S·exp(g);  delta = (v − Sᵀk)·beta;  S += k ⊗ delta;  out = bf16(Sᵀq)

    Rows of ``out`` after the last sequence (``token_offsets[B] :``, padding tokens) are set to zero.

    Geometry: one block per (sequence, value head, tile of 32 value columns), grid-strided.  Lane ``l`` owns
    column ``tile·32 + l``; warp ``w`` of ``W`` owns key rows ``w, w+W, …`` (so a warp reads whole 128-byte rows of
    S).  Each warp computes the l2 norms itself (a warp reduction, no barrier) and reads the q, k entries of its
    rows straight from ``qkv``.  The column sums over rows (``Sᵀk``, ``Sᵀq``) are per-thread partial sums combined
    across warps in shared memory: two barriers per token.  S is read twice per token (the second read hits cache)
    and written once.
    """
    pdl_prologue()
    num_v_heads = ssm_state.shape[1]
    key_dim = ssm_state.shape[2]
    value_dim = ssm_state.shape[3]
    num_k_heads = (qkv.shape[1] - num_v_heads * value_dim) // (2 * key_dim)
    heads_per_key = num_v_heads // num_k_heads
    k_base = num_k_heads * key_dim
    v_base = 2 * k_base
    tiles = (value_dim + COL_TILE - 1) // COL_TILE
    q_scale = float32(1.0) / float32(math.sqrt(float32(key_dim)))

    # separate buffers for the two sums, so that each needs one barrier (see the end of the token loop)
    partial_kv = cuda.shared.array((MAX_WARPS, COL_TILE), float32)
    partial_out = cuda.shared.array((MAX_WARPS, COL_TILE), float32)

    zero_rows_from(out, token_offsets[slot_ids.shape[0]])  # padding rows
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    num_warps = cuda.blockDim.x // WARP
    for item in range(cuda.blockIdx.x, slot_ids.shape[0] * num_v_heads * tiles, cuda.gridDim.x):
        tile = item % tiles
        h = (item // tiles) % num_v_heads
        seq = item // (tiles * num_v_heads)
        q_off = (h // heads_per_key) * key_dim  # columns of this value head's key head: q here, k at k_base + q_off
        k_off = k_base + q_off
        slot = slot_ids[seq]
        j = tile * COL_TILE + lane
        has_col = j < value_dim
        for t in range(token_offsets[seq], token_offsets[seq + 1]):
            ssq = float32(0.0)
            ssk = float32(0.0)
            for d in range(lane, key_dim, WARP):
                qv = bf16_to_f32(qkv[t, q_off + d])
                kv = bf16_to_f32(qkv[t, k_off + d])
                ssq += qv * qv
                ssk += kv * kv
            q_mul, k_mul, decay, beta = token_gates(ssq, ssk, q_scale, a[t, h], b[t, h], a_log[h], dt_bias[h])

            # pass 1: kv_mem = (S·decay)ᵀ k
            acc = float32(0.0)
            if has_col:
                for d in range(warp, key_dim, num_warps):
                    acc += ssm_state[slot, h, d, j] * decay * (bf16_to_f32(qkv[t, k_off + d]) * k_mul)
            partial_kv[warp, lane] = acc
            cuda.syncthreads()
            kv_mem = float32(0.0)
            for w in range(num_warps):
                kv_mem += partial_kv[w, lane]
            delta = float32(0.0)
            if has_col:
                delta = (bf16_to_f32(qkv[t, v_base + h * value_dim + j]) - kv_mem) * beta

            # pass 2: S = S·decay + k ⊗ delta, and out = Sᵀ q from the new S
            acc = float32(0.0)
            if has_col:
                for d in range(warp, key_dim, num_warps):
                    s = ssm_state[slot, h, d, j] * decay + (bf16_to_f32(qkv[t, k_off + d]) * k_mul) * delta
                    ssm_state[slot, h, d, j] = s
                    acc += s * (bf16_to_f32(qkv[t, q_off + d]) * q_mul)
            partial_out[warp, lane] = acc
            cuda.syncthreads()
            # No third barrier: a thread writes partial_kv again (next token) only after the barrier above, which
            # every thread reaches after reading partial_kv; likewise partial_out after the next token's first one.
            if warp == 0 and has_col:
                o = float32(0.0)
                for w in range(num_warps):
                    o += partial_out[w, lane]
                out[t, h * value_dim + j] = f32_to_bf16(o)


def gated_delta_recurrent(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out,
                          warps: int = RULE_WARPS) -> None:
    """Gated delta rule token by token (decode: B sequences of one token).  Shapes as in
    ``gated_delta_recurrent_kernel``; updates ``ssm_state[slot_ids]`` in place and writes ``out [T, Hv·Dv]``.
    ``warps`` per block sets how the column sums over key rows are split (``RULE_WARPS``: leave it, except in
    tests of ``gated_delta_decode_step``'s ``row_groups``)."""
    _check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    assert 1 <= warps <= MAX_WARPS, warps
    if qkv.shape[0] == 0 or slot_ids.shape[0] == 0:
        return
    items = slot_ids.shape[0] * ssm_state.shape[1] * (-(-ssm_state.shape[3] // COL_TILE))
    launch(gated_delta_recurrent_kernel, grid(items, sim_cap=8), warps * WARP, qkv, a, b, a_log, dt_bias,
           ssm_state, slot_ids, token_offsets, out, pdl=True)


# ------------------------------------------------------------------------------------------------ chunked form
@dataclass
class ChunkScratch:
    """Per-token intermediates of the chunked form (device arrays, f32), sized for ``max_tokens`` tokens.

    tinv, intra ``[tokens, Hv, C]``: row ``i`` of the token's chunk matrices ``(I+L)⁻¹`` and ``intra``;
    gcum, beta ``[tokens, Hv]``: cumulative log decay from the chunk start, write strength;
    qk_inv ``[tokens, Hk, 2]``: l2norm factors of q (times 1/sqrt(Dk)) and k.
    """
    tinv: object
    intra: object
    gcum: object
    beta: object
    qk_inv: object
    chunk_size: int

    @property
    def max_tokens(self) -> int:
        return self.tinv.shape[0]


def allocate_chunk_scratch(max_tokens: int, num_k_heads: int, num_v_heads: int,
                           chunk_size: int = MAX_CHUNK) -> ChunkScratch:
    """Device scratch for ``gated_delta_chunked`` over at most ``max_tokens`` tokens per call (allocate once)."""
    assert 1 <= chunk_size <= MAX_CHUNK, chunk_size
    n = max(1, max_tokens)
    f32 = np.float32
    return ChunkScratch(tinv=cuda.device_array((n, num_v_heads, chunk_size), f32),
                        intra=cuda.device_array((n, num_v_heads, chunk_size), f32),
                        gcum=cuda.device_array((n, num_v_heads), f32),
                        beta=cuda.device_array((n, num_v_heads), f32),
                        qk_inv=cuda.device_array((n, num_k_heads, 2), f32),
                        chunk_size=chunk_size)


@device_fn
def _stage_rows(qkv, t0, n, col, rows_s, words):
    """``rows_s[i, w]`` ← the bf16 pair ``qkv[t0 + i, col + 2w : col + 2w + 2]`` (low half first) for the chunk's
    ``n`` tokens, ``words`` pairs per token; every thread of the block takes part (the caller syncs)."""
    for idx in range(cuda.threadIdx.x, n * words, cuda.blockDim.x):
        i = idx // words
        w = idx - i * words
        rows_s[i, w] = (uint32(qkv[t0 + i, col + 2 * w + 1]) << uint32(16)) | uint32(qkv[t0 + i, col + 2 * w])


@functools.cache
def _chunk_prepare_kernel(key_dim: int):
    """Build the state-independent kernel for key heads of ``key_dim`` dims (a compile-time constant, so the dot
    products over the key dims are unrolled and their loads issued together)."""
    KD = key_dim
    KW = key_dim // 2

    @kernel
    def gated_delta_chunk_prepare_kernel(qkv, a, b, a_log, dt_bias, token_offsets, chunk_size, max_chunks, tinv,
                                         intra, gcum, beta, qk_inv):
        """The state-independent half of the chunked form, for every chunk of every sequence in parallel.

        Inputs as in ``gated_delta_recurrent_kernel`` (``Hv`` from ``a.shape[1]``, ``Hk`` from ``qk_inv``).  For
        chunk ``[t0, t0+n)`` (``n ≤ chunk_size``) of a sequence and value head ``h`` it writes, for ``i, m < n``
        (module docstring)::

            qk_inv[t0+i, hk] = (1/sqrt(Σq²+eps) / sqrt(Dk),  1/sqrt(Σk²+eps))
            beta[t0+i, h]    = bf16(sigmoid(b));     gcum[t0+i, h] = G_i = Σ_{s≤i} g_s
            tinv[t0+i, h, m] = ((I + L)⁻¹)[i, m]     (0 above the diagonal)
            intra[t0+i, h, m] = exp(G_i − G_m)·(q_i·k_m) for m ≤ i, else 0

        Geometry: one block per (sequence, chunk, value head), grid-strided; ``max_chunks`` bounds chunks per
        sequence.  The chunk's k rows are staged in shared memory; threads stride over tokens for the per-token
        scalars, over (i, m) pairs for the dot products, and over columns ``m`` of ``(I+L)⁻¹`` for the triangular
        solve (column ``m`` solves ``(I+L) x = e_m`` by forward substitution alone, in the k rows' shared memory,
        which the dot products are done with; the block then writes the matrix out row by row); the cumulative sum
        of g is one thread's loop.
        """
        pdl_prologue()
        num_v_heads = a.shape[1]
        num_k_heads = qk_inv.shape[1]
        k_base = num_k_heads * KD
        heads_per_key = num_v_heads // num_k_heads
        q_scale = float32(1.0) / float32(math.sqrt(float32(KD)))

        g_s = cuda.shared.array(MAX_CHUNK, float32)
        beta_s = cuda.shared.array(MAX_CHUNK, float32)
        qinv_s = cuda.shared.array(MAX_CHUNK, float32)
        kinv_s = cuda.shared.array(MAX_CHUNK, float32)
        l_s = cuda.shared.array((MAX_CHUNK, MAX_CHUNK), float32)
        # the chunk's k rows as packed bf16 pairs (one spare word per row keeps lanes reading different rows on
        # different banks); later the columns of (I+L)⁻¹ as f32 bits
        k_s = cuda.shared.array((MAX_CHUNK, K_ROW_WORDS), uint32)

        tid = cuda.threadIdx.x
        for item in range(cuda.blockIdx.x, (token_offsets.shape[0] - 1) * max_chunks * num_v_heads, cuda.gridDim.x):
            h = item % num_v_heads
            chunk = (item // num_v_heads) % max_chunks
            seq = item // (num_v_heads * max_chunks)
            t0 = token_offsets[seq] + chunk * chunk_size
            n = min(chunk_size, token_offsets[seq + 1] - t0)
            if n <= 0:
                continue  # uniform across the block: the whole block skips
            hk = h // heads_per_key
            q_col = hk * KD
            k_col = k_base + q_col
            _stage_rows(qkv, t0, n, k_col, k_s, KW)
            cuda.syncthreads()

            # per-token scalars
            for i in range(tid, n, cuda.blockDim.x):
                t = t0 + i
                ssq = float32(0.0)
                ssk = float32(0.0)
                for w in range(KW):
                    q0 = bf16_to_f32(qkv[t, q_col + 2 * w])
                    q1 = bf16_to_f32(qkv[t, q_col + 2 * w + 1])
                    k0 = bf16x2_lo(k_s[i, w])
                    k1 = bf16x2_hi(k_s[i, w])
                    ssq += q0 * q0 + q1 * q1
                    ssk += k0 * k0 + k1 * k1
                qinv_s[i] = inverse_l2_norm(ssq) * q_scale
                kinv_s[i] = inverse_l2_norm(ssk)
                g_s[i] = log_decay(a[t, h], a_log[h], dt_bias[h])
                beta_s[i] = write_strength(b[t, h])
                beta[t, h] = beta_s[i]
                if h % heads_per_key == 0:  # one of the value heads sharing this key head writes its norms
                    qk_inv[t, hk, 0] = qinv_s[i]
                    qk_inv[t, hk, 1] = kinv_s[i]
            cuda.syncthreads()
            if tid == 0:
                run = float32(0.0)
                for i in range(n):
                    run += g_s[i]
                    g_s[i] = run
                    gcum[t0 + i, h] = run
            cuda.syncthreads()

            # L (strictly lower, into shared) and intra (lower with diagonal, to global).  Consecutive threads take
            # consecutive m for one i: k_m from shared memory (conflict-free), q_i and k_i broadcast.
            for p in range(tid, n * n, cuda.blockDim.x):
                i = p // n
                m = p % n
                kk = float32(0.0)
                qk = float32(0.0)
                if m <= i:
                    for w in range(KW):
                        km, ki = k_s[m, w], k_s[i, w]
                        km0 = bf16x2_lo(km)
                        km1 = bf16x2_hi(km)
                        kk += bf16x2_lo(ki) * km0 + bf16x2_hi(ki) * km1
                        qi0 = bf16_to_f32(qkv[t0 + i, q_col + 2 * w])
                        qi1 = bf16_to_f32(qkv[t0 + i, q_col + 2 * w + 1])
                        qk += qi0 * km0 + qi1 * km1
                pair_decay = float32(math.exp(g_s[i] - g_s[m])) if m <= i else float32(0.0)
                l_s[i, m] = beta_s[i] * pair_decay * (kk * kinv_s[i] * kinv_s[m]) if m < i else float32(0.0)
                intra[t0 + i, h, m] = pair_decay * (qk * qinv_s[i] * kinv_s[m])
            cuda.syncthreads()   # the k rows are no longer needed: k_s now holds (I+L)⁻¹

            # (I + L)⁻¹ column by column: x_m = 1, x_i = −Σ_{m≤p<i} L[i,p]·x_p (a thread reads back only its own
            # column; lanes take consecutive columns: conflict-free)
            for m in range(tid, n, cuda.blockDim.x):
                for i in range(n):
                    if i < m:
                        x = float32(0.0)
                    elif i == m:
                        x = float32(1.0)
                    else:
                        x = float32(0.0)
                        for p in range(m, i):
                            x -= l_s[i, p] * bits_f32(k_s[p, m])
                    k_s[i, m] = f32_bits(x)
            cuda.syncthreads()
            for p in range(tid, n * n, cuda.blockDim.x):
                i = p // n
                m = p - i * n
                tinv[t0 + i, h, m] = bits_f32(k_s[i, m])
            cuda.syncthreads()  # l_s, k_s and the scalars are reused by the block's next item

    return gated_delta_chunk_prepare_kernel


@device_fn
def _stage_words(src32, first, stride, n, row_words, dst, copy_async):
    """Start copying ``n`` rows of ``row_words`` words, ``src32[first + i·stride : +row_words]``, to
    ``dst[i·row_words : +row_words]`` (shared memory); every thread of the block takes its share.  ``copy_async``
    (a compile-time constant): 16-byte ``cp.async`` copies, one group per thread (``row_words``, ``first`` and
    ``stride`` multiples of 4, the array 16-byte aligned), else word by word.  The caller then waits
    (``_wait_copies()``) and syncs the block."""
    if copy_async:
        slices = row_words >> 2
        for idx in range(cuda.threadIdx.x, n * slices, cuda.blockDim.x):
            i = idx // slices
            w = 4 * (idx - i * slices)
            cp_async_16(dst, i * row_words + w, src32, first + i * stride + w, 16)
        cp_async_commit()
    else:
        for idx in range(cuda.threadIdx.x, n * row_words, cuda.blockDim.x):
            i = idx // row_words
            w = idx - i * row_words
            dst[idx] = src32[first + i * stride + w]


_wait_copies = cp_async_wait_group(0)


@device_fn
def _state_dot(rows_s, row, s_tile, lane, words):
    """``Sᵀx`` for column ``lane`` of the state tile: ``Σ_w`` of the staged bf16 pair ``rows_s[row + w]`` (key dims
    ``2w, 2w+1`` of a q or k row) times ``s_tile[2w, lane], s_tile[2w+1, lane]``, in that order.  Indices are
    unsigned (``primitives``: no wraparound code per load)."""
    acc = float32(0.0)
    for w in range(words):
        pair = rows_s[row + uint32(w)]
        acc += bf16x2_lo(pair) * s_tile[uint32(2 * w), lane]
        acc += bf16x2_hi(pair) * s_tile[uint32(2 * w + 1), lane]
    return acc


@device_fn
def _staged_row_times(acc, rows_s, row, count, cols_s, lane):
    """``acc + Σ_{m<count} rows_s[row + m] · cols_s[m, lane]``, in order: a staged f32 row of ``(I+L)⁻¹`` or
    ``intra`` (as bits) times column ``lane`` of R or U (unsigned indices)."""
    for m in range(count):
        acc += bits_f32(rows_s[row + m]) * cols_s[m, lane]
    return acc


@functools.cache
def _chunk_scan_kernel(key_dim: int, copy_async: bool):
    """Build the state-carrying kernel for key heads of ``key_dim`` dims (a compile-time constant: its dot products
    over the key dims are unrolled); ``copy_async``: stage rows with ``cp.async`` (``_stage_words``)."""
    KD = key_dim
    KW = key_dim // 2

    @_bounded_kernel(SCAN_THREADS)
    def gated_delta_chunk_scan_kernel(qkv, qkv32, ssm_state, slot_ids, token_offsets, chunk_size, tinv32, intra32,
                                      gcum, beta, qk_inv, out):
        """The state-carrying half of the chunked form: walks each sequence's chunks in order.

        qkv ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (``qkv32``: the same bytes as flat uint32), ssm_state ``[slots, Hv,
        Dk, Dv]`` f32 (updated in place), the ``ChunkScratch`` arrays written by
        ``_chunk_prepare_kernel`` (``tinv32`` / ``intra32``: ``tinv`` / ``intra`` as flat uint32), out
        ``[tokens, Hv·Dv]`` bf16.  Per chunk ``[t0, t0+n)``, with ``S`` this block's ``[Dk, 32]`` column tile of
        the state (module docstring)::

            R_i   = beta_i · (v_i − exp(G_i)·Sᵀk_i)            step 1
            U     = (I+L)⁻¹ · R                                 step 2
            out_i = bf16(exp(G_i)·Sᵀq_i + Σ_{m≤i} intra[i,m]·U_m)      step 3 (3a: the first term, 3b: the sum)
            S     = exp(G_{n−1})·S + Σ_i exp(G_{n−1} − G_i)·k_i ⊗ U_i   step 4

        Rows of ``out`` after the last sequence (``token_offsets[B] :``, padding tokens) are set to zero.

        Geometry: one block per (sequence, value head, tile of 32 value columns), grid-strided; the tile of S lives
        in shared memory for the whole sequence.  Lane ``l`` owns column ``l`` of the tile; warps stride over tokens
        (steps 1-3) or pairs of key rows (step 4); a barrier separates the steps.  Whatever a step reads row by row
        -- the chunk's k rows (steps 1, 4), ``(I+L)⁻¹`` (2), q rows (3a), ``intra`` (3b) -- is first copied into
        one shared buffer (``_stage_words``, all its 16-byte pieces in flight at once), so the inner loops read
        shared memory, the same word for every lane, instead of waiting on a global load per term.  Shared memory
        at Dk = 128: S 16 KB, R and U 8 KB each, the buffer 16 KB.  R holds 3a's first terms once step 2 is done
        with it, then step 4's weights ``exp(G_{n−1} − G_i)·|k_i|⁻¹`` in its column 0.
        """
        pdl_prologue()
        num_v_heads = ssm_state.shape[1]
        value_dim = ssm_state.shape[3]
        num_k_heads = qk_inv.shape[1]
        heads_per_key = num_v_heads // num_k_heads
        k_base = num_k_heads * KD
        v_base = 2 * k_base
        token_words = qkv.shape[1] // 2          # qkv32 words per token
        chunk_words = num_v_heads * chunk_size   # tinv32 / intra32 words per token
        tiles = (value_dim + COL_TILE - 1) // COL_TILE

        s_tile = cuda.shared.array((KD, COL_TILE), float32)
        r_s = cuda.shared.array((MAX_CHUNK, COL_TILE), float32)
        u_s = cuda.shared.array((MAX_CHUNK, COL_TILE), float32)
        rows_s = cuda.shared.array(STAGE_WORDS, uint32, alignment=16)   # staged rows, row i at i·(row words)

        zero_rows_from(out, token_offsets[slot_ids.shape[0]])  # padding rows
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        num_warps = cuda.blockDim.x // WARP
        # shared-memory indices in the inner loops are unsigned: numba then skips its negative-index wraparound
        # (a compare and select per access, which made the ALU this kernel's busiest pipe)
        ulane = uint32(lane)
        for item in range(cuda.blockIdx.x, slot_ids.shape[0] * num_v_heads * tiles, cuda.gridDim.x):
            tile = item % tiles
            h = (item // tiles) % num_v_heads
            seq = item // (tiles * num_v_heads)
            hk = h // heads_per_key
            seq_start = token_offsets[seq]
            seq_len = token_offsets[seq + 1] - seq_start
            if seq_len <= 0:
                continue  # an empty sequence leaves its slot alone (uniform across the block)
            slot = slot_ids[seq]
            j = tile * COL_TILE + lane
            has_col = j < value_dim
            q_word = hk * KW                  # this key head's q, then k, in a token's qkv32 row
            k_word = (k_base + hk * KD) // 2
            for d in range(warp, KD, num_warps):
                s_tile[d, lane] = ssm_state[slot, h, d, j] if has_col else float32(0.0)
            for t0 in range(seq_start, seq_start + seq_len, chunk_size):
                n = min(chunk_size, seq_start + seq_len - t0)
                g_last = gcum[t0 + n - 1, h]
                _stage_words(qkv32, t0 * token_words + k_word, token_words, n, KW, rows_s, copy_async)
                _wait_copies()
                cuda.syncthreads()   # k rows staged; S loaded (first chunk) or carried (step 4 of the last)
                # step 1: targets against the state before the chunk
                for i in range(warp, n, num_warps):
                    t = t0 + i
                    v = bf16_to_f32(qkv[t, v_base + h * value_dim + j]) if has_col else float32(0.0)
                    decay = float32(math.exp(gcum[t, h]))
                    strength = beta[t, h]
                    k_inv = qk_inv[t, hk, 1]
                    sk = _state_dot(rows_s, uint32(i * KW), s_tile, ulane, KW)
                    r_s[i, lane] = strength * (v - decay * (sk * k_inv))
                cuda.syncthreads()
                # step 2: the deltas actually written, U = (I+L)⁻¹ R
                _stage_words(tinv32, (t0 * num_v_heads + h) * chunk_size, chunk_words, n, chunk_size, rows_s,
                             copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    u_s[i, lane] = _staged_row_times(float32(0.0), rows_s, uint32(i * chunk_size), uint32(i + 1), r_s,
                                                     ulane)
                cuda.syncthreads()
                # step 3a: what the old state returns for q_i, into R
                _stage_words(qkv32, t0 * token_words + q_word, token_words, n, KW, rows_s, copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    t = t0 + i
                    decay = float32(math.exp(gcum[t, h]))
                    q_inv = qk_inv[t, hk, 0]
                    sq = _state_dot(rows_s, uint32(i * KW), s_tile, ulane, KW)
                    r_s[i, lane] = decay * (sq * q_inv)
                cuda.syncthreads()
                # step 3b: plus attention inside the chunk
                _stage_words(intra32, (t0 * num_v_heads + h) * chunk_size, chunk_words, n, chunk_size, rows_s,
                             copy_async)
                _wait_copies()
                cuda.syncthreads()
                for i in range(warp, n, num_warps):
                    o = _staged_row_times(r_s[i, lane], rows_s, uint32(i * chunk_size), uint32(i + 1), u_s, ulane)
                    if has_col:
                        out[t0 + i, h * value_dim + j] = f32_to_bf16(o)
                cuda.syncthreads()
                # step 4: carry the state to the end of the chunk (k rows again; the weights into R's column 0)
                _stage_words(qkv32, t0 * token_words + k_word, token_words, n, KW, rows_s, copy_async)
                for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
                    r_s[i, 0] = float32(math.exp(g_last - gcum[t0 + i, h])) * qk_inv[t0 + i, hk, 1]
                _wait_copies()
                cuda.syncthreads()
                chunk_decay = float32(math.exp(g_last))
                for w in range(warp, KW, num_warps):   # key rows 2w and 2w + 1: one staged word holds both
                    acc_lo = float32(0.0)
                    acc_hi = float32(0.0)
                    for i in range(uint32(n)):
                        pair = rows_s[i * uint32(KW) + uint32(w)]
                        weight = r_s[i, 0]
                        delta = u_s[i, ulane]
                        acc_lo += bf16x2_lo(pair) * weight * delta
                        acc_hi += bf16x2_hi(pair) * weight * delta
                    s_tile[2 * w, lane] = s_tile[2 * w, lane] * chunk_decay + acc_lo
                    s_tile[2 * w + 1, lane] = s_tile[2 * w + 1, lane] * chunk_decay + acc_hi
                cuda.syncthreads()  # s_tile, r_s, u_s and rows_s are rewritten by the next chunk
            if has_col:
                for d in range(warp, KD, num_warps):
                    ssm_state[slot, h, d, j] = s_tile[d, lane]
            cuda.syncthreads()  # s_tile is reloaded by the block's next item

    return gated_delta_chunk_scan_kernel


def _aligned_16(a) -> bool:
    """Whether the array's first byte sits on a 16-byte boundary (``cp.async``'s 16-byte copies need it)."""
    cai = getattr(a, "__cuda_array_interface__", None)
    addr = cai["data"][0] if cai is not None else a.__array_interface__["data"][0]
    return addr % 16 == 0


def gated_delta_chunked(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out, scratch: ChunkScratch,
                        max_seq_tokens: int | None = None, *, policy=None) -> None:
    """Gated delta rule for prompts, chunk by chunk (same result as ``gated_delta_recurrent``).  Shapes as in
    ``gated_delta_recurrent`` (``qkv`` contiguous); ``scratch`` from ``allocate_chunk_scratch`` (its chunk size is
    used); ``max_seq_tokens`` bounds any sequence's length (grid sizing only; defaults to T)."""
    _check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    num_tokens = qkv.shape[0]
    if num_tokens == 0 or slot_ids.shape[0] == 0:
        return
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    assert scratch.max_tokens >= num_tokens, (scratch.max_tokens, num_tokens)
    assert scratch.tinv.shape[1] == num_v_heads and scratch.qk_inv.shape[1] == _num_k_heads(qkv, ssm_state)
    chunk = scratch.chunk_size
    max_tokens = num_tokens if max_seq_tokens is None else max_seq_tokens
    max_chunks = max(1, -(-max_tokens // chunk))
    s = scratch
    launch(_chunk_prepare_kernel(key_dim), grid(slot_ids.shape[0] * max_chunks * num_v_heads, sim_cap=16),
           threads(gpu=128, sim=32), qkv, a, b, a_log, dt_bias, token_offsets, np.int32(chunk), np.int32(max_chunks),
           s.tinv, s.intra, s.gcum, s.beta, s.qk_inv, pdl=True)
    copy_async = (key_dim % 8 == 0 and qkv.shape[1] % 8 == 0 and chunk % 4 == 0 and _aligned_16(qkv)
                  and _aligned_16(s.tinv) and _aligned_16(s.intra))
    items = slot_ids.shape[0] * num_v_heads * (-(-value_dim // COL_TILE))
    launch(_chunk_scan_kernel(key_dim, copy_async), grid(items, sim_cap=8), threads(gpu=SCAN_THREADS, sim=32),
           qkv, as_words(qkv), ssm_state, slot_ids, token_offsets, np.int32(chunk), as_words(s.tinv), as_words(s.intra),
           s.gcum, s.beta, s.qk_inv, out, pdl=True)


# ------------------------------------------------------------------------------------------------ gated RMSNorm
@kernel
def gated_rms_norm_kernel(x, z, weight, out, eps):
    """HF ``Qwen3_5RMSNormGated`` over each head's ``Dv`` values, gated by SiLU of ``z``.

    x, z, out ``[tokens, Hv·Dv]`` bf16 (x: the rule's output, z: in_proj_z output), weight ``[Dv]`` bf16 (a
    plain weight, initialised to ones: *not* the ``1 + w`` form of the other Qwen3.5 norms).  Per (token, head)
    row, ``r = 1/sqrt(mean(x²) + eps)`` in f32 and, rounding as HF's bf16 forward does::

        out = bf16( bf16(w · bf16(x·r)) · silu(z) )

    Geometry: one warp per (token, head) row (``Dv`` is small: 128 in Qwen3.5), ``W`` rows per block, grid-strided
    with a trip count uniform across the block (the warp reduction needs every thread); lanes stride over ``Dv``.
    Each lane reads back only its own columns, so ``out`` may alias ``x``.
    """
    pdl_prologue()
    group = weight.shape[0]
    heads = x.shape[1] // group
    rows = x.shape[0] * heads
    eps = float32(eps)
    lane = cuda.threadIdx.x % WARP
    warps = cuda.blockDim.x // WARP
    for first in range(cuda.blockIdx.x * warps, rows, cuda.gridDim.x * warps):
        row = first + cuda.threadIdx.x // WARP
        active = row < rows
        t = row // heads
        base = (row % heads) * group
        ss = float32(0.0)
        if active:
            for i in range(lane, group, WARP):
                v = bf16_to_f32(x[t, base + i])
                ss += v * v
        inv_rms = inverse_rms(warp_sum(ss), group, eps)
        if active:
            for i in range(lane, group, WARP):
                out[t, base + i] = gated_norm_value(bf16_to_f32(x[t, base + i]), inv_rms, weight[i], z[t, base + i])


def gated_rms_norm(x, z, weight, out, eps: float, *, policy=None) -> None:
    """``out = RMSNormGated(x, gate=z)`` per head of ``Dv = weight.shape[0]`` values; x, z, out ``[T, Hv·Dv]``,
    weight ``[Dv]`` bf16 bits (out may be x)."""
    _check_bf16(x, 2)
    _check_bf16(z, 2)
    _check_bf16(weight, 1)
    _check_bf16(out, 2)
    assert z.shape == x.shape and out.shape == x.shape, (x.shape, z.shape, out.shape)
    assert x.shape[1] % weight.shape[0] == 0, (x.shape, weight.shape)
    rows = x.shape[0] * (x.shape[1] // weight.shape[0])
    if rows == 0:
        return
    block = threads(gpu=128, sim=64)
    launch(gated_rms_norm_kernel, grid(rows, per_block=block // WARP, sim_cap=2), block, x, z, weight, out,
           np.float32(eps), pdl=True)


# ------------------------------------------------------------------------------------------------ fused decode step
if SIMULATOR:
    @device_fn
    def opaque(x):
        """``x`` itself (the simulator has no optimizer to hide it from)."""
        return x
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _opaque_f32(typingctx, x):
        """``mov.b32``: an f32 passed through unchanged, as a value the compiler cannot see through."""
        if x != types.float32:
            return None
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            return builder.call(ir.InlineAsm(ir.FunctionType(f32, [f32]), "mov.b32 $0, $1;", "=f,f"), [args[0]])

        return sig, codegen

    @device_fn
    def opaque(x):
        """``x`` (f32) unchanged, but hidden from the optimizer: ``opaque(s) * decay`` is a product of its own,
        never merged with another ``s * decay`` (which would change how the compiler fuses it into an FMA)."""
        return _opaque_f32(x)


@device_fn
def _head_channel(c, hk, h, key_dim, value_dim, k_base, v_base):
    """Channel of ``x`` (the conv's input) for a block's local channel ``c``: ``c < Dk`` the q channels of key head
    ``hk``, then its ``Dk`` k channels, then the v channels of value heads ``h, h+1, ..``."""
    if c < key_dim:
        return hk * key_dim + c
    if c < 2 * key_dim:
        return k_base + hk * key_dim + (c - key_dim)
    return v_base + h * value_dim + (c - 2 * key_dim)


def _bounded_kernel(threads_per_block: int):
    """``@kernel`` compiled for blocks of ``threads_per_block`` threads, one block per SM (``launch_bounds``:
    ptxas then keeps to the registers that block size allows; a GPU-only option)."""
    if SIMULATOR:
        return kernel
    return cuda.jit(cache=True, launch_bounds=(threads_per_block, 1))


@functools.cache
def _decode_step_kernel(key_dim: int, value_dim: int, row_groups: int, tiles_per_thread: int, decode: bool = False,
                        taps: int = 4, release: str = "loads", early_gates: bool = False, stamps: bool = False):
    """Build the fused decode step for heads of ``key_dim × value_dim``, ``row_groups`` key-row classes (the
    summation order of ``gated_delta_recurrent`` with that many warps) and ``tiles_per_thread`` 32-column tiles
    per thread.  All four are compile-time constants: the per-thread state is a register array of
    ``ceil(Dk / row_groups) · tiles_per_thread`` f32 whose loops unroll, and with the head dims known every
    state element's address is one base register plus an immediate offset.  ``decode``: every sequence is one
    token and sequence ``b`` is token ``b`` (the PDL early loads below); ``taps``: the conv's kernel size (decode
    mode holds a thread's conv weights and older inputs in registers); ``release``: ``DECODE_STEP_RELEASES``;
    ``early_gates`` (decode): the block's first item keeps what it read before the PDL wait (its sequence, slot,
    position, head) instead of recomputing and re-reading it after the wait, also reads its head's ``A_log`` and
    ``dt_bias`` there, and computes the token's decay and write strength as soon as ``a`` and ``b`` arrive, before
    the conv's barrier rather than after it (``DECODE_EARLY_GATES``; the same operations: the same bits);
    ``stamps``: each block appends its ``timeline`` record (ready: its first item's outputs written)."""
    assert release in DECODE_STEP_RELEASES, release
    STAMPS = stamps
    DECODE = decode
    EARLY_GATES = decode and early_gates
    RELEASE_AT_START = not decode or release == "start"
    RELEASE_AFTER_LOADS = decode and release == "loads"
    RELEASE_AFTER_OUTPUTS = decode and release == "outputs"
    KD = key_dim
    VD = value_dim
    R = row_groups
    TPT = tiles_per_thread
    ROWS = -(-KD // R)           # key rows per thread: row_class, row_class + R, ...
    REGS = ROWS * TPT            # (array sizes must be closure constants, not expressions)
    QK_WORDS = 2 * KD
    tiles = -(-VD // COL_TILE)
    NT = R * -(-tiles // TPT) * WARP     # threads per block
    CONV_CHANNELS = 2 * KD + VD          # the q, k channels of a key head and the v channels of a value head
    ALL_ROWS = KD % R == 0               # every thread's rows / columns exist: no guards (Qwen3.5: both)
    ALL_COLS = VD % (TPT * WARP) == 0
    TAPS = taps
    CONV_ROUNDS = -(-CONV_CHANNELS // NT)   # conv channels per thread (block-strided)
    CONV_REGS = CONV_ROUNDS * TAPS
    OUT_ROUNDS = -(-VD // NT)               # output columns per thread (block-strided)
    VEC = TPT if TPT in (2, 4) and ALL_COLS else 1   # a thread's columns moved by one 8- / 16-byte access
    PARTIAL = R * VD                        # the per-row-class column sums in shared memory, [R, Dv]

    @device_fn
    def state_rows(ssm_state, base, state, row_class, first_col, store):
        """Load (``store`` False) or store this thread's state ``state[m·ROWS + i] = S[row_class + R·i,
        first_col + m]``, which sits at ``base + R·i·Dv + m``: one ``VEC``-wide access per row."""
        for i in range(ROWS):
            if ALL_ROWS or row_class + R * i < KD:
                at = base + uint64(R * i * VD)
                if VEC == 4:
                    if store:
                        store_f32x4(ssm_state, at, state[i], state[ROWS + i], state[2 * ROWS + i],
                                    state[3 * ROWS + i])
                    else:
                        state[i], state[ROWS + i], state[2 * ROWS + i], state[3 * ROWS + i] = load_f32x4(ssm_state,
                                                                                                         at)
                elif VEC == 2:
                    if store:
                        store_f32x2(ssm_state, at, state[i], state[ROWS + i])
                    else:
                        state[i], state[ROWS + i] = load_f32x2(ssm_state, at)
                else:
                    for m in range(TPT):
                        if ALL_COLS or first_col + m < VD:
                            if store:
                                ssm_state[at + uint64(m)] = state[m * ROWS + i]
                            else:
                                state[m * ROWS + i] = ssm_state[at + uint64(m)]

    @device_fn
    def store_cols(dst, at, vals, first_col):
        """``dst[at + m] = vals[m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            store_f32x4(dst, at, vals[0], vals[1], vals[2], vals[3])
        elif VEC == 2:
            store_f32x2(dst, at, vals[0], vals[1])
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    dst[at + uint64(m)] = vals[m]

    @device_fn
    def load_cols(src, at, vals, first_col):
        """``vals[m] = src[at + m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            vals[0], vals[1], vals[2], vals[3] = load_f32x4(src, at)
        elif VEC == 2:
            vals[0], vals[1] = load_f32x2(src, at)
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    vals[m] = src[at + uint64(m)]

    @device_fn
    def add_cols(src, at, vals, first_col):
        """``vals[m] += src[at + m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            x0, x1, x2, x3 = load_f32x4(src, at)
            vals[0] += x0
            vals[1] += x1
            vals[2] += x2
            vals[3] += x3
        elif VEC == 2:
            x0, x1 = load_f32x2(src, at)
            vals[0] += x0
            vals[1] += x1
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    vals[m] += src[at + uint64(m)]

    @device_fn
    def decode_prefetch(conv_weight, conv_state, norm_weight, slot, pos, h, hk, k_base, v_base, wts, hist, nw):
        """Decode mode: what this thread's conv channels and output columns need besides the projection's
        outputs -- the conv weights ``wts[r·K + k]``, the ring's older inputs ``hist[r·K + k]`` (``k < K-1``:
        positions ``pos - (K-1) + k``, zero below 0) and the norm weights ``nw[r]`` -- all read by no kernel of the
        step, so they may be loaded before the PDL wait."""
        tid = cuda.threadIdx.x
        for r in range(CONV_ROUNDS):
            c = r * NT + tid
            if c < CONV_CHANNELS:
                ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                for k in range(TAPS):
                    wts[r * TAPS + k] = conv_weight[ch, k]
                    p = pos - (TAPS - 1) + k
                    if k < TAPS - 1:
                        hist[r * TAPS + k] = conv_state[slot, ch, p % TAPS] if p >= 0 else uint16(0)
        for r in range(OUT_ROUNDS):
            j = r * NT + tid
            if j < VD:
                nw[r] = norm_weight[j]

    @_bounded_kernel(NT)
    def gated_delta_decode_step_kernel(x, conv_weight, conv_state, z, a, b, a_log, dt_bias, norm_weight, eps,
                                       ssm_state, slot_ids, token_offsets, positions, token_slots, out, stamp_buf):
        """One Gated DeltaNet step after in_proj, for sequences of one token: conv + SiLU, the delta rule and the
        gated RMSNorm in one launch, bit-identical to ``causal_conv1d_silu`` → ``gated_delta_recurrent`` (with
        ``row_groups`` warps) → ``gated_rms_norm``.

        x ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (in_proj_qkv output: q | k | v before the conv), conv_weight
        ``[2·Hk·Dk + Hv·Dv, K]`` bf16, conv_state ``[slots, 2·Hk·Dk + Hv·Dv, K]`` bf16 (the ring, module
        docstring), z ``[tokens, Hv·Dv]``, a, b ``[tokens, Hv]`` bf16, a_log, dt_bias ``[Hv]`` f32, norm_weight
        ``[Dv]`` bf16, eps f32, ssm_state ``[slots · Hv · Dk · Dv]`` f32 (``[slots, Hv, Dk, Dv]`` seen flat),
        slot_ids ``[B]``, token_offsets ``[B+1]``, positions ``[tokens]`` int32, out ``[tokens, Hv·Dv]`` bf16.
        Per token and value head ``h`` (key head ``hk = h // (Hv/Hk)``)::

            q, k, v = bf16(silu(bf16(conv(x))))      q, k: channels of hk; v: channels of h; ring updated
            S = S·exp(g);  delta = (v − Sᵀk̂)·beta;  S += k̂ ⊗ delta;  o = bf16(Sᵀq̂)     (k̂, q̂ l2-normalised)
            out = bf16(bf16(w · bf16(o · rms(o)⁻¹)) · silu(z))

        Rows after the last sequence (``token_offsets[B]:``, padding) get the gated norm of a zero row (what the
        three kernels leave there).  Sequences of several tokens (a prompt scored row by row) are also exact:
        one block per key head then runs its value heads one after another (below).

        Geometry: one block per (sequence, value head), grid-strided, of ``row_groups`` warps per
        ``tiles_per_thread`` 32-column tiles (Qwen3.5: 8 row classes × 2 column groups = 16 warps).  Warp ``w``
        owns key rows ``d ≡ w mod row_groups`` and, in column group ``c = w // row_groups``, ``tiles_per_thread``
        tiles of 32 columns: lane ``l`` holds the ``T = tiles_per_thread`` consecutive columns ``32·T·c + T·l + m``,
        which it loads and stores with one 8- or 16-byte access per row (T = 2 or 4), i.e. ``S[d, j]`` for ``d``
        in its row class: read once into registers (issued before the conv, whose loads they overlap), decayed and
        updated there, written once.  The block first computes the conv of the 2·Dk q/k and Dv v channels it needs
        (threads stride over channels; the two value heads of a key head both compute its q/k: cheap), then every
        warp its own l2 norms (as the recurrent kernel, one warp reduction each), then the column sums ``Sᵀk`` and
        ``Sᵀq``: per thread over its rows, then over the row classes in order through shared memory (the recurrent
        kernel's order).  With the head's Dv outputs in shared memory, every warp reduces their squares the way
        ``gated_rms_norm`` does and threads stride over the columns for the output.  Four barriers per token.

        Conv ring: a one-token step reads entries ``(p−K+1 .. p−1) % K`` and writes entry ``p % K``; two blocks
        sharing a key head write the same q/k values there, and neither reads it, so their lack of order is
        harmless.  A longer sequence would overwrite entries the other block may still read, so for ``n > 1``
        tokens the block of the first value head of each key head does all of them (the others skip) and writes
        the ring last.

        PDL: without ``decode`` the kernel lets the next one launch and waits for the previous one at its start.
        With ``decode`` (a decode step: sequence ``b`` is token ``b``, its slot ``token_slots[b]`` and position
        ``positions[b]``, which the host wrote before the step; ``slot_ids`` / ``token_offsets`` are then not read)
        a block first loads what no kernel of the step writes for its first item -- its state, its conv weights and
        older ring inputs, the norm weights -- into registers, then waits for the projection and issues its loads
        of ``x``, ``a``, ``b`` and ``z`` together: one memory round trip after the wait.  It lets the next kernel
        launch where ``release`` says (``DECODE_STEP_RELEASE``).
        """
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        if DECODE:
            if RELEASE_AT_START:
                launch_dependents()
        else:
            pdl_prologue()
        num_v_heads = a_log.shape[0]
        num_k_heads = (x.shape[1] - num_v_heads * VD) // (2 * KD)
        heads_per_key = num_v_heads // num_k_heads
        k_base = num_k_heads * KD
        v_base = 2 * k_base
        q_scale = float32(1.0) / float32(math.sqrt(float32(KD)))
        eps = float32(eps)

        qk_s = cuda.shared.array(QK_WORDS, float32)              # this token's q then k (f32 of the bf16 conv outputs)
        # (16-byte aligned: the vector accesses of store_cols / load_cols / add_cols)
        v_s = cuda.shared.array(VD, float32, alignment=16)       # its v for head h
        o_s = cuda.shared.array(VD, float32)                     # the rule's outputs (bf16 values)
        partial_kv = cuda.shared.array(PARTIAL, float32, alignment=16)    # [R, Dv] per row class: Σ_d S·decay·k̂
        partial_out = cuda.shared.array(PARTIAL, float32, alignment=16)   # [R, Dv] per row class: Σ_d S·q̂
        state = cuda.local.array(REGS, float32)                  # state[m·ROWS + i] = S[row_class + R·i, col m]
        col_acc = cuda.local.array(TPT, float32)                 # per column of the thread: its partial sum
        col_delta = cuda.local.array(TPT, float32)               # per column: kv_mem, then delta
        col_v = cuda.local.array(TPT, float32)                   # per column: v

        # Indices into shared memory and the state are unsigned (no negative-index wraparound code) and the
        # block-stride loops step by the compile-time block size: every address is then a base register plus an
        # immediate, and nothing else is computed ahead and kept live across the loops (which costs registers).
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        row_class = warp % R
        first_col = (warp // R) * (TPT * WARP) + lane * TPT     # this thread's columns: first_col + m
        u_tid = uint64(tid)
        u_row = uint64(row_class)
        u_col = uint64(first_col)
        num_seqs = slot_ids.shape[0]

        wts = cuda.local.array(CONV_REGS, uint16)     # decode: this thread's conv weights [round, tap]
        hist = cuda.local.array(CONV_REGS, uint16)    # decode: their older inputs (taps < K-1)
        xin = cuda.local.array(CONV_ROUNDS, uint16)   # decode: this token's inputs of those channels
        zin = cuda.local.array(OUT_ROUNDS, uint16)    # decode: z of this thread's output columns
        nw = cuda.local.array(OUT_ROUNDS, uint16)     # decode: their norm weights
        inv_rms_zero = inverse_rms(float32(0.0), VD, eps)

        pre = False  # decode: the block's first item was loaded before the wait
        pre_seq = pre_h = 0
        pre_slot = pre_pos = int32(0)
        pre_a_log = pre_dt_bias = decay = beta = float32(0.0)
        if DECODE:
            if cuda.blockIdx.x < num_seqs * num_v_heads:
                pre_seq = cuda.blockIdx.x // num_v_heads
                pre_slot = token_slots[pre_seq]
                if pre_slot >= 0:
                    pre = True
                    pre_h = cuda.blockIdx.x % num_v_heads
                    pre_pos = positions[pre_seq]
                    if EARLY_GATES:
                        pre_a_log = float32(a_log[pre_h])
                        pre_dt_bias = float32(dt_bias[pre_h])
                    base = uint64(((pre_slot * num_v_heads + pre_h) * KD + row_class) * VD + first_col)
                    state_rows(ssm_state, base, state, row_class, first_col, False)
                    decode_prefetch(conv_weight, conv_state, norm_weight, pre_slot, pre_pos, pre_h,
                                    pre_h // heads_per_key, k_base, v_base, wts, hist, nw)
            grid_dependency_wait()
            if STAMPS:
                t_wait = global_timer()
        else:
            # padding rows: the rule's zeros through the gated norm
            first_pad = token_offsets[num_seqs]
            width = out.shape[1]
            for idx in range(cuda.blockIdx.x * NT + tid, (out.shape[0] - first_pad) * width, cuda.gridDim.x * NT):
                row = first_pad + idx // width
                col = idx % width
                out[row, col] = gated_norm_value(float32(0.0), inv_rms_zero, norm_weight[col % VD], z[row, col])

        for item in range(cuda.blockIdx.x, num_seqs * num_v_heads, cuda.gridDim.x):
            kept = EARLY_GATES and pre and item == cuda.blockIdx.x   # what was read before the wait still holds
            if kept:
                first_head = pre_h
                seq = pre_seq
            else:
                first_head = item % num_v_heads
                seq = item // num_v_heads
            heads = 1
            if DECODE:
                slot = pre_slot if kept else token_slots[seq]
                if slot < 0:  # a padding token: the rule's zeros through the gated norm
                    for r in range(OUT_ROUNDS):
                        j = r * NT + tid
                        if j < VD:
                            col = first_head * VD + j
                            out[seq, col] = gated_norm_value(float32(0.0), inv_rms_zero, norm_weight[j],
                                                             z[seq, col])
                    continue
                start = seq
                n = 1
            else:
                start = token_offsets[seq]
                n = token_offsets[seq + 1] - start
                if n > 1:
                    heads = heads_per_key if first_head % heads_per_key == 0 else 0
                if n <= 0 or heads == 0:
                    continue  # uniform across the block: an empty sequence leaves its slot alone
                slot = slot_ids[seq]
            first_pos = pre_pos if kept else positions[start]
            hk = first_head // heads_per_key
            # one (head, token) per step: a single step for a decode token
            for step in range(heads * n):
                h = first_head + step // n
                t = start + step % n
                # this thread's S[row_class + R·i, first_col + m] sits at base + R·i·Dv + m
                base = uint64(((slot * num_v_heads + h) * KD + row_class) * VD + first_col)
                loaded = pre and item == cuda.blockIdx.x
                if t == start and not loaded:  # the head's first token: its state into registers, ahead of the conv
                    state_rows(ssm_state, base, state, row_class, first_col, False)
                # conv + SiLU of the channels this head reads
                if DECODE:
                    if not loaded:    # a later item of a grid-strided block (the simulator's capped grids)
                        decode_prefetch(conv_weight, conv_state, norm_weight, slot, first_pos, h, hk, k_base,
                                        v_base, wts, hist, nw)
                    a_t = a[t, h]
                    b_t = b[t, h]
                    if EARLY_GATES:       # the token's decay and write strength while the conv runs
                        decay, beta = token_decay_beta(a_t, b_t, pre_a_log if kept else a_log[h],
                                                       pre_dt_bias if kept else dt_bias[h])
                    for r in range(OUT_ROUNDS):
                        if r * NT + tid < VD:
                            zin[r] = z[t, h * VD + r * NT + tid]
                    for r in range(CONV_ROUNDS):
                        c = r * NT + tid
                        if c < CONV_CHANNELS:
                            ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                            xin[r] = x[t, ch]
                            acc = float32(0.0)   # conv_silu's sum, in its order: the older inputs, then x
                            for k in range(TAPS - 1):
                                acc += bf16_to_f32(wts[r * TAPS + k]) * bf16_to_f32(hist[r * TAPS + k])
                            acc += bf16_to_f32(wts[r * TAPS + TAPS - 1]) * bf16_to_f32(xin[r])
                            val = bf16_to_f32(conv_output(acc))
                            if c < 2 * KD:
                                qk_s[uint64(c)] = val
                            else:
                                v_s[uint64(c - 2 * KD)] = val
                    if RELEASE_AFTER_LOADS:
                        launch_dependents()     # every load that waited for in_proj has arrived
                else:
                    for c0 in range(0, CONV_CHANNELS, NT):
                        c = c0 + tid
                        if c < CONV_CHANNELS:
                            ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                            val = bf16_to_f32(conv_silu(x, conv_weight, conv_state, slot, ch, start, t - start,
                                                        first_pos))
                            if c < 2 * KD:
                                qk_s[uint64(c)] = val
                            else:
                                v_s[uint64(c - 2 * KD)] = val
                    a_t = a[t, h]
                    b_t = b[t, h]
                cuda.syncthreads()
                # l2 norms (every warp, as gated_delta_recurrent_kernel), decay, write strength
                ssq = float32(0.0)
                ssk = float32(0.0)
                for d0 in range(0, KD, WARP):
                    if d0 + lane < KD:
                        qv = qk_s[uint64(d0 + lane)]
                        kv = qk_s[uint64(KD + d0 + lane)]
                        ssq += qv * qv
                        ssk += kv * kv
                if EARLY_GATES:
                    q_mul, k_mul = token_qk_scales(ssq, ssk, q_scale)
                else:
                    q_mul, k_mul, decay, beta = token_gates(ssq, ssk, q_scale, a_t, b_t, a_log[h], dt_bias[h])

                # pass 1: this thread's part of kv_mem = (S·decay)ᵀ k̂ (expressions as in the recurrent kernel).  Rows
                # outermost: each k̂_d is read once for all of the thread's columns (summed in row order per column).
                for m in range(TPT):
                    col_acc[m] = float32(0.0)
                for i in range(ROWS):
                    if ALL_ROWS or row_class + R * i < KD:
                        k_d = qk_s[u_row + uint64(KD + R * i)] * k_mul
                        for m in range(TPT):
                            if ALL_COLS or first_col + m < VD:
                                col_acc[m] += state[m * ROWS + i] * decay * k_d
                store_cols(partial_kv, u_row * uint64(VD) + u_col, col_acc, first_col)
                cuda.syncthreads()

                # pass 2: S = S·decay + k̂ ⊗ delta and this thread's part of Sᵀq̂.  ``opaque``: the recurrent
                # kernel reloads S here, so its S·decay is a product of its own, contracted with the add
                # (fma(S, decay, k̂·delta)); merged with pass 1's S·decay it would be rounded first instead.
                for m in range(TPT):
                    col_delta[m] = float32(0.0)
                    col_v[m] = float32(0.0)
                for w in range(R):              # kv_mem of each column: the row classes' parts, in order
                    add_cols(partial_kv, uint64(w * VD) + u_col, col_delta, first_col)
                load_cols(v_s, u_col, col_v, first_col)
                for m in range(TPT):
                    col_delta[m] = (col_v[m] - col_delta[m]) * beta
                    col_acc[m] = float32(0.0)
                for i in range(ROWS):
                    if ALL_ROWS or row_class + R * i < KD:
                        k_d = qk_s[u_row + uint64(KD + R * i)] * k_mul
                        q_d = qk_s[u_row + uint64(R * i)] * q_mul
                        for m in range(TPT):
                            if ALL_COLS or first_col + m < VD:
                                s_new = opaque(state[m * ROWS + i]) * decay + k_d * col_delta[m]
                                state[m * ROWS + i] = s_new
                                col_acc[m] += s_new * q_d
                store_cols(partial_out, u_row * uint64(VD) + u_col, col_acc, first_col)
                cuda.syncthreads()
                for j0 in range(0, VD, NT):
                    if j0 + tid < VD:
                        j = uint64(j0) + u_tid
                        o = float32(0.0)
                        for w in range(R):
                            o += partial_out[uint64(w * VD) + j]
                        o_s[j] = bf16_to_f32(f32_to_bf16(o))
                cuda.syncthreads()

                # gated RMSNorm of the head's Dv outputs (every warp reduces them as gated_rms_norm_kernel)
                ss = float32(0.0)
                for i0 in range(0, VD, WARP):
                    if i0 + lane < VD:
                        ov = o_s[uint64(i0 + lane)]
                        ss += ov * ov
                inv_rms = inverse_rms(warp_sum(ss), VD, eps)
                for r in range(OUT_ROUNDS):
                    j = r * NT + tid
                    if j < VD:
                        col = h * VD + j
                        if DECODE:
                            out[t, col] = gated_norm_value(o_s[uint64(j)], inv_rms, nw[r], zin[r])
                        else:
                            out[t, col] = gated_norm_value(o_s[uint64(j)], inv_rms, norm_weight[j], z[t, col])
                if RELEASE_AFTER_OUTPUTS:
                    launch_dependents()         # only the state write-back is left
                if STAMPS and t_ready == uint64(0):
                    t_ready = global_timer()

                if t == start + n - 1:  # the head's last token: its state back
                    state_rows(ssm_state, base, state, row_class, first_col, True)
            cuda.syncthreads()  # every read of the slot's old ring entries by this block is done
            if DECODE:          # the token's inputs, still in registers, at entry position % K
                for r in range(CONV_ROUNDS):
                    c = r * NT + tid
                    if c < CONV_CHANNELS:
                        ch = _head_channel(c, hk, first_head, KD, VD, k_base, v_base)
                        conv_state[slot, ch, first_pos % TAPS] = xin[r]
            else:
                for c in range(tid, 2 * KD + heads * VD, NT):
                    ch = _head_channel(c, hk, first_head, KD, VD, k_base, v_base)
                    conv_ring_store(x, conv_state, slot, ch, start, n, first_pos)
        if STAMPS and tid == 0:
            t_wait = t_wait if t_wait != uint64(0) else t_entry
            timeline.record(stamp_buf, 6, t_entry, t_wait, t_ready if t_ready != uint64(0) else t_wait, 0)

    return gated_delta_decode_step_kernel


DECODE_STEP_RELEASES = ("start", "loads", "outputs")
# (Sessions 17-18 also read and wrote the state with an L2 ``evict_last`` policy, so that a layer's 2 MB might
# still be in L2 when the next step reads it: +2.15 % Qwen3.5-4B TPOT on the H200 (``benchmarks/RESULTS.md``).
# Removed.)

DECODE_STEP_RELEASE = os.environ.get("PEGAINFER_GDN_RELEASE", "loads")
"""Where a block of the decode step lets the next kernel (out_proj) launch (PDL): at its ``start``, once the loads
that wait for in_proj have arrived (``loads``, the default), or once its outputs are written (``outputs``: only the
state write-back left).  The next kernel is the preloaded out_proj (``linear.linear_preloaded``): its 21 MB of
weight copies share HBM with whatever loads of this kernel are still in flight, so they should start once this
kernel's dependent loads are done.  Measured on the H200 (Qwen3.5-4B, alternating in one call,
``benchmarks/RESULTS.md`` session 12): TPOT 2.780 ms at the start, 2.758 after the loads, 2.776 after the outputs.
(Before the preload, the start and after the last load measured the same: 2.909 vs 2.921 ms.)  Session 19's
``graph_sweep.py`` had the start +1.22 % in the decode graph."""

DECODE_EARLY_GATES = True
"""Whether the decode step keeps its first item's sequence, slot, position and head from before the PDL wait,
reads ``A_log`` / ``dt_bias`` there too, and computes the token's decay and write strength before the conv's barrier
(``_decode_step_kernel(early_gates=)``): no recomputation or parameter loads after the wait, the same bits (GPU
test at Qwen3.5-4B shapes).  Measured on the H200 (session 18, ``benchmarks/graph_sweep.py``, Qwen3.5-4B decode
graph at context 48, two pairs alternating over 8 rounds): −0.38 % and −0.35 %.  The sm_90 build takes 122
registers instead of 114, no spills."""

DECODE_TILES_PER_THREAD = 2
"""32-column tiles of the state per thread in ``gated_delta_decode_step``.  With Qwen3.5's 128 × 128 heads and
``RULE_WARPS`` = 8: blocks of 512 threads, each holding 16 rows × 2 columns = 32 state values (127 registers, no
spills for sm_90).  Measured on the H200 (session 13, Qwen3.5-4B TPOT, two alternating rounds each): 4 tiles (256
threads, 64 values, 165 registers) 2.605 / 2.607 ms, 2 tiles 2.594 / 2.594, 1 tile (1024 threads, 64 registers,
246 bytes of spills) 2.626 / 2.626.  One tile also failed the GPU bit-identity check against the three-kernel path
(same session; the cause was not looked into: a different FMA contraction is one candidate), so the GPU tests
cover 2 and 4 tiles only.  Session 14 made each thread's columns consecutive, moved by one 8-byte access per state
row (``VEC``): TPOT 2.548 against 2.549 ms with the 4-byte accesses (equal; kept: fewer instructions, and the GPU
tests pass bit-identical).  Session 15 capped the step at 88 registers (no spills), so that the preloaded
out_proj's blocks fit beside its 512-thread blocks and all start their copies at once: 2.552 vs 2.552 ms, dropped.
Session 16 moved the gated norm into out_proj's prologue and split each head's 128 columns over 1, 2 or 4 blocks
(32 → 128 blocks at batch 1, each block's columns a compile-time slice, bit-identical at 2 tiles): TPOT 2.627
(1 block), 2.633 (2), 2.621 (4) against 2.555 ms with the norm here; the split itself is worth only ~0.25 µs a
layer, the moved norm costs ~3 µs (``linear.linear_preloaded``'s docstring).  One tile per thread failed the GPU
bit-identity check again (2 blocks × 1 tile and 4 blocks), as in session 13; still not looked into."""


def gated_delta_decode_step(x, conv_weight, conv_state, z, a, b, a_log, dt_bias, norm_weight, eps: float,
                            ssm_state, slot_ids, token_offsets, positions, out, row_groups: int = RULE_WARPS,
                            tiles_per_thread: int | None = None, decode_token_slots=None, *, policy=None) -> None:
    """The whole Gated DeltaNet step between in_proj and out_proj for a decode batch, in one launch:
    ``out = RMSNormGated(rule(silu(conv(x))), z)``, updating ``conv_state`` and ``ssm_state`` of ``slot_ids``.

    Shapes as in ``gated_delta_decode_step_kernel``, except ``ssm_state`` ``[slots, Hv, Dk, Dv]`` (contiguous).
    Bit-identical to ``causal_conv1d_silu`` → ``gated_delta_recurrent(warps=row_groups)`` → ``gated_rms_norm``
    (``row_groups`` is a test knob: keep the default, the recurrent kernel's own).  ``tiles_per_thread``: 32-column
    tiles of the state per thread (default: ``DECODE_TILES_PER_THREAD``, read at the call).  Meant for one token per
    sequence; longer sequences are exact but run one block per key head.

    ``decode_token_slots`` (``[tokens]`` int32, the step's per-token slots as the host wrote them): the batch is a
    decode step -- one token per sequence, sequence ``b`` = token ``b``, padding tokens (slot -1) last -- and the
    kernel reads each block's state before waiting for the projection (launched with PDL as
    ``gated_delta_decode_step``)."""
    _check_rule_args(x, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    for arr, ndim in ((conv_weight, 2), (conv_state, 3), (z, 2), (norm_weight, 1)):
        _check_bf16(arr, ndim)
    channels, taps = conv_weight.shape
    num_tokens = x.shape[0]
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    assert x.shape[1] == channels and conv_state.shape[1:] == (channels, taps), (x.shape, conv_state.shape,
                                                                               conv_weight.shape)
    assert conv_state.shape[0] == ssm_state.shape[0], (conv_state.shape, ssm_state.shape)
    assert z.shape == out.shape and norm_weight.shape == (value_dim,), (z.shape, out.shape, norm_weight.shape)
    assert ssm_state.is_c_contiguous(), "the kernel reads the state as one flat array"
    _check_positions(positions, num_tokens)
    if tiles_per_thread is None:
        tiles_per_thread = DECODE_TILES_PER_THREAD
    tiles = -(-value_dim // COL_TILE)
    warps = row_groups * -(-tiles // tiles_per_thread)
    assert 1 <= row_groups and 1 <= tiles_per_thread and warps <= MAX_WARPS, (row_groups, tiles_per_thread)
    if num_tokens == 0:
        return
    decode = decode_token_slots is not None
    if decode:
        assert decode_token_slots.dtype == np.int32 and decode_token_slots.shape == (num_tokens,)
        assert slot_ids.shape[0] == num_tokens, "a decode step has one sequence per token"
    if DECODE_STEP_RELEASE not in DECODE_STEP_RELEASES:
        raise PegainferError(f"PEGAINFER_GDN_RELEASE={DECODE_STEP_RELEASE!r} is not one of {DECODE_STEP_RELEASES}: "
                             "unset it or pick one of those")
    launch(_decode_step_kernel(key_dim, value_dim, row_groups, tiles_per_thread, decode, taps, DECODE_STEP_RELEASE,
                               DECODE_EARLY_GATES, timeline.ENABLED),
           grid(max(1, slot_ids.shape[0] * num_v_heads), sim_cap=8), warps * WARP, x, conv_weight, conv_state, z,
           a, b, a_log, dt_bias, norm_weight, np.float32(eps), ssm_state.reshape(ssm_state.size), slot_ids,
           token_offsets, positions, decode_token_slots if decode else slot_ids, out, timeline.stamps_arg(),
           name="gated_delta_decode_step" if decode else None, pdl=True)


# ------------------------------------------------------------------------------------------------ state slots
@kernel
def clear_state_slots_kernel(conv_state, ssm_state, slot_ids):
    """Zero ``conv_state[s]`` ``[slots, conv_dim, K]`` (bf16) and ``ssm_state[s]`` ``[slots, Hv, Dk, Dv]`` (f32)
    for every ``s`` in ``slot_ids [B]``: a new sequence starts from an empty state.  Geometry: grid-stride over
    every element of the cleared slots (flattened per slot)."""
    pdl_prologue()
    conv_per_slot = conv_state.shape[1] * conv_state.shape[2]
    ssm_per_slot = ssm_state.shape[1] * ssm_state.shape[2] * ssm_state.shape[3]
    per_slot = conv_per_slot + ssm_per_slot
    plane = ssm_state.shape[2] * ssm_state.shape[3]
    for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, slot_ids.shape[0] * per_slot,
                     cuda.gridDim.x * cuda.blockDim.x):
        slot = slot_ids[idx // per_slot]
        r = idx % per_slot
        if r < conv_per_slot:
            conv_state[slot, r // conv_state.shape[2], r % conv_state.shape[2]] = 0
        else:
            r -= conv_per_slot
            ssm_state[slot, r // plane, (r % plane) // ssm_state.shape[3], r % ssm_state.shape[3]] = float32(0.0)


def clear_state_slots(conv_state, ssm_state, slot_ids, *, policy=None) -> None:
    """Reset the recurrent state of the slots in ``slot_ids`` (``[B]`` int32 device array) to zeros."""
    _check_bf16(conv_state, 3)
    assert ssm_state.ndim == 4 and ssm_state.dtype == np.float32, (ssm_state.shape, ssm_state.dtype)
    assert conv_state.shape[0] == ssm_state.shape[0], (conv_state.shape, ssm_state.shape)
    assert slot_ids.ndim == 1 and slot_ids.dtype == np.int32, (slot_ids.shape, slot_ids.dtype)
    per_slot = conv_state.shape[1] * conv_state.shape[2] + int(np.prod(ssm_state.shape[1:]))
    total = slot_ids.shape[0] * per_slot
    if total == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(clear_state_slots_kernel, grid(total, per_block=block * 4, sim_cap=4), block, conv_state, ssm_state,
           slot_ids, pdl=True)


@kernel
def sequence_table_kernel(token_slots, seq_slots, seq_offsets):
    """The per-sequence table the kernels above take, built from the runner's per-token slots.

    A step's tokens come in runs, one per sequence: a sequence's tokens are consecutive and no two sequences of a
    step share a slot.  So run ``r`` (a maximal stretch of equal ``token_slots``) is sequence ``r``.  Padding
    tokens (slot < 0: a prefill chunk padded to a CUDA-graph bucket) come after every real token; the first of
    them ends the table, so no kernel above reads them or lets them touch any state.
    token_slots ``[T]``; seq_slots ``[S]``, seq_offsets ``[S+1]`` int32 with ``S`` ≥ the number of runs:
    ``seq_offsets[r]`` = first token of run ``r``, ``seq_slots[r]`` = its slot; entries after the last run are
    empty sequences (offset = end of the real tokens, slot 0), which every kernel above skips.

    Geometry: one block (barriers order the padding search, the fill and the writes), block-stride over tokens;
    the end of the real tokens is a shared-memory ``atomic.min`` over the padding tokens; a run's first token finds
    its run index by counting the run starts before it (O(T) each: T is one step's tokens).
    """
    pdl_prologue()
    num_tokens = token_slots.shape[0]
    real_end = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        real_end[0] = int32(num_tokens)
    cuda.syncthreads()
    for t in range(cuda.threadIdx.x, num_tokens, cuda.blockDim.x):
        if token_slots[t] < 0:
            cuda.atomic.min(real_end, 0, int32(t))
    cuda.syncthreads()
    end = real_end[0]
    for r in range(cuda.threadIdx.x, seq_slots.shape[0] + 1, cuda.blockDim.x):
        seq_offsets[r] = end
        if r < seq_slots.shape[0]:
            seq_slots[r] = 0
    cuda.syncthreads()
    for t in range(cuda.threadIdx.x, end, cuda.blockDim.x):
        if t == 0 or token_slots[t] != token_slots[t - 1]:
            run = 0
            for u in range(1, t + 1):
                if token_slots[u] != token_slots[u - 1]:
                    run += 1
            if run < seq_slots.shape[0]:
                seq_offsets[run] = t
                seq_slots[run] = token_slots[t]


def sequence_table(token_slots, seq_slots, seq_offsets, *, policy=None) -> None:
    """Fill ``seq_slots [S]`` / ``seq_offsets [S+1]`` (int32 device arrays) from ``token_slots [T]``: one sequence
    per run of equal slots up to the first padding token (slot < 0), then empty sequences.  ``S`` must be ≥ the
    number of sequences in the step."""
    for arr in (token_slots, seq_slots, seq_offsets):
        assert arr.ndim == 1 and arr.dtype == np.int32, (arr.shape, arr.dtype)
    assert seq_offsets.shape[0] == seq_slots.shape[0] + 1, (seq_slots.shape, seq_offsets.shape)
    launch(sequence_table_kernel, 1, threads(gpu=256, sim=32), token_slots, seq_slots, seq_offsets, pdl=True)


# ------------------------------------------------------------------------------------------------ argument checks
def _check_bf16(arr, ndim):
    assert arr.ndim == ndim and arr.dtype == np.uint16, (arr.shape, arr.dtype, "expected bf16 bits", ndim)


def _check_positions(positions, num_tokens):
    assert positions.ndim == 1 and positions.dtype == np.int32 and positions.shape[0] >= num_tokens, \
        (positions.shape, positions.dtype, num_tokens)


def _check_sequences(slot_ids, token_offsets):
    assert slot_ids.ndim == 1 and slot_ids.dtype == np.int32, (slot_ids.shape, slot_ids.dtype)
    assert token_offsets.ndim == 1 and token_offsets.dtype == np.int32, (token_offsets.shape, token_offsets.dtype)
    assert token_offsets.shape[0] == slot_ids.shape[0] + 1, (token_offsets.shape, slot_ids.shape)


def _num_k_heads(qkv, ssm_state):
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    return (qkv.shape[1] - num_v_heads * value_dim) // (2 * key_dim)


def _check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out):
    _check_bf16(qkv, 2)
    _check_bf16(a, 2)
    _check_bf16(b, 2)
    _check_bf16(out, 2)
    assert ssm_state.ndim == 4 and ssm_state.dtype == np.float32, (ssm_state.shape, ssm_state.dtype)
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    num_k_heads = _num_k_heads(qkv, ssm_state)
    assert num_k_heads >= 1 and qkv.shape[1] == 2 * num_k_heads * key_dim + num_v_heads * value_dim, \
        (qkv.shape, ssm_state.shape)
    assert num_v_heads % num_k_heads == 0, (num_v_heads, num_k_heads)
    assert key_dim <= MAX_KEY_DIM and key_dim % 2 == 0, f"key head dim {key_dim}: even and ≤ {MAX_KEY_DIM}"
    num_tokens = qkv.shape[0]
    assert a.shape == (num_tokens, num_v_heads) and b.shape == a.shape, (a.shape, b.shape, num_tokens)
    for p in (a_log, dt_bias):
        assert p.shape == (num_v_heads,) and p.dtype == np.float32, (p.shape, p.dtype)
    assert out.shape == (num_tokens, num_v_heads * value_dim), (out.shape, num_tokens)
    _check_sequences(slot_ids, token_offsets)
