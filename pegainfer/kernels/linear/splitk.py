"""Split-K for the tensor-core GEMM: several blocks share one output tile's K, and the last of them sums their
partials, in a fixed order, inside the same launch.

Why: with few tokens the GEMM is a weight stream, and a short-and-wide weight has few column tiles (o and down of
the 4B models: 2560 rows = 20 tiles of 128 columns for 132 SMs).  Cutting K into ``k_splits`` ranges multiplies the
blocks that stream it, so every SM pulls its share of the bytes.

How (``finish_tile``, called by every block of ``gemm.gemm_mma`` when its unit's K range is done):

* ``k_splits`` = 1: the block rounds its accumulators and writes the tile (``gemm.store_mma_tiles``).
* otherwise it publishes its f32 accumulators in the workspace, bumps the tile's arrival counter, and the block
  that finds itself last sums the ``k_splits`` partials in split order 0, 1, ... (whichever block that is: the sum
  is deterministic), writes the tile, and puts the counter back to 0 (``split_counters``: zero at rest, so a CUDA
  graph replays without a reset).

Workspace (one f32 device array the caller allocates once, ``linear_workspace_size``)::

    partials [tiles · k_splits · bm · bn]   (tile, split): ((tile·k_splits + split)·n_acc + i)·threads + tid
    ... counters [tiles] int32, then the add + RMSNorm prologue's two handoff counters at the very end of the array

(``n_acc`` = the accumulator registers of a thread, ``i`` one of them: a block's 128 threads write 512 contiguous
bytes per register, and the last block reads them back in the same pattern, each thread its own fragment values.)

Numerics: the partial over each K range is an f32 sum in the kernel's own order; their sum adds k_splits - 1 more
f32 roundings.  Against the exact sum s = Σ_k x_k w_k the f32 result differs by at most about
(K / 16 + k_splits) · 2^-24 · Σ_k |x_k w_k| (each m16n8k16 step adds 16 products into the accumulator with one f32
rounding, at most K / 16 of them per output), far below the bf16 rounding of the output (2^-9 relative) for the
projections' K: outputs differ from the single-range sum only where that sum lies within a few f32 ulps of a bf16
rounding boundary.  On data whose sums are exact in f32 every split count gives the reference kernel's bits.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels.linear.geometry import MmaGeometry, mma_geometry, mma_units, wgmma_geometry
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import bits_f32, cuda, device_fn, f32_bits, float32, load_u32_l2
from pegainfer.kernels.split_counters import zeroed_counters

uint64 = np.uint64


def workspace_need(geo: MmaGeometry, n_tokens: int, n_cols: int) -> tuple[int, int]:
    """(partial f32 elements, counters) one launch of geometry ``geo`` over ``n_tokens`` × ``n_cols`` uses; a launch
    without split-K uses neither."""
    if geo.k_splits <= 1:
        return 0, 0
    tiles = mma_units(geo, n_tokens, n_cols) // geo.k_splits
    return tiles * geo.k_splits * geo.bm * geo.bn, tiles


def split_workspace(workspace, geo: MmaGeometry, n_tokens: int, n_cols: int, policy: LaunchPolicy, stand_in):
    """(partials as uint32 words, counters as int32): the flat views of the f32 ``workspace`` that a launch of
    ``geo`` uses (module docstring): the whole array, and its last ``tiles`` entries (zeroed once).  Without
    split-K the kernel touches neither: views of ``stand_in`` (a flat uint32 array, e.g. the launch's x) take their
    place, so nothing is allocated, and ``workspace`` may be None."""
    n_part, n_count = workspace_need(geo, n_tokens, n_cols)
    if n_count == 0:
        return stand_in, stand_in.view(np.int32)
    _check_workspace(workspace, n_part + n_count + HANDOFF_WORDS)
    ws32 = zeroed_counters(workspace, n_count + HANDOFF_WORDS, policy, "linear_zero_counters")
    end = ws32.shape[0] - HANDOFF_WORDS
    return workspace.reshape(-1).view(np.uint32), ws32[end - n_count:end]


HANDOFF_WORDS = 2
"""The add + RMSNorm prologue's counters (``gemm_wgmma_ring``: rows written, blocks past the wait), the last words
of the workspace."""


def _check_workspace(workspace, need: int) -> None:
    if workspace is None or workspace.dtype != np.float32 or workspace.size < need:
        got = None if workspace is None else f"{workspace.size} {workspace.dtype}"
        raise ValueError(f"workspace must be f32 with >= {need} elements (linear_workspace_size); got {got}")


def norm_handoff(workspace, policy: LaunchPolicy):
    """The add + RMSNorm prologue's two handoff counters: the last ``HANDOFF_WORDS`` words of ``workspace`` as
    uint32, zero at rest (zeroed the first time, as the split-K counters)."""
    _check_workspace(workspace, HANDOFF_WORDS)
    ws32 = zeroed_counters(workspace, HANDOFF_WORDS, policy, "linear_zero_counters")
    return ws32[ws32.shape[0] - HANDOFF_WORDS:].view(np.uint32)


@device_fn
def _block_sync():
    cuda.syncthreads()


@functools.cache
def build_finish_tile(n_acc: int, nthreads: int, store_tiles, tile_sync=None):
    """``finish_tile`` for tiles held by ``nthreads`` threads (threads ``0 .. nthreads - 1`` of the block) with
    ``n_acc`` accumulator values each (module docstring); ``store_tiles(out, acc, tok0, col0)`` rounds a thread's
    accumulators and writes them; ``tile_sync()`` is the barrier of those threads (the block's, or a named barrier
    when other warps of the block do other work; None: the block's)."""
    if tile_sync is None:
        tile_sync = _block_sync

    @device_fn
    def finish_tile(out, acc, tok0, col0, ws, counters, flag, flag_at, tile, split, k_splits):
        """Write the block's output tile (``k_splits`` = 1), or publish its partial and, in the last block of the
        tile, sum every split's partial in split order and write the tile.  Block-uniform: every thread calls it;
        ``flag[flag_at]`` is one word of shared scratch."""
        if k_splits == 1:
            store_tiles(out, acc, tok0, col0)
            return
        tid = cuda.threadIdx.x
        at = uint64((tile * k_splits + split) * n_acc) * uint64(nthreads) + uint64(tid)
        for i in range(n_acc):
            ws[at + uint64(i * nthreads)] = f32_bits(acc[i])
        cuda.threadfence()                          # publish the partial before counting it
        tile_sync()
        if tid == 0:
            arrived = cuda.atomic.add(counters, tile, 1)
            flag[flag_at] = 1 if arrived == k_splits - 1 else 0
            if arrived == k_splits - 1:
                counters[tile] = 0                  # zero at rest for the next launch
        tile_sync()
        if flag[flag_at] == 1:
            cuda.threadfence()
            first = uint64(tile * k_splits * n_acc) * uint64(nthreads) + uint64(tid)
            for i in range(n_acc):
                acc[i] = float32(0.0)
            for s in range(k_splits):               # split order, whichever block is last: deterministic
                src = first + uint64(s * n_acc * nthreads)
                for i in range(n_acc):
                    acc[i] += bits_f32(load_u32_l2(ws, src + uint64(i * nthreads)))
            store_tiles(out, acc, tok0, col0)
        tile_sync()                          # the flag is read before the next unit writes it

    return finish_tile


def linear_workspace_size(max_tokens: int, weights, policy: LaunchPolicy = DEFAULT_POLICY) -> int:
    """f32 elements of the ``workspace`` that ``linear`` / ``linear_silu_mul`` / ``linear_add_rms_norm`` need for
    any 1 <= T <= ``max_tokens`` (on any path: ``impl="gemm_mma"`` may force the GEMM on one token) on ``weights``:
    each a ``(rows, K, gated)`` tuple (gate/up: ``rows`` = 2I, gated True) or a ``[rows, K]`` weight array (not
    gated).  The largest split-K need over those launches, counters included, and the add + RMSNorm prologue's
    handoff counters after them."""
    need = 0
    for wt in weights:
        rows, k, gated = wt if isinstance(wt, tuple) else (wt.shape[0], wt.shape[1], False)
        for t in range(1, max_tokens + 1):
            for geo in (mma_geometry(rows, k, t, gated, policy), wgmma_geometry(rows, k, t, gated, policy)):
                n_part, n_count = workspace_need(geo, t, rows)
                need = max(need, n_part + n_count)
    return need + HANDOFF_WORDS
