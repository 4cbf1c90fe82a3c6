"""The input ids of a decode step launched ahead over a batch that lost rows: each row's id is the token the step
before sampled for that sequence, taken on the device (the host has not read it yet).

The step before left its sampled ids in ``prev [≥ B_prev]`` (a copy of its ``out_ids``, taken before this step's
upload overwrote them); this step uploaded, in place of each row's id, the row that sequence had in the step
before (``rows``)::

    out[r] = prev[rows[r]]        for r < n

* rows ``[≥ n]`` int32 (the step's uploaded ids), prev ``[≥ B_prev]`` int32, out ``[≥ n]`` int32.

The caller copies ``out`` over the step's ids with a device-to-device copy: a copy between this kernel and the
forward pass's first kernel keeps that kernel (a PDL launch, ``launch.py``) from starting before these ids are
written.  Geometry: one thread a row, grid-stride (a batch is at most a few hundred rows: one block).
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import cuda, grid, kernel, threads

NEXT_IDS_THREADS = 256


@kernel
def gather_next_ids_kernel(out, rows, prev, n):
    """``out[r] = prev[rows[r]]`` for ``r < n`` (module docstring)."""
    r = cuda.grid(1)
    while r < n:
        out[r] = prev[rows[r]]
        r += cuda.gridsize(1)


def gather_next_ids(out, rows, prev, n: int) -> None:
    """``out[:n] = prev[rows[:n]]`` on the current stream."""
    assert out.dtype == rows.dtype == prev.dtype == np.int32, (out.dtype, rows.dtype, prev.dtype)
    if n == 0:
        return
    launch(gather_next_ids_kernel, grid(-(-n // NEXT_IDS_THREADS)), threads(gpu=NEXT_IDS_THREADS, sim=32), out, rows,
           prev, np.int32(n))
