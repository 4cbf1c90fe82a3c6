"""Split-K attention ("flash-decoding") on tensor cores: decode steps and short prompt chunks, one launch.

Math (``__init__``'s docstring): for each token ``t`` and q head ``h``, ``out[t, h] = bf16(softmax(scale · q K^T) V)``
over keys ``0 .. positions[t]`` of its slot, computed as partial online-softmax states merged exactly
(``merge.py``).  Rounding: scores and sums in f32 (bf16 q / K products on tensor cores), the probabilities rounded
to bf16 for ``P V``, the output rounded to bf16 once, then Qwen3.5's gate (``gating.gated_value``) when gated.

Work: one block per (token, kv head, split), grid-stride over ``num_splits · T · nkv`` items (split slowest, so the
splits with work come first).  A block serves all ``G = nq / nkv`` q heads of its kv head, as the rows of an
``m16n8k16`` tile, so each K/V row is read from memory once for ``G`` heads.  Split ``s`` covers keys ``[s·chunk,
(s+1)·chunk)`` of the token's ``n = positions[t] + 1`` (``split_range``: ``chunk`` is ``n / num_splits`` rounded up
to a multiple of ``min_chunk``), so how many splits do work is decided on the device and the launch is the same for
every step (CUDA graphs).  Launch: ``num_splits · T · nkv`` blocks (``geometry.attention_num_splits``) of ``32 · W``
threads (``geometry.split_geometry``: 8 warps, 4 in a batched step; for 256-dim heads 4 pairs; one warp or pair
in the simulator); a batched step's launch is a grid of two blocks an SM that walks the items instead
(``SplitGeometry.walk``), so each block knows its next item and asks L2 for its first keys ahead.

A block's warps take 16-key steps ``w, w + W, ...`` of its split.  One step of a warp:

1. **load**: K rows of keys ``k0 + g`` and ``k0 + 8 + g`` straight from the cache into registers (lane ``(g, t)``
   holds dims ``[t·DH/4, (t+1)·DH/4)``: already the B fragment of ``S = Q K^T``, q uses the same dim order), and V
   rows of keys ``k0 + 2t, 2t+1, 2t+8, 2t+9`` (dims ``[g·DH/8, (g+1)·DH/8)``), no shared-memory staging; a step
   whose 16 keys all count and share a page (almost every step at 16-key pages) takes its rows from the step's
   first row with no per-key test (``load_full_step``: 64-sequence call 25.2 -> 23.7 us, docs/perf/attention.md);
2. **scores**: ``S[16 x 16] = Q K^T`` as two ``m16n8k16`` tiles (rows: the G heads, zero-padded to 16), scaled to
   base-2 units and masked past the split's end;
3. **online softmax** over each row's 16 keys (the 4 lanes of a row), rescaling the running sum and O;
4. **P V**: ``O += bf16(P) V`` as ``DH/8`` ``m16n8k16`` tiles (V's key pairs packed into B fragments).

Once its step's loads are issued (after the wait, in decode mode), a warp asks L2 for the rows of its step of the
next round (``prefetch_step``), so that round's loads wait on L2 rather than HBM (a 64-sequence decode step −1.3 %);
in an item's last round, for its step of the first round of the block's next work item (``prefetch_next_item``).

Heads wider than 128 dims (Qwen3.5's 256) run with ``dim_split``: warps in pairs, each warp of a pair on one half of
every row's dims, so its registers and dependent chains are those of a 128-dim head; the pair's two partial S are
summed through shared memory once per step (``docs/perf/attention.md``).

Then the block merges its warps and, with several splits at work, the last block of the (token, kv head) merges the
splits (``merge.py``).  A padding token (``token_slots[t] < 0``) reads nothing and gets zeros.

PDL (``launch.py``): a plain launch lets the next kernel launch and waits for the previous one at its start.  A
``decode`` launch (every token is its sequence's newest, so the kernel before -- qk-norm/RoPE -- wrote only q and
the K/V row at ``positions[t]``) first reads what no kernel of the step writes (the kernel's ``reads_before_wait``;
of the caches, the first key step's rows of the older keys); then waits, reads q, the gates and the newest key's
rows, and lets the next kernel (the o projection, whose blocks then copy its weights) launch right after that wait.
Each work item waits once more before its merge, which writes global memory.  At run time that wait is a no-op
(the first key step waited); it covers the paths the compiled code has but never takes -- no key step at all (a
split with work has keys) and a first step that skips its wait (the compiler keeps "first step" a runtime test) --
so that a wait precedes every global write on every path of the compiled kernel (``tools/pdl_early_reads.py``).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from pegainfer.kernels import timeline
from pegainfer.kernels.attention.geometry import (DECODE_STEP_KEYS, MAX_SPLITS, SplitGeometry, attention_num_splits,
                                                  min_chunk, split_geometry)
from pegainfer.kernels.attention.merge import LOG2E, NEG_INF, build_merge, rescale_factor2
from pegainfer.kernels.attention.workspace import flat, flat_u32, split_workspace
from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (cuda, device_fn, float32, global_timer, grid, grid_dependency_wait, int32,
                                          kernel, lane_group_max, launch_dependents, load_u32x4, mma_bf16_m16n8k16,
                                          pack_bf16x2, pdl_prologue, prefetch_l2, reads_before_wait, sm_count,
                                          uint16, uint32)

uint64 = np.uint64


# ------------------------------------------------------------------------------------------------ device functions
@device_fn
def load_words(src, base, n, dst, dst_off, ok):
    """``dst[dst_off : dst_off + n] = src[base : base + n]`` (uint32 words; 16-byte loads when ``n % 4 == 0``, in
    which case ``base`` must be a multiple of 4), or zeros when ``not ok``."""
    if ok:
        if n % 4 == 0:
            for c in range(n // 4):
                (dst[dst_off + 4 * c], dst[dst_off + 4 * c + 1],
                 dst[dst_off + 4 * c + 2], dst[dst_off + 4 * c + 3]) = load_u32x4(src, base + 4 * c)
        else:
            for i in range(n):
                dst[dst_off + i] = src[base + i]
    else:
        for i in range(n):
            dst[dst_off + i] = uint32(0)


@device_fn
def kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, row_words):
    """Word offset of the K/V row of ``key`` (a position of ``slot``), kv head ``kvh``, in the flat cache."""
    page = block_tables[uint64(slot), uint64(key >> page_shift)]   # unsigned: no negative-index wraparound code
    return (((page << page_shift) + (key & ((1 << page_shift) - 1))) * num_kv_heads + kvh) * row_words


@device_fn
def step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh, row_words):
    """``kv_row`` of ``key``, a key of the 16-key step that starts at ``k0``; 0 for a key past ``k_hi`` (not
    loaded).  ``row0`` is the step's first row when all its keys share a page (``step_first_row``): then it is
    one multiply-add, no block-table load."""
    if key >= k_hi:
        return 0
    if row0 >= 0:
        return row0 + (key - k0) * num_kv_heads * row_words
    return kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, row_words)


@device_fn
def step_first_row(block_tables, slot, k0, k_hi, page_shift, num_kv_heads, kvh, row_words):
    """Row of key ``k0`` when the step's ``DECODE_STEP_KEYS`` keys from ``k0`` lie in one page (pages of at least
    that many keys and ``k0`` a multiple of it: every split at the default split lengths), else -1.  One
    block-table load per step and warp instead of one per key a lane loads (six)."""
    if page_shift >= 4 and (k0 & (DECODE_STEP_KEYS - 1)) == 0 and k0 < k_hi:
        return kv_row(block_tables, slot, k0, page_shift, num_kv_heads, kvh, row_words)
    return -1


@device_fn
def split_range(n_keys, split, num_splits, min_chunk):
    """(first key, end key, number of splits with work) of ``split`` for a token with ``n_keys`` keys: splits of
    ``chunk = ceil(n_keys / num_splits)`` keys rounded up to a multiple of ``min_chunk``; splits past the end are
    empty.  All four are non-negative and < 2^31: the divisions are unsigned 32-bit ones (a 64-bit signed division
    by a runtime value is ~3x the instructions)."""
    n, s, m = uint32(n_keys), uint32(num_splits), uint32(min_chunk)
    chunk = uint32(uint32(n + s - uint32(1)) // s)
    chunk = uint32(uint32(chunk + m - uint32(1)) // m) * m
    k_lo = int32(uint32(split) * chunk)
    return k_lo, min(k_lo + int32(chunk), int32(n_keys)), int32(uint32(n + chunk - uint32(1)) // chunk)


@device_fn
def online_softmax_step(m, l, s0, s1, s2, s3):
    """One 16-key step of a row's online softmax; this lane holds 4 of the row's scores (base-2 units, masked keys
    at -inf) and its share of the running sum ``l``.  Returns the new max, the new sum, the factor ``alpha`` that
    rescales what was accumulated before, and this lane's probabilities as the A fragment of ``P V`` (bf16 pairs:
    keys ``2t, 2t+1`` and ``2t+8, 2t+9``)."""
    mx = max(m, lane_group_max(max(max(s0, s1), max(s2, s3)), 4))
    alpha = rescale_factor2(m, mx)
    m = mx
    base = m if m != NEG_INF else float32(0.0)   # a finite base: masked scores -> 2^-inf = 0
    p0 = math.exp2(s0 - base)
    p1 = math.exp2(s1 - base)
    p2 = math.exp2(s2 - base)
    p3 = math.exp2(s3 - base)
    l = l * alpha + ((p0 + p1) + (p2 + p3))
    return m, l, alpha, pack_bf16x2(p0, p1), pack_bf16x2(p2, p3)


# ------------------------------------------------------------------------------------------------ kernel
@functools.lru_cache(maxsize=None)
def split_kernel(head_dim: int, group: int, warps: int, decode: bool = False, gated: bool = False,
                 dim_split: bool = False, stamps: bool = False):
    """Build the split-K kernel for one shape (closure constants size the register fragments): ``warps`` per block,
    in pairs over the head dims with ``dim_split``; ``decode``: every token is its sequence's newest (the early
    loads of the module docstring); ``gated``: the output goes through Qwen3.5's sigmoid gate as it is written, the
    gates of a thread's output elements loaded right after the PDL wait; ``stamps``: each block appends its
    ``timeline`` record (its first work item's wait)."""
    D, G, W, DECODE, GATED, STAMPS = head_dim, group, warps, decode, gated, stamps
    LINE_WORDS = 32                          # words of a 128-byte line
    ROW_LINES = max(1, D // 64)              # lines of a K or V row (D bf16)
    DS = 2 if dim_split else 1               # warps per 16-key step
    assert W % DS == 0 and (D // DS) % 16 == 0, (W, D, DS)
    DH = D // DS                             # head dims one warp handles
    SW = W // DS                             # 16-key steps per round (warps, or warp pairs)
    HALF_WORDS = DH // 2                     # word offset of the second half's dims within a row
    SM_S = 2 * W * 128 if dim_split else 1   # the pairs' partial S, double-buffered by round [2, W, 32 lanes, 4]
    NT = 32 * W
    ROW_WORDS = D // 2
    KW = DH // 8         # words of a q / K row per lane: lane t (= lane & 3) holds dims [t DH/4, (t+1) DH/4)
    VW = DH // 16        # words of a V row per lane: lane g (= lane >> 2) holds dims [g DH/8, (g+1) DH/8)
    QK_STEPS = DH // 16  # k16 steps of S = Q K^T
    O_TILES = DH // 8    # n8 tiles of O = P V
    ROWS = G * D
    assert G <= 8 and D % 16 == 0
    KW2, VW4, O_REGS, SM_W, SM_ROWS = 2 * KW, 4 * VW, 2 * O_TILES, G * MAX_SPLITS, SW * 8
    FULL_STEPS = KW % 4 == 0 and VW % 4 == 0  # 16-byte loads of whole steps (every served head)
    ROW_ROUNDS = -(-ROWS // NT)              # output elements per thread
    ALL_ROUNDS = ROWS % NT == 0
    merge = build_merge(D, G, W, dim_split, gated)
    SM_O = merge.o_words
    stage_warp_state, merge_warps, merge_splits = merge.stage_warp_state, merge.merge_warps, merge.merge_splits
    # decode: read before the PDL wait (of the caches only the first key step's rows of the older keys: the kernel
    # before writes the newest key's)
    early_reads = ("k32", "v32", "block_tables", "token_slots", "positions") if DECODE else ()

    @device_fn
    def load_q(q32, t, nq, head0, g, tq, dim0, qa):
        """This lane's q words (the A fragment of ``S``): head ``head0 + g`` (rows g >= G are zero), its dims."""
        load_words(q32, (t * nq + head0 + g) * ROW_WORDS + dim0 + tq * KW, KW, qa, 0, g < G)

    @device_fn
    def load_gates(gate, t, head0, utid, gv):
        """gv[r] = the gate of output element ``i = tid + r·NT`` of the block's G heads (head ``h = i / D``: column
        ``(head0 + h)·2D + D + i % D`` of row t, which is ``head0·2D + D + h·D + i``)."""
        for r in range(ROW_ROUNDS):
            i = utid + uint32(r * NT)
            if ALL_ROUNDS or i < uint32(ROWS):
                h = i // uint32(D)
                gv[r] = gate[uint64(t), uint64(head0 * 2 * D + D) + h * uint32(D) + i]

    @device_fn
    def load_k_step(k32, block_tables, slot, k0, k_hi, row0, page_shift, num_kv_heads, kvh, dim0, g, tq, early,
                    newest, kw):
        """K words of keys ``k0 + g`` and ``k0 + 8 + g`` (zeros past ``k_hi``, and for the newest key when
        ``early``: it is loaded after the wait)."""
        for j in range(2):
            key = k0 + 8 * j + g
            row = step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh, ROW_WORDS)
            load_words(k32, row + dim0 + tq * KW, KW, kw, j * KW, key < k_hi and not (early and key == newest))

    @device_fn
    def load_v_step(v32, block_tables, slot, k0, k_hi, row0, page_shift, num_kv_heads, kvh, dim0, g, tq, early,
                    newest, vw):
        """V words of keys ``k0 + 2t``, ``2t + 1``, ``2t + 8``, ``2t + 9`` (zeros past ``k_hi``, and for the newest
        key when ``early``)."""
        for j in range(4):
            key = k0 + 2 * tq + (j & 1) + 8 * (j >> 1)
            row = step_row(block_tables, slot, key, k0, k_hi, row0, page_shift, num_kv_heads, kvh, ROW_WORDS)
            load_words(v32, row + dim0 + g * VW, VW, vw, j * VW, key < k_hi and not (early and key == newest))

    @device_fn
    def load_full_step(k32, v32, row0, dim0, g, tq, key_words, kw, vw):
        """``load_k_step`` and ``load_v_step`` of a step whose 16 keys all count, lie in one page from row ``row0``
        on (``key_words``: words from one key's row to the next) and, before the PDL wait, do not include the newest
        key: no per-key test, no block-table load."""
        for j in range(2):
            base = row0 + (8 * j + g) * key_words + dim0 + tq * KW
            for c in range(KW // 4):
                (kw[j * KW + 4 * c], kw[j * KW + 4 * c + 1],
                 kw[j * KW + 4 * c + 2], kw[j * KW + 4 * c + 3]) = load_u32x4(k32, base + 4 * c)
        for j in range(4):
            base = row0 + (2 * tq + (j & 1) + 8 * (j >> 1)) * key_words + dim0 + g * VW
            for c in range(VW // 4):
                (vw[j * VW + 4 * c], vw[j * VW + 4 * c + 1],
                 vw[j * VW + 4 * c + 2], vw[j * VW + 4 * c + 3]) = load_u32x4(v32, base + 4 * c)

    @device_fn
    def load_newest(k32, v32, block_tables, slot, k0, k_hi, newest, page_shift, num_kv_heads, kvh, dim0, g, tq, kw,
                    vw):
        """After the PDL wait: the K / V words of the newest key, where this lane holds it in the step at ``k0``."""
        for j in range(2):
            key = k0 + 8 * j + g
            if key == newest and key < k_hi:
                row = kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, ROW_WORDS)
                load_words(k32, row + dim0 + tq * KW, KW, kw, j * KW, True)
        for j in range(4):
            key = k0 + 2 * tq + (j & 1) + 8 * (j >> 1)
            if key == newest and key < k_hi:
                row = kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, ROW_WORDS)
                load_words(v32, row + dim0 + g * VW, VW, vw, j * VW, True)

    @device_fn
    def prefetch_step(k32, v32, block_tables, slot, k0, k_hi, page_shift, num_kv_heads, kvh, lane):
        """Ask L2 for the K and V rows of the 16-key step at ``k0`` (keys before ``k_hi``): lane l takes key
        ``k0 + l % 16``, its K row (lanes 0-15) or its V row (16-31), every 128-byte line of it.  Nothing waits on
        it; the warp's loads of that step, a round later, then find the rows in L2."""
        key = k0 + (lane & 15)
        if key < k_hi:
            row = kv_row(block_tables, slot, key, page_shift, num_kv_heads, kvh, ROW_WORDS)
            for c in range(ROW_LINES):
                if lane < 16:
                    prefetch_l2(k32, row + c * LINE_WORDS)
                else:
                    prefetch_l2(v32, row + c * LINE_WORDS)

    @device_fn
    def prefetch_next_item(k32, v32, block_tables, token_slots, positions, work, per_split, num_splits,
                           num_kv_heads, min_chunk, page_shift, sw, lane):
        """``prefetch_step`` of this warp's step of the first round of work item ``work`` (the block's next one in
        its grid-stride walk), if it is a real token's split with keys: its first rows then come from L2, not HBM,
        while this item's last round and merge run.  Called after the block's PDL wait (in its last round)."""
        if work < num_splits * per_split:
            tk = uint32(work) % per_split
            t = int32(tk // uint32(num_kv_heads))
            slot = token_slots[t]
            if slot >= 0:
                k_lo, k_hi, n_active = split_range(positions[t] + 1, int32(uint32(work) // per_split), num_splits,
                                                   min_chunk)
                if int32(uint32(work) // per_split) < n_active:
                    prefetch_step(k32, v32, block_tables, slot, k_lo + sw * DECODE_STEP_KEYS, k_hi, page_shift,
                                  num_kv_heads, int32(tk % uint32(num_kv_heads)), lane)

    @device_fn
    def step_scores(qa, kw, sm_s, st0, warp, lane, sw):
        """``S = Q K^T`` of the step: this lane's scores of head g, keys ``k0 + 2t, 2t+1, 2t+8, 2t+9``.  With
        ``dim_split`` each warp of a pair has the product over its half of the dims: the pair sums the two through
        shared memory, in the same order in both warps."""
        zero = uint32(0)
        fzero = float32(0.0)
        s0 = s1 = s2 = s3 = fzero
        for ks in range(QK_STEPS):
            s0, s1, _, _ = mma_bf16_m16n8k16(qa[2 * ks], zero, qa[2 * ks + 1], zero,
                                             kw[2 * ks], kw[2 * ks + 1], s0, s1, fzero, fzero)
            s2, s3, _, _ = mma_bf16_m16n8k16(qa[2 * ks], zero, qa[2 * ks + 1], zero,
                                             kw[KW + 2 * ks], kw[KW + 2 * ks + 1], s2, s3, fzero, fzero)
        if DS == 2:
            buf = uint32((st0 // SW) % 2) * uint32(W * 128)
            own = buf + uint32(warp * 128) + uint32(lane * 4)
            sm_s[own] = s0
            sm_s[own + uint32(1)] = s1
            sm_s[own + uint32(2)] = s2
            sm_s[own + uint32(3)] = s3
            cuda.syncthreads()
            lo = buf + uint32(2 * sw * 128) + uint32(lane * 4)
            hi = lo + uint32(128)
            s0 = sm_s[lo] + sm_s[hi]
            s1 = sm_s[lo + uint32(1)] + sm_s[hi + uint32(1)]
            s2 = sm_s[lo + uint32(2)] + sm_s[hi + uint32(2)]
            s3 = sm_s[lo + uint32(3)] + sm_s[hi + uint32(3)]
        return s0, s1, s2, s3

    @device_fn
    def accumulate_pv(of, vw, a0, a2, alpha):
        """``O = alpha·O + P V`` over the step's 16 keys: B[k = key, n = dim] with this lane's key pairs packed into
        one word (V words of keys 2t, 2t+1 and 2t+8, 2t+9)."""
        zero = uint32(0)
        fzero = float32(0.0)
        for jd in range(O_TILES):
            w = jd // 2
            x0, x1, y0, y1 = vw[w], vw[VW + w], vw[2 * VW + w], vw[3 * VW + w]
            if jd % 2 == 0:
                b0 = (x0 & uint32(0xFFFF)) | (x1 << uint32(16))
                b1 = (y0 & uint32(0xFFFF)) | (y1 << uint32(16))
            else:
                b0 = (x0 >> uint32(16)) | (x1 & uint32(0xFFFF0000))
                b1 = (y0 >> uint32(16)) | (y1 & uint32(0xFFFF0000))
            of[2 * jd], of[2 * jd + 1], _, _ = mma_bf16_m16n8k16(
                a0, zero, a2, zero, b0, b1, of[2 * jd] * alpha, of[2 * jd + 1] * alpha, fzero, fzero)

    @reads_before_wait(*early_reads)
    @kernel
    def paged_attention_split_kernel(q32, k32, v32, block_tables, token_slots, positions, out, ws_acc, ws_m, ws_l,
                                     counters, scale_log2, num_kv_heads, page_shift, num_splits, min_chunk, gate,
                                     stamp_buf):
        """Attention of one (token, kv head, split) per block for the ``G`` q heads of that kv head (module
        docstring); the last block of a (token, kv head) to finish merges the splits.

        q32 ``[T * nq * D/2]`` uint32 (bf16 pairs of q ``[T, nq, D]``); k32, v32 the caches as flat uint32; out
        ``[T * nq * D]`` uint16; ws_acc ``[T * nq * num_splits * D]``, ws_m, ws_l ``[T * nq * num_splits]`` f32;
        counters int32, zero at rest (entry ``-1 - (t * nkv + kvh)``, counted from the end); ``scale_log2`` =
        scale * log2(e); ``page_shift = log2(page_size)``; ``min_chunk``: fewest keys of a split; gate ``[T, row]``
        bf16 (``gated``: q head ``h``'s gate at columns ``h·2D + D ..``, Qwen3.5's q_proj output; else unused);
        stamp_buf: the ``timeline`` buffer (``stamps``; else unused).
        """
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        if not DECODE:
            pdl_prologue()
        sm_m = cuda.shared.array(SM_ROWS, float32)    # per step warp and head row: running max
        sm_l = cuda.shared.array(SM_ROWS, float32)    # ... and sum
        sm_o = cuda.shared.array(SM_O, float32)      # ... and accumulator [SW, G, D] (padded: merge.o_index)
        sm_s = cuda.shared.array(SM_S, float32)      # dim split: the pairs' partial S [2 rounds, W, 32, 4]
        sm_w = cuda.shared.array(SM_W, float32)      # merge weights [G, warps or splits]
        sm_tot = cuda.shared.array(8, float32)       # merged sum per head
        sm_last = cuda.shared.array(1, int32)
        qa = cuda.local.array(KW, uint32)            # q fragments (rows g < G)
        kw = cuda.local.array(KW2, uint32)           # K words of keys k0 + g, k0 + 8 + g
        vw = cuda.local.array(VW4, uint32)           # V words of keys k0 + 2t, 2t + 1, 2t + 8, 2t + 9
        of = cuda.local.array(O_REGS, float32)       # O[head g, dims 2t DH/8 + jd, (2t+1) DH/8 + jd]
        gv = cuda.local.array(ROW_ROUNDS, uint16)    # gated: the gates of the output elements this thread writes
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        half = warp % DS                  # dim split: this warp's half of the head dims (else 0)
        sw = warp // DS                   # its step warp: the warp, or the pair
        dim0 = half * HALF_WORDS          # word offset of this warp's dims within a q / K / V row
        g = lane >> 2
        tq = lane & 3
        utid, usw, ug, utq = uint32(tid), uint32(sw), uint32(g), uint32(tq)
        nq = num_kv_heads * G
        n_tokens = positions.shape[0]
        fzero = float32(0.0)

        # work items (split, token, kv head), split slowest
        per_split = uint32(n_tokens * num_kv_heads)
        for work in range(cuda.blockIdx.x, num_splits * n_tokens * num_kv_heads, cuda.gridDim.x):
            tk = int32(uint32(work) % per_split)            # unsigned 32-bit divisions (see split_range)
            split = int32(uint32(work) // per_split)
            t = int32(uint32(tk) // uint32(num_kv_heads))
            kvh = int32(uint32(tk) % uint32(num_kv_heads))
            head0 = kvh * G
            out0 = (t * nq + head0) * D
            slot = token_slots[t]
            if slot < 0:                                  # padding token
                grid_dependency_wait()
                if split == 0:
                    for i in range(tid, ROWS, NT):
                        out[out0 + i] = uint16(0)
                continue
            k_lo, k_hi, n_active = split_range(positions[t] + 1, split, num_splits, min_chunk)
            if split >= n_active:
                continue

            newest = positions[t]                         # decode: the only key the previous kernel wrote
            if not DECODE:
                load_q(q32, t, nq, head0, g, tq, dim0, qa)
                if GATED:
                    load_gates(gate, t, head0, utid, gv)
            for i in range(O_REGS):
                of[i] = fzero
            m = NEG_INF
            l = fzero                                     # this lane's share of its row's sum
            # the split's keys, 16 a step: load, (decode: wait), scores, online softmax, P V
            n_steps = (k_hi - k_lo + DECODE_STEP_KEYS - 1) // DECODE_STEP_KEYS
            for st0 in range(0, n_steps, SW):             # same trip count in every warp (barriers, simulator)
                k0 = k_lo + (st0 + sw) * DECODE_STEP_KEYS
                early = DECODE and st0 == 0               # before the wait: every key but the newest
                row0 = step_first_row(block_tables, slot, k0, k_hi, page_shift, num_kv_heads, kvh, ROW_WORDS)
                # a whole step in one page (before the wait: one without the newest key) needs no per-key test
                if FULL_STEPS and row0 >= 0 and k0 + DECODE_STEP_KEYS <= (newest if early else k_hi):
                    load_full_step(k32, v32, row0, dim0, g, tq, num_kv_heads * ROW_WORDS, kw, vw)
                else:
                    load_k_step(k32, block_tables, slot, k0, k_hi, row0, page_shift, num_kv_heads, kvh, dim0, g,
                                tq, early, newest, kw)
                    load_v_step(v32, block_tables, slot, k0, k_hi, row0, page_shift, num_kv_heads, kvh, dim0, g,
                                tq, early, newest, vw)
                if early:
                    grid_dependency_wait()
                    if STAMPS and t_wait == uint64(0):
                        t_wait = global_timer()
                    load_q(q32, t, nq, head0, g, tq, dim0, qa)
                if early and GATED:                       # written by the projection before qk-norm: visible now
                    load_gates(gate, t, head0, utid, gv)
                if early:
                    launch_dependents()                   # the o projection may launch and start its copies
                    load_newest(k32, v32, block_tables, slot, k0, k_hi, newest, page_shift, num_kv_heads, kvh,
                                dim0, g, tq, kw, vw)
                if st0 + SW < n_steps:                    # the next round's rows, into L2
                    prefetch_step(k32, v32, block_tables, slot, k0 + SW * DECODE_STEP_KEYS, k_hi, page_shift,
                                  num_kv_heads, kvh, lane)
                else:                                     # the last round: the next item's first round instead
                    prefetch_next_item(k32, v32, block_tables, token_slots, positions, work + cuda.gridDim.x,
                                       per_split, num_splits, num_kv_heads, min_chunk, page_shift, sw, lane)

                s0, s1, s2, s3 = step_scores(qa, kw, sm_s, st0, warp, lane, sw)
                key = k0 + 2 * tq                         # base-2 units, masked past k_hi
                s0 = s0 * scale_log2 if key < k_hi else NEG_INF
                s1 = s1 * scale_log2 if key + 1 < k_hi else NEG_INF
                s2 = s2 * scale_log2 if key + 8 < k_hi else NEG_INF
                s3 = s3 * scale_log2 if key + 9 < k_hi else NEG_INF
                m, l, alpha, a0, a2 = online_softmax_step(m, l, s0, s1, s2, s3)
                accumulate_pv(of, vw, a0, a2, alpha)

            if DECODE:                                    # the merge writes: no path may reach it unwaited
                grid_dependency_wait()                    # (a no-op after the first key step's; module docstring)
            if STAMPS and t_ready == uint64(0) and of[0] != float32(-1.25e-38):   # (after the last P V product)
                t_ready = global_timer()
            # merge the block's step warps, then (several splits at work) the splits
            stage_warp_state(m, l, of, g, tq, half, usw, ug, utq, sm_m, sm_l, sm_o)
            merge_warps(t, nq, head0, split, num_splits, n_active, out, out0, ws_acc, ws_m, ws_l, gv, sm_m, sm_l,
                        sm_o, sm_w, sm_tot)
            merge_splits(t, nq, head0, num_splits, n_active, out, out0, ws_acc, ws_m, ws_l, counters,
                         counters.shape[0] - 1 - tk, gv, sm_w, sm_tot, sm_last)
        if STAMPS and cuda.threadIdx.x == 0:
            timeline.record(stamp_buf, 5, t_entry, t_wait, t_ready if t_ready != uint64(0) else t_wait, 0)

    return paged_attention_split_kernel


# ------------------------------------------------------------------------------------------------ host
def paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace, *,
                    num_splits: int | None = None, min_split_tokens: int | None = None,
                    geometry: SplitGeometry | None = None, decode: bool = False, gate=None,
                    policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Launch the split-K kernel (``paged_attention``'s arguments, already checked there).  ``num_splits`` /
    ``min_split_tokens`` / ``geometry`` force the launch shape (tests, ``benchmarks/bench_attention.py``); by
    default ``attention_num_splits``, ``min_chunk`` and ``split_geometry``."""
    T, nq, D = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    group = nq // nkv
    if group > 8:
        raise ValueError(f"the split-K kernel serves at most 8 q heads per kv head, got {group}")
    if num_splits is None:
        num_splits = attention_num_splits(T, nkv, block_tables.shape[1] * page_size, D)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} outside 1..{MAX_SPLITS}")
    ws_acc, ws_m, ws_l, counters = split_workspace(workspace, T, nq, nkv, D, num_splits, policy)
    warps, dim_split, walk = geometry or split_geometry(D, group, T * nkv)
    kern = split_kernel(D, group, warps, decode, gate is not None, dim_split, policy.timeline)
    stamps = timeline.buffer() if policy.timeline else timeline.unused()
    items = num_splits * T * nkv
    launch(kern, grid(min(items, walk * sm_count()) if walk else items, sim_cap=64), 32 * warps,
           flat_u32(q), flat_u32(k_cache), flat_u32(v_cache), block_tables, token_slots, positions,
           flat(out), ws_acc, ws_m, ws_l, counters, np.float32(scale * LOG2E), np.int32(nkv),
           np.int32(page_size.bit_length() - 1), np.int32(num_splits), np.int32(min_chunk(min_split_tokens, D)),
           gate if gate is not None else q.reshape(T, nq * D), stamps,
           name="paged_decode_attention" if decode else "paged_attention_split", policy=policy)
