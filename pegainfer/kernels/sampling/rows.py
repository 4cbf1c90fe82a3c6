"""Reading a logits row: the walk every sampling kernel shares, and the host view of the rows it walks.

``_fold_row`` walks one row with the whole block: 16-byte loads of 8 bf16s, four loads in flight per thread, handing
every logit (as f32) and its index to a *visitor* device function that updates a per-thread state tuple.  Rows
whose start or stride is not 16-byte aligned fall back to 2-byte loads (``_row_words`` says which).  Each thread
sees its tokens in increasing index order (so a strict ``>`` keeps the first of equal values).
"""
from __future__ import annotations

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives import (bf16x2_hi, bf16x2_lo, bits_f32, cuda, device_fn, kernel, load_u32x4,
                                          uint32)


def _kernel_with_block(max_threads: int):
    """``@kernel`` that on the GPU also declares the block size as a launch bound, so the compiler keeps each thread
    within the registers a full block may have (65536 / max_threads) and the launch cannot fail for lack of them."""
    return kernel if SIMULATOR else cuda.jit(cache=True, launch_bounds=max_threads)


@device_fn
def _visit_group(visit, state, args, w, j0):
    """Visit the 8 bf16s packed in the four words ``w`` (logits ``j0 .. j0+7``, lower index in the low half)."""
    state = visit(state, args, bf16x2_lo(w[0]), j0)
    state = visit(state, args, bf16x2_hi(w[0]), j0 + 1)
    state = visit(state, args, bf16x2_lo(w[1]), j0 + 2)
    state = visit(state, args, bf16x2_hi(w[1]), j0 + 3)
    state = visit(state, args, bf16x2_lo(w[2]), j0 + 4)
    state = visit(state, args, bf16x2_hi(w[2]), j0 + 5)
    state = visit(state, args, bf16x2_lo(w[3]), j0 + 6)
    state = visit(state, args, bf16x2_hi(w[3]), j0 + 7)
    return state


@device_fn
def _fold_row(visit, state, args, words_row, logits, row, n_vec):
    """``state = visit(state, args, logit_f32, index)`` over this thread's share of row ``row``; returns the state.

    words_row ``[V // 2]`` uint32 (the row as packed bf16 pairs), logits ``[B, V]`` uint16; the first ``8 * n_vec``
    logits are read as 16-byte groups (group ``g`` = logits ``8g .. 8g+7``), groups ``tid, tid + nt, ...``, four
    loads issued before any is used (the clamped extra loads past the end re-read the last group and are not
    visited); the rest with 2-byte loads.  No block-wide operation inside: threads may run different trip counts.
    """
    return _fold_range(visit, state, args, words_row, logits, row, 0, n_vec, 8 * n_vec)


@device_fn
def _fold_range(visit, state, args, words_row, logits, row, g_begin, g_end, j_begin):
    """``_fold_row`` over the 16-byte groups ``g_begin .. g_end - 1`` and then the single logits from ``j_begin`` to
    the end of the row (``j_begin`` = V: none), as ``_fold_row`` reads them."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    last = g_end - 1
    for g in range(g_begin + tid, g_end, 4 * nt):
        a = load_u32x4(words_row, 4 * g)
        b = load_u32x4(words_row, 4 * min(g + nt, last))
        c = load_u32x4(words_row, 4 * min(g + 2 * nt, last))
        d = load_u32x4(words_row, 4 * min(g + 3 * nt, last))
        state = _visit_group(visit, state, args, a, 8 * g)
        if g + nt <= last:
            state = _visit_group(visit, state, args, b, 8 * (g + nt))
        if g + 2 * nt <= last:
            state = _visit_group(visit, state, args, c, 8 * (g + 2 * nt))
        if g + 3 * nt <= last:
            state = _visit_group(visit, state, args, d, 8 * (g + 3 * nt))
    for j in range(j_begin + tid, logits.shape[1], nt):
        state = visit(state, args, bits_f32(uint32(logits[row, j]) << uint32(16)), j)
    return state


def _address(arr) -> int:
    if SIMULATOR:
        return int(arr.ctypes.data)
    return int(arr.device_ctypes_pointer.value or 0)


def _row_words(logits):
    """(``[B, V // 2]`` uint32 view of the first ``V - V % 2`` logits of each row, number of 16-byte groups per row
    the kernels may read: ``V // 8`` when the data and the row stride are 16-byte aligned, else 0)."""
    assert logits.ndim == 2 and logits.dtype == np.uint16, (logits.shape, logits.dtype)
    assert logits.strides[1] == 2, "logits rows must be contiguous (a row-strided view is fine)"
    n_rows, vocab = logits.shape
    even = logits[:, : vocab - vocab % 2]
    if SIMULATOR or even.is_c_contiguous():
        words = even.view(np.uint32)
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        words = DeviceNDArray(shape=(n_rows, vocab // 2), strides=(logits.strides[0], 4), dtype=np.uint32,
                              gpu_data=even.gpu_data, stream=even.stream)
    aligned = _address(logits) % 16 == 0 and (n_rows == 1 or logits.strides[0] % 16 == 0)
    return words, (vocab // 8 if aligned else 0)


def _check_rows_out(name, arr, dtype, n_rows):
    assert arr.ndim == 1 and arr.dtype == dtype and arr.shape[0] >= n_rows, (name, arr.shape, arr.dtype, n_rows)
