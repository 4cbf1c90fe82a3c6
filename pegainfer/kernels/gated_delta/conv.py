"""The causal depthwise conv1d + SiLU in front of the delta rule, for prompts (a thread per channel and run of
tokens), and the device functions the fused decode step shares with it.

For token ``t`` of a sequence and channel ``c`` of ``x [tokens, channels]`` (in_proj_qkv's output: the q, k and v
channels), with kernel size ``K`` (4 in Qwen3.5) and HF's two bf16 roundings::

    out[t, c] = bf16(silu(bf16(Σ_k weight[c, k] · input[t − (K−1) + k, c])))

**Positions and the conv ring.**  The conv state of a slot, ``conv_state [slots, channels, K]`` bf16, is a ring of
the inputs by position: entry ``p % K`` holds the input at position ``p`` (the last K-1 of them are the ones still
needed).  The kernels take ``positions [tokens]`` int32 (the engine's: a token's index in its sequence).  The token
at position ``p`` reads its K-1 predecessors at entries ``(p-K+1) % K .. (p-1) % K`` (or from ``x`` when they are
in the same step; positions < 0 read as zero, HF's left padding), and a step leaves each of its last K-1 inputs at
entry ``p % K``.  A one-token step therefore writes an entry that no reader of that step touches, which is what
lets two blocks of the fused decode step (two value heads sharing a key head, hence the same q/k channels) update
the same channels' ring with no ordering between them: both write the same value to the same entry.  (A shift
register, oldest first, would be overwritten under the other block's feet.)
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.gated_delta.common import check_bf16, check_positions, check_sequences, silu
from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (bf16_to_f32, cuda, device_fn, f32_to_bf16, float32, grid, kernel,
                                          pdl_prologue, threads)


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
    fewer tokens than that, the older entries stay as they are).  Rows of ``out`` of padding tokens (after the last
    sequence, or a padding sequence of slot -1) are not written.

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
        if slot < 0:
            continue  # a padding sequence (``state.sequence_table``): no state, its rows not written
        first_pos = positions[start]
        for t in range(first, min(first + tokens_per_thread, n)):
            out[start + t, c] = conv_silu(x, weight, conv_state, slot, c, start, t, first_pos)
        if piece == 0:
            conv_ring_store(x, conv_state, slot, c, start, n, first_pos)


def causal_conv1d_silu(x, weight, conv_state, slot_ids, token_offsets, positions, out,
                       max_seq_tokens: int | None = None, tokens_per_thread: int = 8, *,
                       policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = silu(causal_conv1d(x))`` per sequence, continuing from and updating the ring ``conv_state[slot_ids]``.

    x, out ``[T, C]`` bf16 bits; weight ``[C, K]`` bf16; conv_state ``[slots, C, K]`` bf16; slot_ids ``[B]``,
    token_offsets ``[B+1]``, positions ``[T]`` int32.  ``max_seq_tokens`` is an upper bound on any sequence's token
    count (sizes the grid only; pass 1 for decode; defaults to T, always safe)."""
    check_bf16(x, 2)
    check_bf16(weight, 2)
    check_bf16(conv_state, 3)
    check_bf16(out, 2)
    channels, taps = weight.shape
    assert x.shape[1] == channels and out.shape == x.shape, (x.shape, out.shape, weight.shape)
    assert conv_state.shape[1:] == (channels, taps), (conv_state.shape, weight.shape)
    check_sequences(slot_ids, token_offsets)
    check_positions(positions, x.shape[0])
    assert tokens_per_thread >= taps - 1, "pieces after the first must not need the old state"
    if x.shape[0] == 0 or slot_ids.shape[0] == 0:
        return
    max_tokens = x.shape[0] if max_seq_tokens is None else max_seq_tokens
    max_pieces = max(1, -(-max_tokens // tokens_per_thread))
    block = threads(gpu=256, sim=32)
    items = slot_ids.shape[0] * max_pieces * channels
    launch(causal_conv1d_silu_kernel, grid(items, per_block=block, sim_cap=2), block, x, weight, conv_state,
           slot_ids, token_offsets, positions, out, np.int32(tokens_per_thread), np.int32(max_pieces),
           policy=policy)
