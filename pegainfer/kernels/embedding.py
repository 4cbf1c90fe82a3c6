"""Token embedding lookup: the first kernel of every forward step.

``out[t, :] = table[ids[t], :]`` — a row gather of bf16 bits.  Token ids come from a device array so the launch can
be captured into a CUDA graph and replayed with new ids written into the same buffer.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import pdl_prologue, cuda, grid, int32, kernel, threads, uint16


@kernel
def embedding_kernel(ids, table, out):
    """Gather embedding rows.

    ids   ``[tokens]`` int32 token ids
    table ``[vocab, hidden]`` uint16 (bf16 bits)
    out   ``[tokens, hidden]`` uint16 (bf16 bits): ``out[t] = table[ids[t]]``; an id outside ``[0, vocab)`` gives
          a row of zeros instead of an out-of-bounds read.

    Geometry: 1-D grid, one block per token (grid-stride over tokens), the block's threads stride over ``hidden``.
    """
    pdl_prologue()
    num_tokens = out.shape[0]
    hidden = out.shape[1]
    vocab = table.shape[0]
    for t in range(cuda.blockIdx.x, num_tokens, cuda.gridDim.x):
        token = int32(ids[t])
        valid = token >= 0 and token < vocab
        for i in range(cuda.threadIdx.x, hidden, cuda.blockDim.x):
            if valid:
                out[t, i] = table[token, i]
            else:
                out[t, i] = uint16(0)


def embedding(ids, table, out) -> None:
    """``out[t] = table[ids[t]]`` for every token ``t`` (ids ``[T]`` int32, table ``[V, H]`` and out ``[T, H]``
    uint16 bf16 bits, all device arrays).  Out-of-range ids give zero rows."""
    assert ids.ndim == 1 and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert table.ndim == 2 and table.dtype == np.uint16, (table.shape, table.dtype)
    assert out.ndim == 2 and out.dtype == np.uint16, (out.shape, out.dtype)
    assert out.shape == (ids.shape[0], table.shape[1]), (out.shape, ids.shape, table.shape)
    num_tokens = ids.shape[0]
    if num_tokens == 0:
        return
    launch(embedding_kernel, grid(num_tokens, sim_cap=4), threads(gpu=256, sim=32), ids, table, out, pdl=True)
