"""Arrival counters of split-K kernels: int32 counters at the very end of a caller's f32 workspace, zero at rest.

A split-K launch has several blocks work on one output tile; each publishes its partial result in the workspace and
bumps the tile's counter, and the block that finds itself last merges the partials and puts the counter back to 0
(attention's ``merge.merge_splits``, the linear GEMM's ``splitk.finish_tile``).  So after the first zeroing the
counters are zero whenever no launch runs, and a launch replays from a CUDA graph with no reset.

``zeroed_counters`` zeroes them the first time a workspace object is seen (or when a launch needs more of them than
were zeroed so far): one small launch outside the steady state, never one per call.
"""
from __future__ import annotations

import weakref

import numpy as np
from numba import cuda

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import grid, kernel, pdl_prologue, threads


@kernel
def fill_i32_kernel(a, value):
    """``a[:] = value`` (int32), grid-stride."""
    pdl_prologue()
    for i in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        a[i] = value


_zeroed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def zeroed_counters(workspace, count: int, policy: LaunchPolicy, name: str):
    """The int32 view of the f32 ``workspace`` (flat) whose last ``count`` entries are split-K counters; zeroes
    them (a launch called ``name``) the first time this workspace object is seen, or when a call needs more."""
    ws32 = workspace.reshape(-1).view(np.int32)
    try:
        done = _zeroed.get(workspace, 0)
    except TypeError:   # not weak-referenceable: zero every time (correct, one extra launch)
        done = 0
    if done < count:
        tail = ws32[ws32.shape[0] - count:]
        launch(fill_i32_kernel, grid(count, 256, sim_cap=4), threads(gpu=256, sim=32), tail, np.int32(0),
               name=name, policy=policy)
        try:
            _zeroed[workspace] = count
        except TypeError:
            pass
    return ws32
