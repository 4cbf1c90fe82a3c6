"""The per-sequence state slots: clearing a new sequence's slot, copying a slot's state (the prefix cache's
snapshots), and the table of sequences a step's kernels take.

Every kernel of the family takes a batch of sequences laid out as in vLLM/FLA: ``token_offsets [B+1]`` int32
(sequence ``b`` owns tokens ``token_offsets[b] : token_offsets[b+1]`` of the token-major inputs) and ``slot_ids [B]``
int32 (the row of the per-sequence state buffers it reads and updates).  ``sequence_table`` builds both on the device
from the runner's per-token slots, so a step can be captured in a CUDA graph and replayed.  A new sequence's slot
must start from zeros (``clear_state_slots``), as HF starts without a cache.  Padding tokens (slot -1) belong to no
sequence: trailing ones end the table, a run of them between real tokens is a padding sequence (slot -1) that every
kernel skips (``sequence_table_kernel``).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.gated_delta.common import check_bf16, state_is_bf16
from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import cuda, grid, int32, kernel, pdl_prologue, threads


@kernel
def state_slots_kernel(conv_state, ssm_state, src_ids, dst_ids, zero):
    """For each i: ``conv_state[dst_ids[i]]`` ``[conv_dim, K]`` (bf16) and ``ssm_state[dst_ids[i]]`` ``[Hv, Dk, Dv]``
    (f32 or bf16 bits) become zeros (``zero`` = 1: a new sequence starts from an empty state) or a copy of row ``src_ids[i]``
    (``zero`` = 0: a state kept for the prefix cache, or one restored from it).  Geometry: grid-stride over every
    element of the written rows (flattened per row)."""
    pdl_prologue()
    conv_per_slot = conv_state.shape[1] * conv_state.shape[2]
    ssm_per_slot = ssm_state.shape[1] * ssm_state.shape[2] * ssm_state.shape[3]
    per_slot = conv_per_slot + ssm_per_slot
    plane = ssm_state.shape[2] * ssm_state.shape[3]
    for idx in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, dst_ids.shape[0] * per_slot,
                     cuda.gridDim.x * cuda.blockDim.x):
        dst = dst_ids[idx // per_slot]
        src = src_ids[idx // per_slot]
        r = idx % per_slot
        if r < conv_per_slot:
            c, k = r // conv_state.shape[2], r % conv_state.shape[2]
            conv_state[dst, c, k] = 0 if zero else conv_state[src, c, k]
        else:
            r -= conv_per_slot
            h, i, j = r // plane, (r % plane) // ssm_state.shape[3], r % ssm_state.shape[3]
            if zero:
                ssm_state[dst, h, i, j] = 0       # +0.0 as f32 and as bf16 bits
            else:
                ssm_state[dst, h, i, j] = ssm_state[src, h, i, j]


def _state_rows(conv_state, ssm_state, src_ids, dst_ids, zero: int, policy: LaunchPolicy) -> None:
    check_bf16(conv_state, 3)
    assert ssm_state.ndim == 4, ssm_state.shape
    state_is_bf16(ssm_state)
    assert conv_state.shape[0] == ssm_state.shape[0], (conv_state.shape, ssm_state.shape)
    for ids in (src_ids, dst_ids):
        assert ids.ndim == 1 and ids.dtype == np.int32 and ids.shape == dst_ids.shape, (ids.shape, ids.dtype)
    per_slot = conv_state.shape[1] * conv_state.shape[2] + int(np.prod(ssm_state.shape[1:]))
    total = dst_ids.shape[0] * per_slot
    if total == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(state_slots_kernel, grid(total, per_block=block * 4, sim_cap=4), block, conv_state, ssm_state, src_ids,
           dst_ids, np.int32(zero), policy=policy)


def clear_state_slots(conv_state, ssm_state, slot_ids, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Reset the recurrent state of the slots in ``slot_ids`` (``[B]`` int32 device array) to zeros."""
    _state_rows(conv_state, ssm_state, slot_ids, slot_ids, 1, policy)


def copy_state_slots(conv_state, ssm_state, src_ids, dst_ids, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Copy the recurrent state of row ``src_ids[i]`` to row ``dst_ids[i]`` (``[B]`` int32 device arrays, no row in
    both)."""
    _state_rows(conv_state, ssm_state, src_ids, dst_ids, 0, policy)


@kernel
def sequence_table_kernel(token_slots, seq_slots, seq_offsets):
    """The per-sequence table the kernels above take, built from the runner's per-token slots.

    A step's tokens come in runs, one per sequence: a sequence's tokens are consecutive and no two sequences of a
    step share a slot.  So run ``r`` (a maximal stretch of equal ``token_slots``) is sequence ``r``.  Padding tokens
    (slot -1) belong to no sequence: those after the last real token (a prefill chunk padded to a CUDA-graph bucket,
    a mixed step's chunk tokens padded to theirs) end the table, and a run of them between real tokens (a mixed
    step's decode rows padded to a graph batch, before its chunks) is a *padding sequence* with slot -1, which every
    kernel above skips (no state read or written; zero rule outputs).  token_slots ``[T]``; seq_slots ``[S]``,
    seq_offsets ``[S+1]`` int32 with ``S`` ≥ the number of runs up to the last real token: ``seq_offsets[r]`` =
    first token of run ``r``, ``seq_slots[r]`` = its slot; entries after the last run are empty sequences (offset =
    one past the last real token, slot 0), which every kernel above skips.

    Geometry: one block (barriers order the search for the last real token, the fill and the writes), block-stride
    over tokens; the end of the real tokens is a shared-memory ``atomic.max`` over them; a run's first token finds
    its run index by counting the run starts before it (O(T) each: T is one step's tokens).
    """
    pdl_prologue()
    num_tokens = token_slots.shape[0]
    real_end = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        real_end[0] = int32(0)
    cuda.syncthreads()
    for t in range(cuda.threadIdx.x, num_tokens, cuda.blockDim.x):
        if token_slots[t] >= 0:
            cuda.atomic.max(real_end, 0, int32(t + 1))
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


def sequence_table(token_slots, seq_slots, seq_offsets, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Fill ``seq_slots [S]`` / ``seq_offsets [S+1]`` (int32 device arrays) from ``token_slots [T]``: one sequence
    per run of equal slots up to the last real token (a run of padding tokens, slot -1, among them is a padding
    sequence), then empty sequences.  ``S`` must be ≥ the number of those runs."""
    for arr in (token_slots, seq_slots, seq_offsets):
        assert arr.ndim == 1 and arr.dtype == np.int32, (arr.shape, arr.dtype)
    assert seq_offsets.shape[0] == seq_slots.shape[0] + 1, (seq_slots.shape, seq_offsets.shape)
    launch(sequence_table_kernel, 1, threads(gpu=256, sim=32), token_slots, seq_slots, seq_offsets, policy=policy)
