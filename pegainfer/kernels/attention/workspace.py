"""The split-K workspace: one f32 device array the caller allocates once (``attention_workspace_size``), holding the
splits' partial results and, at its very end, the int32 counters that tell the last block of a (token, kv head)
to merge them.

Layout for a launch of ``T`` tokens, ``nq`` q heads, ``S`` splits and heads of ``D`` dims (row ``r = (t·nq + h)·S +
split``)::

    acc [T·nq·S·D]  f32   unnormalised P V of each split
    m   [T·nq·S]    f32   its running max (log2 units)
    l   [T·nq·S]    f32   its sum of exp2(score - m)
    ... counters [T·nkv] int32 at the end of the array, zero at rest (the merging block resets its own)

Nothing allocates per call: a workspace object seen for the first time has its counters zeroed once (one small
launch); afterwards the kernel keeps them at zero, so a captured CUDA graph replays without a reset.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from pegainfer.kernels.attention.geometry import attention_num_splits
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.split_counters import zeroed_counters


def workspace_parts(num_tokens: int, nq: int, head_dim: int, num_splits: int) -> tuple[int, int]:
    """(acc elements, m elements) of the workspace for one launch; l follows m.  One split uses none."""
    if num_splits <= 1:
        return 0, 0
    rows = num_tokens * nq * num_splits
    return rows * head_dim, rows


def attention_workspace_size(max_tokens: int, nq: int, head_dim: int, max_model_len: int, *, nkv: int,
                             num_splits: int | None = None) -> int:
    """f32 elements of the workspace ``paged_attention`` needs for any ``T <= max_tokens`` over ``nq`` q heads in
    ``nkv`` groups (``num_splits``: the forced value if the caller forces one): the split partials at the front and
    ``max_tokens * nq`` int32 counters at the very end (more than the ``T * nkv`` a launch uses)."""
    need = 0
    for t in range(1, max_tokens + 1):
        s = num_splits if num_splits is not None else attention_num_splits(t, nkv, max_model_len, head_dim)
        a, mm = workspace_parts(t, nq, head_dim, s)
        need = max(need, a + 2 * mm)
    return need + max_tokens * nq


def split_workspace(workspace, num_tokens: int, nq: int, nkv: int, head_dim: int, num_splits: int,
                    policy: LaunchPolicy):
    """(acc, m, l, counters): the flat views of ``workspace`` a split-K launch of ``num_splits`` splits uses (module
    docstring).  With one split the kernel touches none of them: stand-ins, and the workspace may be None."""
    n_acc, n_m = workspace_parts(num_tokens, nq, head_dim, num_splits)
    if num_splits <= 1:
        ws = flat(workspace) if workspace is not None else _dummy_f32()
        return ws, ws, ws, ws.view(np.int32)
    need = n_acc + 2 * n_m + num_tokens * nq
    if workspace is None or workspace.dtype != np.float32 or workspace.size < need:
        raise ValueError(f"workspace must be f32 with >= {need} elements (attention_workspace_size); "
                         f"got {None if workspace is None else workspace.size}")
    ws = flat(workspace)
    return (ws[:n_acc], ws[n_acc:n_acc + n_m], ws[n_acc + n_m:n_acc + 2 * n_m],
            _split_counters(workspace, num_tokens * nkv, policy))


def _split_counters(workspace, count: int, policy: LaunchPolicy):
    """The int32 view of ``workspace`` whose last ``count`` entries are the split-merge counters (zeroed once:
    ``split_counters.zeroed_counters``)."""
    return zeroed_counters(workspace, count, policy, "attention_zero_counters")


@functools.lru_cache(maxsize=None)
def _dummy_f32():
    """A 1-element device array standing in for an absent workspace (allocated once, on the first such call: pass a
    workspace when capturing a CUDA graph)."""
    return cuda.device_array(1, dtype=np.float32)


def flat(a):
    return a.reshape(-1)


def flat_u32(a):
    return a.view(np.uint32).reshape(-1)
