"""The tuned embedding gather: ``out[t, :] = table[ids[t], :]``, a row copy of bf16 bits, 16 bytes per load.

Token ids come from a device array so the launch can be captured into a CUDA graph and replayed with new ids written
into the same buffer.  (The models also gather the rows that need logits with it.)  Rows whose size or alignment
rules out 16-byte loads take a one-bf16-at-a-time kernel.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (array_address, as_words, cuda, grid, int32, kernel, load_u32x4, pdl_prologue,
                                          threads, uint16, uint32)

uint64 = np.uint64
EMBEDDING_THREADS = 256


@functools.cache
def _embedding_rows_kernel(rounds: int):
    """Build the 16-byte gather for rows of at most ``rounds · 4 · blockDim`` words (compile-time: the loads of
    a thread are all issued before its first store)."""
    BUF = 4 * rounds                 # (a local array's size must be a closure constant, not an expression)

    @kernel
    def embedding_rows_kernel(ids, table32, out32, row_words, vocab):
        """Gather embedding rows, 16 bytes per load.

        ids     ``[tokens]`` int32 token ids
        table32 ``[vocab · row_words]`` uint32 (bf16 pairs of the ``[vocab, hidden]`` table, ``row_words`` = hidden/2,
                a multiple of 4)
        out32   ``[tokens · row_words]`` uint32: ``out[t] = table[ids[t]]``; an id outside ``[0, vocab)`` gives a row of
                zeros instead of an out-of-bounds read.

        Geometry: one block per token (grid-stride over tokens); thread ``i`` takes the 16-byte pieces ``i, i + B,
        ...`` of the row (``rounds`` of them at most), issues every load, then every store: one memory round trip
        per row (a thread copying one bf16 at a time waits for each load in turn, the table being cold in HBM).
        """
        pdl_prologue()
        n_tokens = ids.shape[0]
        tid = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)
        words = uint64(row_words)
        buf = cuda.local.array(BUF, uint32)
        for t in range(cuda.blockIdx.x, n_tokens, cuda.gridDim.x):
            token = int32(ids[t])
            valid = token >= 0 and token < vocab
            src = uint64(token if valid else 0) * words
            dst = uint64(t) * words
            for r in range(rounds):
                w = uint64(4) * (tid + uint64(r) * nt)
                if w < words:
                    if valid:
                        buf[4 * r], buf[4 * r + 1], buf[4 * r + 2], buf[4 * r + 3] = load_u32x4(table32, src + w)
                    else:
                        for k in range(4):
                            buf[4 * r + k] = uint32(0)
            for r in range(rounds):
                w = uint64(4) * (tid + uint64(r) * nt)
                if w < words:
                    for k in range(4):
                        out32[dst + w + uint64(k)] = buf[4 * r + k]

    return embedding_rows_kernel


@kernel
def embedding_kernel(ids, table, out):
    """Gather embedding rows one bf16 at a time (rows whose size or alignment rules out 16-byte loads).

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


def _sixteen_byte_rows(a) -> bool:
    """Every row of the C-contiguous 2-D ``a`` starts 16-byte aligned (so ``load_u32x4`` may read it)."""
    if not a.is_c_contiguous() or (a.shape[1] * 2) % 16:
        return False
    return array_address(a) % 16 == 0


def embedding(ids, table, out, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out[t] = table[ids[t]]`` for every token ``t`` (ids ``[T]`` int32, table ``[V, H]`` and out ``[T, H]``
    uint16 bf16 bits, all device arrays).  Out-of-range ids give zero rows."""
    assert ids.ndim == 1 and ids.dtype == np.int32, (ids.shape, ids.dtype)
    assert table.ndim == 2 and table.dtype == np.uint16, (table.shape, table.dtype)
    assert out.ndim == 2 and out.dtype == np.uint16, (out.shape, out.dtype)
    assert out.shape == (ids.shape[0], table.shape[1]), (out.shape, ids.shape, table.shape)
    num_tokens = ids.shape[0]
    if num_tokens == 0:
        return
    block = threads(gpu=EMBEDDING_THREADS, sim=32)
    if _sixteen_byte_rows(table) and _sixteen_byte_rows(out):
        row_words = table.shape[1] // 2
        rounds = -(-row_words // (4 * block))
        launch(_embedding_rows_kernel(rounds), grid(num_tokens, sim_cap=4), block, ids, as_words(table),
               as_words(out), np.int32(row_words), np.int32(table.shape[0]), policy=policy)
    else:
        launch(embedding_kernel, grid(num_tokens, sim_cap=4), block, ids, table, out, policy=policy)
