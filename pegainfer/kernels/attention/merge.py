"""Merging partial softmax states: the online-softmax rescale, and the two merges of the split-K kernel.

A partial result over a set of keys is ``(m, l, acc)``: the largest score ``m`` (base-2 units: scores are scaled
by ``scale · log2 e`` and exponentiated with ``exp2``), ``l = Σ 2^(s - m)`` and the unnormalised ``acc = Σ 2^(s - m)
V``.  Two partials over disjoint key sets merge exactly::

    M = max(m1, m2),   l = l1·2^(m1 - M) + l2·2^(m2 - M),   acc = acc1·2^(m1 - M) + acc2·2^(m2 - M)

and the attention output is ``bf16(acc / l)`` (then Qwen3.5's gate, ``gating.gated_value``).  The split-K kernel
(``decode.py``) merges twice, inside its one launch:

* **the block's warps** (``merge_warps``): every step warp (or warp pair) of a block holds a partial over its own
  16-key steps; they stage ``(m, l)`` and their O fragments in shared memory, the first ``G`` threads compute each
  warp's weight ``2^(m_w - M)`` per head, and every thread sums the weighted O of a few output elements.  If the
  split is the only one with work the block writes the bf16 output; otherwise the split's partial ``(acc, m, l)``
  to the workspace (``workspace.py``).
* **the splits** (``merge_splits``): each block of a (token, kv head) bumps that pair's counter after publishing its
  partial; the block that finds it is the last merges all partials into the output and resets the counter to 0,
  so the launch replays from a CUDA graph without a reset.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from pegainfer.kernels.attention.geometry import MAX_SPLITS
from pegainfer.kernels.gating import gated_value
from pegainfer.kernels.primitives import device_fn, f32_to_bf16, float32, lane_group_max, lane_group_sum, uint32

NEG_INF = float32(-math.inf)
LOG2E = 1.4426950408889634
uint64 = np.uint64


@device_fn
def rescale_factor2(m_part, m_total):
    """``2^(m_part - m_total)`` (scores kept in log2 units), and 0 for an empty partial."""
    if m_part == NEG_INF:
        return float32(0.0)
    return float32(math.exp2(m_part - m_total))


class Merge(NamedTuple):
    """The merge device functions of one split-K build (``build_merge``) and the size of its O staging area."""
    o_words: int
    o_index: object
    stage_warp_state: object
    merge_warps: object
    merge_splits: object


@functools.lru_cache(maxsize=None)
def build_merge(head_dim: int, group: int, warps: int, dim_split: bool, gated: bool) -> Merge:
    """The merges of a split-K kernel with ``warps`` warps per block (in pairs with ``dim_split``), ``group`` q heads
    per kv head of ``head_dim`` dims, gated output or not (closure constants, as the kernel's)."""
    D, G, W, GATED = head_dim, group, warps, gated
    DS = 2 if dim_split else 1
    DH = D // DS                     # head dims one warp holds
    SW = W // DS                     # step warps: warps, or pairs
    O_TILES = DH // 8                # n8 tiles of a warp's O fragment
    NT = 32 * W
    ROWS = G * D                     # output elements of a block: the G heads' rows
    ROW_ROUNDS = -(-ROWS // NT)      # output elements per thread
    ALL_ROUNDS = ROWS % NT == 0
    # The staged O of step warp sw, head h, dim d lives at o_index(sw·G + h, d): rows of RS words, chunks of CH dims
    # padded to CH + 1 words, RS = 8 (mod 32) for D >= 128
    CH = min(32, D)
    NCH = D // CH
    RS = NCH * (CH + 1) + ((8 - NCH) % 32 if CH == 32 else 0)
    O_WORDS = SW * G * RS

    @device_fn
    def o_index(row, d):
        """Word of the staged O holding dim ``d`` of row ``row = sw·G + head``.  A warp stores one O register per
        instruction from lanes ``(g, t)``, i.e. dims ``32t + c`` of head ``g`` (D = 128): unpadded those all hit one
        bank; padded, lane ``(g, t)`` is at bank ``8g + t + c`` (16 banks), and 32 consecutive dims are 32 banks.
        (For a lane's dims ``d0 + c``, ``c`` a compile-time constant, the offset from ``o_index(row, d0)`` is a
        constant too: ``d0`` is a multiple of the lane's dim span, which divides ``CH`` or is a multiple of it.)"""
        return row * uint32(RS) + (d // uint32(CH)) * uint32(CH + 1) + (d & uint32(CH - 1))

    @device_fn
    def store_output(out, at, o, gv, r):
        """``out[at] = o`` (bf16 bits), through Qwen3.5's gate ``gv[r]`` when gated."""
        if GATED:
            o = gated_value(o, gv[r])
        out[at] = o

    @device_fn
    def stage_warp_state(m, l, of, g, tq, half, usw, ug, utq, sm_m, sm_l, sm_o):
        """A step warp's partial state into shared memory: its running max ``m`` and sum ``l`` (this lane's share,
        summed over the row's 4 lanes here) per head row, its O fragment (``of``: head ``g``, dims ``2t·DH/8 + jd``
        and ``(2t+1)·DH/8 + jd`` of this warp's half).  Shared-memory indices are unsigned: no negative-index
        wraparound code."""
        l = lane_group_sum(l, 4)
        if g < G:
            if tq == 0 and half == 0:
                sm_m[usw * uint32(8) + ug] = m
                sm_l[usw * uint32(8) + ug] = l
            ob = o_index(usw * uint32(G) + ug, uint32(half * DH) + uint32(2 * O_TILES) * utq)  # this lane's dim 0
            for jd in range(O_TILES):
                sm_o[ob + uint32((jd // CH) * (CH + 1) + jd % CH)] = of[2 * jd]
                c = O_TILES + jd
                sm_o[ob + uint32((c // CH) * (CH + 1) + c % CH)] = of[2 * jd + 1]

    @device_fn
    def merge_warps(t, nq, head0, split, num_splits, n_active, out, out0, ws_acc, ws_m, ws_l, gv, sm_m, sm_l,
                    sm_o, sm_w, sm_tot):
        """Merge the block's staged step warps (module docstring): the bf16 output of the G heads when this split is
        the only one with work, else the split's partial ``(acc, m, l)`` into the workspace."""
        tid = cuda.threadIdx.x
        utid = uint32(tid)
        fzero = float32(0.0)
        cuda.syncthreads()
        if tid < G:
            m_blk = NEG_INF
            for w in range(SW):
                m_blk = max(m_blk, sm_m[uint32(w * 8) + utid])
            l_blk = fzero
            for w in range(SW):
                f = rescale_factor2(sm_m[uint32(w * 8) + utid], m_blk)
                sm_w[utid * uint32(SW) + uint32(w)] = f
                l_blk += f * sm_l[uint32(w * 8) + utid]
            sm_tot[utid] = l_blk
            if n_active > 1:
                ws_m[uint64((t * nq + head0 + tid) * num_splits + split)] = m_blk
                ws_l[uint64((t * nq + head0 + tid) * num_splits + split)] = l_blk
        cuda.syncthreads()
        for r in range(ROW_ROUNDS):             # element i of the G heads' rows: head h = i / D, dim i % D
            i = utid + uint32(r * NT)
            if ALL_ROUNDS or i < uint32(ROWS):
                h = i // uint32(D)
                total = fzero
                at = o_index(h, i & uint32(D - 1))             # the staged O[w, h, i % D] at at + w·G·RS
                for w in range(SW):
                    total += sm_w[h * uint32(SW) + uint32(w)] * sm_o[uint32(w * G * RS) + at]
                if n_active == 1:
                    lt = sm_tot[h]
                    store_output(out, uint64(out0) + uint64(i), f32_to_bf16(total / lt if lt > fzero else fzero),
                                 gv, r)
                else:
                    ws_acc[(uint64(t * nq + head0) + uint64(h)) * uint64(num_splits * D) + uint64(split * D)
                           + (i & uint32(D - 1))] = total

    @device_fn
    def merge_splits(t, nq, head0, num_splits, n_active, out, out0, ws_acc, ws_m, ws_l, counters, counter, gv, sm_w,
                     sm_tot, sm_last):
        """With several splits at work: count this block's published partial in ``counters[counter]`` (the
        (token, kv head)'s); the last block to do so merges every split's partial into the output (one warp per head
        computes the weights) and resets the counter.  Ends in a barrier (the shared scratch is reused by the
        block's next work item)."""
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        utid = uint32(tid)
        fzero = float32(0.0)
        if n_active > 1:
            cuda.threadfence()                        # publish this block's partial before counting it
            cuda.syncthreads()
            if tid == 0:
                done = cuda.atomic.add(counters, counter, 1)
                sm_last[0] = 1 if done == n_active - 1 else 0
                if done == n_active - 1:
                    counters[counter] = 0             # reset for the next launch
            cuda.syncthreads()
            if sm_last[0] == 1:
                cuda.threadfence()
                for h0 in range(0, G, W):             # one warp per head
                    h = h0 + warp
                    hrow = uint64((t * nq + head0 + min(h, G - 1)) * num_splits)
                    mm = NEG_INF
                    for sp in range(lane, n_active, 32):
                        mm = max(mm, ws_m[hrow + uint64(sp)])
                    mm = lane_group_max(mm, 32)
                    ll = fzero
                    for sp in range(lane, n_active, 32):
                        f = rescale_factor2(ws_m[hrow + uint64(sp)], mm)
                        if h < G:
                            sm_w[uint32(h * MAX_SPLITS + sp)] = f
                        ll += f * ws_l[hrow + uint64(sp)]
                    ll = lane_group_sum(ll, 32)
                    if lane == 0 and h < G:
                        sm_tot[uint32(h)] = ll
                cuda.syncthreads()
                for r in range(ROW_ROUNDS):
                    i = utid + uint32(r * NT)
                    if ALL_ROUNDS or i < uint32(ROWS):
                        h = i // uint32(D)
                        src = (uint64(t * nq + head0) + uint64(h)) * uint64(num_splits * D) + (i & uint32(D - 1))
                        total = fzero
                        for sp in range(n_active):
                            total += sm_w[h * uint32(MAX_SPLITS) + uint32(sp)] * ws_acc[src + uint64(sp * D)]
                        store_output(out, uint64(out0) + uint64(i), f32_to_bf16(total / sm_tot[h]), gv, r)
        cuda.syncthreads()

    return Merge(O_WORDS, o_index, stage_warp_state, merge_warps, merge_splits)
