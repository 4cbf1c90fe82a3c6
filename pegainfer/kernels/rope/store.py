"""qk-norm + RoPE + paged KV store, fused: everything between the QKV projection and attention, in one launch.

After the fused QKV projection each token row holds its query heads, then its key heads, then its value heads.
``qk_norm_rope_store`` (``__init__``'s docstring has the math):

* query heads: per-head RMSNorm (``q_norm``), RoPE, written to ``q_out``;
* key heads: per-head RMSNorm (``k_norm``), RoPE, written into the paged KV cache;
* value heads: copied into the paged KV cache.

Rounding: the norm rounds as the model's HF norm (``norm.normalize_element``: ``weight_offset``,
``round_before_weight``), RoPE as HF's bf16 forward (each product rounded to bf16, then their sum).
PDL: the kernel lets the attention after it launch at its start, so attention's blocks read the older keys while
this kernel waits for the projection (``docs/perf/rope.md``).
Geometry: one warp per (token, group of ``heads_per_warp`` heads of one kind): the kernel is latency-bound (a chain
of dependent loads per warp), so a warp keeps several heads' bytes in flight and loads what they share once (the
token's position, slot and cos/sin rows, the norm weights, the KV page); a launch of few tokens (a decode step)
keeps one head per warp, for parallelism (``choose_heads_per_warp``).
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels import timeline
from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import normalize_element
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, bf16_to_f32, cuda, device_fn, f32_to_bf16, float32, global_timer,
                                          grid, grid_dependency_wait, int32, kernel, launch_dependents, math,
                                          reads_before_wait, threads, uint16, warp_sum)

uint64 = np.uint64

QK_NORM_THREADS = 128
"""Threads per block on the GPU: 4 warps, each taking one (token, group of heads) item at a time."""

MAX_HEADS_PER_WARP = 4
"""The most heads a warp takes at once (``choose_heads_per_warp``): 4 heads of D = 128 are 1 KiB in flight."""

MIN_TOKENS_FOR_HEAD_GROUPS = 128
"""Launches of fewer tokens run one head per warp (``choose_heads_per_warp``).  Qwen3-4B heads alone on the H200:
64 tokens 4.3 / 4.2 / 4.6 µs at 1 / 2 / 4 heads a warp, 512 tokens 18.8 / 13.4 / 11.2 (``docs/perf/rope.md``)."""


def choose_heads_per_warp(num_tokens: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Heads per warp of a ``qk_norm_rope_store`` launch: 1 below ``MIN_TOKENS_FOR_HEAD_GROUPS`` tokens, else the
    largest of 4, 2, 1 that divides both head counts (a warp's heads are all q, all k or all v).

    A decode step (or a short chunk) has few tokens: its warps are few, and it overlaps the projection through PDL,
    so parallelism counts more than bytes in flight per warp."""
    if num_tokens < MIN_TOKENS_FOR_HEAD_GROUPS:
        return 1
    hpw = MAX_HEADS_PER_WARP
    while num_q_heads % hpw or num_kv_heads % hpw:
        hpw //= 2
    return hpw


@device_fn
def rope_rotate_pair(lo, hi, cos_bits, sin_bits):
    """HF-rounded rotation of the pair ``(x[i], x[i + half])`` (f32 values of bf16s) by bf16 ``cos``/``sin``:
    returns the bf16 bits of ``out[i]`` and ``out[i + half]``."""
    c = bf16_to_f32(cos_bits)
    s = bf16_to_f32(sin_bits)
    lo_c = bf16_to_f32(f32_to_bf16(lo * c))
    hi_c = bf16_to_f32(f32_to_bf16(hi * c))
    neg_hi_s = bf16_to_f32(f32_to_bf16(-hi * s))
    lo_s = bf16_to_f32(f32_to_bf16(lo * s))
    return f32_to_bf16(lo_c + neg_hi_s), f32_to_bf16(hi_c + lo_s)


