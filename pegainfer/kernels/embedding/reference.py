"""The reference embedding gather: one thread per output element, the math as plainly as it goes.

    out[t, i] = table[ids[t], i]     if 0 <= ids[t] < vocab
    out[t, i] = 0                    otherwise (padding tokens, id -1, and any id out of range)

ids ``[tokens]`` int32, table ``[vocab, hidden]`` and out ``[tokens, hidden]`` uint16 (bf16 bits).  A copy, so the
tuned gather (``gather.py``) must give the same bits.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import cuda, grid, int32, kernel, threads, uint16


@kernel
def reference_embedding_kernel(ids, table, out):
    """``out[t, i] = table[ids[t], i]``, zeros for an id outside ``[0, vocab)``; a thread per element ``(t, i)``
    (grid-stride, for the simulator's small grids)."""
    tokens, hidden = out.shape
    vocab = table.shape[0]
    for k in range(cuda.grid(1), tokens * hidden, cuda.gridsize(1)):
        t = k // hidden
        i = k - t * hidden
        token = int32(ids[t])
        if 0 <= token < vocab:
            out[t, i] = table[token, i]
        else:
            out[t, i] = uint16(0)


def reference_embedding(ids, table, out) -> None:
    """``out[t] = table[ids[t]]`` (ids ``[T]`` int32, table ``[V, H]`` and out ``[T, H]`` uint16, device arrays);
    out-of-range ids give zero rows."""
    assert ids.ndim == 1 and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert out.shape == (ids.shape[0], table.shape[1]) and out.dtype == table.dtype == np.uint16, (out.shape,
                                                                                                    table.shape)
    n = out.shape[0] * out.shape[1]
    if n == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(reference_embedding_kernel, grid(n, per_block=block, sim_cap=4), block, ids, table, out)
