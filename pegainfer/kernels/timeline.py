"""Per-block timestamps of the decode step's kernels: where inside a CUDA graph the time between two kernels goes.

With PDL (``launch.py``) a kernel's blocks start while the kernel before is still running, issue the loads that do
not depend on it, wait (``grid_dependency_wait``), finish a prologue and then do their main work.  A profiler sees
one span per kernel; this records, for every block of every instrumented launch, four moments on the GPU's global
nanosecond clock (``%globaltimer``) and its SM, so ``benchmarks/step_profile.py timeline`` can print how long the
wait for the previous kernel took after that kernel's last block ended, how long the prologue took and how far apart
the blocks of one launch end (the tail).

Off by default (``LaunchPolicy.timeline``): the kernel builders take the policy's flag as a compile-time argument,
so the engine's kernels contain no stamping code, and pass ``stamps_arg(policy)`` as the stamp buffer.  When on,
each instrumented block's thread 0 appends one record to ``buffer()``:

    word 0 of the buffer: the number of records appended (an atomic counter); record r at words ``8 + 8 r``:
    [t_entry, t_wait, t_ready, t_end, kind, block, grid, sm | extra << 8]

``t_entry``: the block's first instruction; ``t_wait``: its ``grid_dependency_wait`` returned; ``t_ready``: its
inputs are staged (the GEMV's x in shared memory, the preloaded rows landed; decode attention: its first work
item's last ``P V`` product done, before the merge; the Gated DeltaNet decode step: its first item's outputs
written; kernels without a prologue repeat ``t_wait``); ``t_end``: its last instruction.  ``kind``: one of ``KINDS``;
``extra``: the GEMV's output columns.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import cuda, device_fn, global_timer, sm_id

CAPACITY = 1 << 16
"""Records the buffer holds; later ones are dropped (a Qwen3-4B decode step appends ~35k)."""

KINDS = {1: "gemv", 2: "gemv_norm", 3: "gemv_preloaded", 4: "qk_norm_rope", 5: "attention", 6: "gdn_step"}
WORDS = 8

_buffer = None


def buffer():
    """The device buffer of records (uint64, allocated once, zeroed; first call outside a graph capture)."""
    global _buffer
    if _buffer is None:
        _buffer = cuda.to_device(np.zeros(WORDS * (CAPACITY + 1), np.uint64))
    return _buffer


def reset() -> None:
    """Forget the records appended so far (host copy of zeros: not inside a graph capture)."""
    buffer().copy_to_device(np.zeros(WORDS * (CAPACITY + 1), np.uint64))


def records() -> np.ndarray:
    """The appended records as a structured array with the fields of the module docstring, in append order."""
    raw = buffer().copy_to_host()
    n = min(int(raw[0]), CAPACITY)
    rec = raw[WORDS:WORDS * (n + 1)].reshape(n, WORDS)
    out = np.zeros(n, dtype=[("t_entry", np.int64), ("t_wait", np.int64), ("t_ready", np.int64),
                             ("t_end", np.int64), ("kind", np.int32), ("block", np.int32), ("grid", np.int32),
                             ("sm", np.int32), ("extra", np.int64)])
    for i, name in enumerate(("t_entry", "t_wait", "t_ready", "t_end", "kind", "block", "grid")):
        out[name] = rec[:, i].astype(np.int64)
    out["sm"] = (rec[:, 7] & np.uint64(0xFF)).astype(np.int32)
    out["extra"] = (rec[:, 7] >> np.uint64(8)).astype(np.int64)
    return out


@functools.cache
def unused():
    """What an instrumented kernel's stamp argument gets when stamping is off (never written)."""
    return cuda.to_device(np.zeros(1, np.uint64))


def stamps_arg(policy: LaunchPolicy):
    """The stamp argument of an instrumented launch: the buffer when ``policy.timeline``, else a one-word
    placeholder (allocate the buffer before a graph capture: ``buffer()``)."""
    return buffer() if policy.timeline else unused()


@device_fn
def record(stamps, kind, t_entry, t_wait, t_ready, extra):
    """Append one block's record (call from one thread of the block, at its end)."""
    t_end = global_timer()
    slot = cuda.atomic.add(stamps, 0, np.uint64(1))
    if slot < CAPACITY:
        at = np.uint64(8) + np.uint64(slot) * np.uint64(8)
        stamps[at] = t_entry
        stamps[at + np.uint64(1)] = t_wait
        stamps[at + np.uint64(2)] = t_ready
        stamps[at + np.uint64(3)] = t_end
        stamps[at + np.uint64(4)] = np.uint64(kind)
        stamps[at + np.uint64(5)] = np.uint64(cuda.blockIdx.x)
        stamps[at + np.uint64(6)] = np.uint64(cuda.gridDim.x)
        stamps[at + np.uint64(7)] = np.uint64(sm_id()) | (np.uint64(extra) << np.uint64(8))