@device_fn
def head_inverse_rms(sum_squares, head_dim, eps):
    """``1 / sqrt(Σx² / D + eps)`` of one head (f32), the per-head RMSNorm factor."""
    return float32(1.0) / math.sqrt(sum_squares / float32(head_dim) + eps)


@device_fn
def norm_rope_pair(lo_bits, hi_bits, lo_w, hi_w, inv_rms, weight_offset, round_before_weight, cos_bits, sin_bits):
    """Dims ``p`` and ``p + half`` of a head (bf16 bits, with their norm weights): RMSNorm (``normalize_element``)
    then the HF-rounded rotation; returns the bf16 bits of ``out[p]`` and ``out[p + half]``."""
    lo = bf16_to_f32(normalize_element(bf16_to_f32(lo_bits), inv_rms, lo_w, weight_offset, round_before_weight))
    hi = bf16_to_f32(normalize_element(bf16_to_f32(hi_bits), inv_rms, hi_w, weight_offset, round_before_weight))
    return rope_rotate_pair(lo, hi, cos_bits, sin_bits)


def head_geometry(head_dim: int, rotary_dim: int) -> tuple[int, int]:
    """(dims per lane, pair shift) of a warp holding one head: lane l holds dims ``l + 32 j``; the rotary partner of
    register j is register ``j + shift`` when the rotary half is a multiple of 32, else -1 (re-read it)."""
    half = rotary_dim // 2
    return -(-head_dim // WARP), (half // WARP if half % WARP == 0 else -1)


@functools.cache
def qk_norm_rope_kernel(head_dim: int, rotary_dim: int, heads_per_warp: int = 1, stamps: bool = False):
    """Build the kernel for heads of ``head_dim`` dims, the first ``rotary_dim`` rotated, ``heads_per_warp`` heads
    a warp (compile-time constants: the per-lane register arrays stay in registers, and every bound on a lane's dims
    and heads folds away).  ``stamps``: each block appends its ``timeline`` record."""
    STAMPS = stamps
    HPW = heads_per_warp
    J, SHIFT = head_geometry(head_dim, rotary_dim)
    D = head_dim
    HALF = rotary_dim // 2
    ROT = rotary_dim
    GROUP_DIMS = HPW * J                    # registers a lane holds of its group's heads
    # Which of a lane's registers j hold a dim of the head / a rotary pair / a dim past the rotary ones: compile-time
    # when D, half and rotary_dim are multiples of 32 (every served model), else per lane.
    ALL_DIMS = D % WARP == 0
    HALF_WHOLE, HALF_J = HALF % WARP == 0, HALF // WARP
    ROT_WHOLE, ROT_J = ROT % WARP == 0, ROT // WARP

    @device_fn
    def in_head(j, lane):
        return ALL_DIMS or WARP * j < D - lane

    @device_fn
    def in_half(j, lane):
        return j < HALF_J if HALF_WHOLE else WARP * j < HALF - lane

    @device_fn
    def past_rotary(j, lane):
        return j >= ROT_J if ROT_WHOLE else WARP * j >= ROT - lane

    @reads_before_wait("q_norm_w", "k_norm_w", "cos", "sin", "positions", "token_slots", "block_tables")
    @kernel
    def qk_norm_rope_store_kernel(qkv, row, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables,
                                  pages_per_seq, k_cache, v_cache, page_shift, num_kv_heads, q_out, num_q_heads,
                                  q_head_stride, eps, weight_offset, round_before_weight, stamp_buf):
        """Per-head q/k RMSNorm + RoPE, q to ``q_out``, k and v into the paged KV cache.

        Every tensor is passed flat (1-D, C order), with the sizes its indexing needs:

        qkv          ``[tokens, row]`` bf16 bits: q head ``h`` at columns ``h·q_head_stride .. +D`` (``q_head_stride``
                     is ``D``, or ``2·D`` when a gate follows each q head as in Qwen3.5), then ``nkv`` k heads of ``D``
                     from column ``num_q_heads·q_head_stride``, then ``nkv`` v heads of ``D``
        q_norm_w, k_norm_w ``[D]`` bf16 bits; cos, sin ``[max_len, rotary_dim/2]`` bf16 bits (``rope_tables``)
        positions    ``[tokens]`` int32: the token's position in its sequence (row of cos/sin, place in the cache)
        token_slots  ``[tokens]`` int32: the token's sequence slot (row of ``block_tables``); a negative slot marks a
                     padding token: its q is still written, its k/v are not stored
        block_tables ``[num_slots, pages_per_seq]`` int32: page ids of each slot's KV cache
        k_cache, v_cache ``[num_pages, 2^page_shift, nkv, D]`` bf16 bits; q_out ``[tokens, num_q_heads, D]`` bf16 bits

        Math per head (``r = 1/sqrt(mean(x²) + eps)``): q, k: ``n = normalize_element(x, r, w)`` (norm.py's rounding,
        chosen by ``weight_offset``/``round_before_weight``), then RoPE on ``n`` (``__init__``'s docstring); v: copied.
        Destination of k/v for token t: page ``block_tables[token_slots[t], positions[t] // page_size]``, offset
        ``positions[t] % page_size``.

        Geometry: **one warp per (token, group of HPW heads)**, ``HPW`` (``heads_per_warp``) consecutive heads of
        one kind: a token's ``num_q_heads / HPW`` q groups, then its ``nkv / HPW`` k groups, then its ``nkv / HPW``
        v groups (HPW divides both head counts).  A block holds ``blockDim.x / 32`` warps and the grid strides over
        all (token, group) items.  Lane l holds dims ``l, l + 32, ..`` of each head of its group (``J`` = D / 32
        registers a head) in registers.  The kernel is a chain of dependent memory round trips (position -> cos/sin
        and block table -> the wait -> the heads) and, with few warps per scheduler, of dependent instructions, so:
        a warp moves HPW heads through one chain (HPW times the bytes in flight of a warp of one head), the loads
        its heads share are made once (the token's position and slot, its cos/sin rows, the kind's norm weights,
        the KV page), every load that does not depend on another is issued first, together (norm weights,
        position, slot; then the cos/sin rows and the block-table entry, which need the position; then the values
        of all HPW heads), and every index is unsigned (no negative-index wraparound code) and 64-bit from the
        start, a base per array plus ``32 j`` for register j: one add, or an immediate offset, per access.  Only the
        heads' values come from the kernel before (the projection): with PDL (``launch``) everything else is read
        before ``grid_dependency_wait`` (``reads_before_wait`` above), while the projection finishes, and the
        attention kernel after this one may launch at once (``launch_dependents`` first: its early loads are small).
        Lane l rotates the pairs ``(p, p + half)``, ``p = l, l + 32, ..``: when ``half`` is a multiple of 32 (every
        served model) the partner ``p + half`` is in the same lane's registers; otherwise (tiny test heads) it is
        re-read (an L1 hit).  Every lane of the block runs the same number of items and calls ``warp_sum`` HPW times
        per item (v groups and idle tail warps too), as the simulator's emulated shuffles require.
        """
        t_entry = t_wait = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        launch_dependents()                 # PDL: the attention kernel after this one may start its early loads
        num_tokens = qkv.shape[0] // row
        q_groups = num_q_heads // HPW       # a token's groups: q_groups of q heads, then kv_groups of k, of v
        kv_groups = num_kv_heads // HPW
        groups_per_token = q_groups + 2 * kv_groups
        total = num_tokens * groups_per_token
        eps = float32(eps)
        weight_offset = float32(weight_offset)
        lane = cuda.threadIdx.x % WARP
        ulane = uint64(lane)
        warps_per_block = cuda.blockDim.x // WARP
        k_col0 = num_q_heads * q_head_stride
        v_col0 = k_col0 + num_kv_heads * D
        page_mask = (1 << page_shift) - 1
        x = cuda.local.array(GROUP_DIMS, uint16)    # [HPW, J]: dim lane + 32 j of the group's head i at i·J + j
        w = cuda.local.array(J, uint16)             # the norm weights of dims lane + 32 j (one kind: every head's)
        cs = cuda.local.array(J, uint16)            # cos / sin of the pairs p = lane + 32 j < half (one position)
        sn = cuda.local.array(J, uint16)
        inv_rms = cuda.local.array(HPW, float32)    # [HPW]: the RMSNorm factor of each head of the group

        for first in range(cuda.blockIdx.x * warps_per_block, total, cuda.gridDim.x * warps_per_block):
            item = first + cuda.threadIdx.x // WARP
            active = item < total
            t = min(item // groups_per_token, num_tokens - 1)
            group = item % groups_per_token
            is_q = active and group < q_groups
            is_k = active and group >= q_groups and group < q_groups + kv_groups
            is_v = active and group >= q_groups + kv_groups
            # the group's first head, numbered among the q heads or the kv heads; its columns in the qkv row, and
            # how far apart the group's heads are there
            if is_q:
                first_head = group * HPW
                src = first_head * q_head_stride
                src_step = q_head_stride
            elif is_k:
                first_head = (group - q_groups) * HPW
                src = k_col0 + first_head * D
                src_step = D
            else:
                first_head = (group - q_groups - kv_groups) * HPW
                src = v_col0 + first_head * D
                src_step = D

            # 1. independent loads, all at once: the kind's norm weights, the token's position and slot
            pos = int32(positions[uint64(t)])
            slot = int32(token_slots[uint64(t)])
            for j in range(J):
                if active and in_head(j, lane):
                    if is_q:
                        w[j] = q_norm_w[ulane + uint64(WARP * j)]
                    elif is_k:
                        w[j] = k_norm_w[ulane + uint64(WARP * j)]
            # 2. what needs the position: cos / sin of this lane's pairs, the KV page (both shared by the group)
            if is_q or is_k:
                trig = uint64(pos) * uint64(HALF) + ulane
                for j in range(J):
                    if in_half(j, lane):
                        cs[j] = cos[trig + uint64(WARP * j)]
                        sn[j] = sin[trig + uint64(WARP * j)]
            page = int32(0)
            if (is_k or is_v) and slot >= 0:
                page = int32(block_tables[uint64(slot) * uint64(pages_per_seq) + uint64(pos >> page_shift)])
            grid_dependency_wait()          # PDL: everything above is read-only in a step; the heads are not
            if STAMPS and t_wait == uint64(0):
                t_wait = global_timer()
            # 3. the values of the group's HPW heads, all at once
            head = uint64(t) * uint64(row) + uint64(src) + ulane     # qkv index of dim `lane` of the first head
            head_step = uint64(src_step)                              # + i·head_step: of head i
            if active:
                for i in range(HPW):
                    for j in range(J):
                        if in_head(j, lane):
                            x[i * J + j] = qkv[head + uint64(i) * head_step + uint64(WARP * j)]

            # 4. each head's RMSNorm factor: HPW independent reductions across the warp, with no branch between
            # them so that their shuffles interleave (a v head's factor goes unused)
            for i in range(HPW):
                ss = float32(0.0)
                for j in range(J):
                    if in_head(j, lane):
                        v = bf16_to_f32(x[i * J + j])
                        ss += v * v
                inv_rms[i] = head_inverse_rms(warp_sum(ss), D, eps)
            if not active or (not is_q and slot < 0):
                continue  # idle warp, or a padding token's k/v: nothing to store

            # where dim `lane` of the first head's result goes: q_out row (t, first_head), or the cache row (page,
            # offset, first_head); the group's heads follow it, D apart, in both
            if is_q:
                dst = (uint64(t) * uint64(num_q_heads) + uint64(first_head)) * uint64(D) + ulane
            else:
                dst = (((uint64(page) << uint64(page_shift)) + uint64(pos & page_mask)) * uint64(num_kv_heads)
                       + uint64(first_head)) * uint64(D) + ulane
            if is_v:
                for i in range(HPW):
                    for j in range(J):
                        if in_head(j, lane):
                            v_cache[dst + uint64(i * D + WARP * j)] = x[i * J + j]
                continue

            # 5. q/k: normalize + rotate the first rotary_dim dims of each head, then normalize the rest (two loops
            # over the heads, not one: each small enough to unroll, so that x stays in registers)
            for i in range(HPW):
                out = dst + uint64(i * D)           # q_out / k_cache index of dim `lane` of head i
                for j in range(J):
                    if in_half(j, lane):
                        if SHIFT >= 0:              # the partner dim p + half is in this lane's registers
                            hi_x = x[i * J + min(j + SHIFT, J - 1)]
                            hi_w = w[min(j + SHIFT, J - 1)]
                        else:
                            hi_x = qkv[head + uint64(i) * head_step + uint64(WARP * j + HALF)]
                            hi_w = (q_norm_w if is_q else k_norm_w)[ulane + uint64(WARP * j + HALF)]
                        out_lo, out_hi = norm_rope_pair(x[i * J + j], hi_x, w[j], hi_w, inv_rms[i], weight_offset,
                                                        round_before_weight, cs[j], sn[j])
                        if is_q:
                            q_out[out + uint64(WARP * j)] = out_lo
                            q_out[out + uint64(WARP * j + HALF)] = out_hi
                        else:
                            k_cache[out + uint64(WARP * j)] = out_lo
                            k_cache[out + uint64(WARP * j + HALF)] = out_hi
            for i in range(HPW):
                out = dst + uint64(i * D)
                for j in range(J):
                    if past_rotary(j, lane) and in_head(j, lane):
                        n = normalize_element(bf16_to_f32(x[i * J + j]), inv_rms[i], w[j], weight_offset,
                                              round_before_weight)
                        if is_q:
                            q_out[out + uint64(WARP * j)] = n
                        else:
                            k_cache[out + uint64(WARP * j)] = n
        if STAMPS and cuda.threadIdx.x == 0:
            timeline.record(stamp_buf, 4, t_entry, t_wait, t_wait, 0)

    return qk_norm_rope_store_kernel


def qk_norm_rope_store(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache, v_cache,
                       q_out, eps: float, rotary_dim: int, q_head_stride: int | None = None,
                       weight_offset: float = 0.0, round_before_weight: bool = True, decode: bool = False, *,
                       heads_per_warp: int | None = None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """Fused q/k norm + RoPE + paged KV store (see ``qk_norm_rope_store_kernel``).  ``decode``: a decode step's
    launch, named ``qk_norm_rope_store_decode`` (in the policy's default PDL set); a prompt chunk's is
    ``qk_norm_rope_store``.  ``heads_per_warp``: the heads a warp takes, a divisor of both head counts (tests);
    None: ``choose_heads_per_warp``'s.  ``policy``: how it launches (``policy.py``: PDL, timeline stamps).

    Shapes: qkv ``[T, row]``, q_norm_w/k_norm_w ``[D]``, cos/sin ``[max_len, rotary_dim/2]``, positions/token_slots
    ``[T]`` int32, block_tables ``[slots, pages_per_seq]`` int32, k_cache/v_cache ``[pages, page_size, nkv, D]``,
    q_out ``[T, nq, D]``; bf16 tensors are uint16 device arrays.  ``q_head_stride`` defaults to ``D``.
    Qwen3: defaults; Qwen3.5: ``q_head_stride=2*D, weight_offset=1.0, round_before_weight=False``.
    """
    num_tokens, num_q_heads, head_dim = q_out.shape
    num_kv_heads = k_cache.shape[2]
    if q_head_stride is None:
        q_head_stride = head_dim
    check_store_args(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache, v_cache,
                     q_out, rotary_dim, q_head_stride)
    if num_tokens == 0:
        return
    if heads_per_warp is None:
        heads_per_warp = choose_heads_per_warp(num_tokens, num_q_heads, num_kv_heads)
    assert heads_per_warp > 0 and num_q_heads % heads_per_warp == 0 and num_kv_heads % heads_per_warp == 0, \
        (heads_per_warp, num_q_heads, num_kv_heads)
    page_size = k_cache.shape[1]
    block = threads(gpu=QK_NORM_THREADS, sim=32)
    warps_per_block = block // WARP
    items = num_tokens * (num_q_heads + 2 * num_kv_heads) // heads_per_warp     # (token, group of heads)
    kern = qk_norm_rope_kernel(head_dim, rotary_dim, heads_per_warp, policy.timeline)
    flat = lambda a: a.reshape(a.size)
    launch(kern, grid(items, per_block=warps_per_block, sim_cap=8), block,
           flat(qkv), np.int32(qkv.shape[1]), q_norm_w, k_norm_w, flat(cos), flat(sin), positions, token_slots,
           flat(block_tables), np.int32(block_tables.shape[1]), flat(k_cache), flat(v_cache),
           np.int32(page_size.bit_length() - 1), np.int32(num_kv_heads), flat(q_out), np.int32(num_q_heads),
           np.int32(q_head_stride), np.float32(eps), np.float32(weight_offset), bool(round_before_weight),
           timeline.buffer() if policy.timeline else timeline.unused(),
           name="qk_norm_rope_store_decode" if decode else "qk_norm_rope_store", policy=policy)


def check_store_args(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, block_tables, k_cache, v_cache,
                     q_out, rotary_dim, q_head_stride) -> None:
    """The dtypes, shapes and layouts ``qk_norm_rope_store`` (and its reference) need."""
    num_tokens, num_q_heads, head_dim = q_out.shape
    num_kv_heads = k_cache.shape[2]
    for name, a in (("qkv", qkv), ("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w), ("cos", cos), ("sin", sin),
                    ("k_cache", k_cache), ("v_cache", v_cache), ("q_out", q_out)):
        assert a.dtype == np.uint16, (name, a.dtype)
    for name, a in (("positions", positions), ("token_slots", token_slots), ("block_tables", block_tables)):
        assert a.dtype == np.int32, (name, a.dtype)
    assert qkv.ndim == 2 and qkv.shape[0] == num_tokens, (qkv.shape, q_out.shape)
    assert q_head_stride >= head_dim
    assert qkv.shape[1] == num_q_heads * q_head_stride + 2 * num_kv_heads * head_dim, (qkv.shape, q_head_stride)
    assert q_norm_w.shape == (head_dim,) and k_norm_w.shape == (head_dim,), (q_norm_w.shape, k_norm_w.shape)
    assert 0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, (rotary_dim, head_dim)
    assert cos.ndim == 2 and cos.shape[1] == rotary_dim // 2 and sin.shape == cos.shape, (cos.shape, sin.shape)
    assert positions.shape == (num_tokens,) and token_slots.shape == (num_tokens,)
    assert block_tables.ndim == 2
    assert k_cache.ndim == 4 and k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape, \
        (k_cache.shape, v_cache.shape)
    page_size = k_cache.shape[1]
    assert page_size & (page_size - 1) == 0, f"page_size {page_size} must be a power of two"
    for name, a in (("qkv", qkv), ("cos", cos), ("sin", sin), ("block_tables", block_tables), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("q_out", q_out)):
        assert a.is_c_contiguous(), f"{name} must be C-contiguous (the kernel indexes it flat)"
