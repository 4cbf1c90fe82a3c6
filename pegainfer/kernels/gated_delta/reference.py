"""The gated delta rule token by token: the family's reference kernel.

Each value head ``h`` keeps a state ``S[h]`` of shape ``[Dk, Dv]`` (f32) and reads key head ``hk = h // (Hv/Hk)``
(grouped like GQA, HF's ``repeat_interleave``).  For each token ``t`` of a sequence, in order (HF
``torch_recurrent_gated_delta_rule`` with ``use_qk_l2norm_in_kernel``)::

    q̂      = q[t, hk] / sqrt(Σ q[t, hk]² + 1e-6) / sqrt(Dk)        l2norm, scaled         [Dk]
    k̂      = k[t, hk] / sqrt(Σ k[t, hk]² + 1e-6)                                            [Dk]
    g      = −exp(A_log[h]) · softplus(a[t, h] + dt_bias[h])         log decay (f32)
    beta   = bf16(sigmoid(b[t, h]))                                  write strength
    S      = S · exp(g)                                              forget
    kv_mem = Sᵀ k̂                                                    what S returns for k̂   [Dv]
    delta  = (v[t, h] − kv_mem) · beta                               correction towards v    [Dv]
    S      = S + k̂ ⊗ delta                                          write it
    out[t, h] = bf16(Sᵀ q̂)                                          read                    [Dv]

Everything runs in f32; ``beta`` and ``out`` are the only bf16 roundings (and, for a state kept as bf16 bits,
``S`` after each token: ``common.state_codec``).  The tuned kernels compute the same rule:
``chunked_mma.gated_delta_chunked`` for prompts (on tensor cores, in chunks: a different, equivalent order of sums,
close, not bit-equal) and ``decode_step.gated_delta_decode_step`` (bit-identical to this kernel run with
``warps = row_groups``).
"""
from __future__ import annotations

import functools

from pegainfer.kernels.gated_delta.common import (COL_TILE, MAX_WARPS, check_rule_args, state_codec, state_is_bf16,
                                                  token_gates, zero_rows_from)
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import WARP, bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, math, threads

RULE_WARPS = threads(gpu=256, sim=32) // WARP
"""Warps per block of the reference: warp ``w`` sums key rows ``d ≡ w (mod RULE_WARPS)``, so this sets the f32
summation order of ``Sᵀk̂`` and ``Sᵀq̂``, which ``gated_delta_decode_step`` reproduces (its ``row_groups``)."""


@functools.cache
def recurrent_kernel(state_bf16: bool):
    """``gated_delta_recurrent_kernel`` for a state of f32 or (``state_bf16``) bf16 bits."""
    load_state, store_state = state_codec(state_bf16)

    @kernel
    def gated_delta_recurrent_kernel(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out):
        """The gated delta rule (module docstring), one token after another, for a batch of sequences.

        qkv ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (the conv's output: q ``[tokens, Hk, Dk]`` | k ``[tokens, Hk, Dk]``
        | v ``[tokens, Hv, Dv]``), a, b ``[tokens, Hv]`` bf16, a_log, dt_bias ``[Hv]`` f32, ssm_state ``[slots, Hv,
        Dk, Dv]`` f32 or bf16 bits (updated in place), slot_ids ``[B]``, token_offsets ``[B+1]`` int32 (sequence
        ``s`` owns tokens ``token_offsets[s] : token_offsets[s+1]`` and state ``ssm_state[slot_ids[s]]``), out
        ``[tokens, Hv·Dv]`` bf16.  Rows of ``out`` of padding tokens (after the last sequence,
        ``token_offsets[B]:``, and those of a padding sequence, slot -1) are set to zero.

        Geometry: one block per (sequence, value head, tile of 32 value columns), grid-strided.  Lane ``l`` owns
        column ``j = tile·32 + l``; warp ``w`` of ``W`` owns key rows ``w, w+W, …``.  Each warp computes the l2
        norms itself (a warp reduction).  The column sums over key rows (``Sᵀk̂``, ``Sᵀq̂``) are per-thread partial
        sums over the warp's rows, then summed over the warps in order through shared memory: two barriers per
        token.
        """
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
            if slot < 0:  # a padding sequence (``state.sequence_table``): zero rows, no state (block-uniform)
                if warp == 0 and has_col:
                    for t in range(token_offsets[seq], token_offsets[seq + 1]):
                        out[t, h * value_dim + j] = 0
                continue
            for t in range(token_offsets[seq], token_offsets[seq + 1]):
                # q̂ = q·q_mul, k̂ = k·k_mul; decay = exp(g); beta
                ssq = float32(0.0)
                ssk = float32(0.0)
                for d in range(lane, key_dim, WARP):
                    qv = bf16_to_f32(qkv[t, q_off + d])
                    kv = bf16_to_f32(qkv[t, k_off + d])
                    ssq += qv * qv
                    ssk += kv * kv
                q_mul, k_mul, decay, beta = token_gates(ssq, ssk, q_scale, a[t, h], b[t, h], a_log[h], dt_bias[h])

                # kv_mem = (S·decay)ᵀ k̂
                acc = float32(0.0)
                if has_col:
                    for d in range(warp, key_dim, num_warps):
                        acc += load_state(ssm_state[slot, h, d, j]) * decay * \
                            (bf16_to_f32(qkv[t, k_off + d]) * k_mul)
                partial_kv[warp, lane] = acc
                cuda.syncthreads()
                kv_mem = float32(0.0)
                for w in range(num_warps):
                    kv_mem += partial_kv[w, lane]
                # delta = (v − kv_mem)·beta
                delta = float32(0.0)
                if has_col:
                    delta = (bf16_to_f32(qkv[t, v_base + h * value_dim + j]) - kv_mem) * beta

                # S = S·decay + k̂ ⊗ delta, and out = bf16(Sᵀ q̂) from the new S
                acc = float32(0.0)
                if has_col:
                    for d in range(warp, key_dim, num_warps):
                        s = load_state(ssm_state[slot, h, d, j]) * decay + \
                            (bf16_to_f32(qkv[t, k_off + d]) * k_mul) * delta
                        ssm_state[slot, h, d, j] = store_state(s)      # (rounded as stored: bf16 bits)
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

    return gated_delta_recurrent_kernel


def reference_gated_delta(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out,
                          warps: int = RULE_WARPS) -> None:
    """The gated delta rule token by token (``gated_delta_recurrent_kernel``): updates ``ssm_state[slot_ids]`` in
    place and writes ``out [T, Hv·Dv]``.  ``warps`` per block sets how the column sums over key rows are split
    (``RULE_WARPS``; tests of ``gated_delta_decode_step``'s ``row_groups`` pass others)."""
    check_rule_args(qkv, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    assert 1 <= warps <= MAX_WARPS, warps
    if qkv.shape[0] == 0 or slot_ids.shape[0] == 0:
        return
    items = slot_ids.shape[0] * ssm_state.shape[1] * (-(-ssm_state.shape[3] // COL_TILE))
    launch(recurrent_kernel(state_is_bf16(ssm_state)), grid(items, sim_cap=8), warps * WARP, qkv, a, b, a_log,
           dt_bias, ssm_state, slot_ids, token_offsets, out)
