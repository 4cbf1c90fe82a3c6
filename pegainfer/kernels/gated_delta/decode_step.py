"""The fused decode step: the causal conv + SiLU, the gated delta rule and the gated RMSNorm of one token per
sequence in one launch, with each thread's part of the state in registers.

``gated_delta_decode_step`` computes, bit for bit, what ``conv.causal_conv1d_silu`` → ``reference.
reference_gated_delta`` → ``gated_norm.gated_rms_norm`` compute, in one kernel: the state is read once into
registers, decayed and updated there and written once, and in a decode step (``decode_token_slots``) a block loads
what no kernel of the step writes for its first item before its PDL wait (the kernel's ``reads_before_wait``), so
only the projection's outputs are loaded after it.  A decode step of more (sequence, head) items than SMs runs one
block per SM, which copies its next item's state into shared memory while it works on the current one.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels import timeline
from pegainfer.kernels.gated_delta.common import (COL_TILE, MAX_WARPS, check_bf16, check_positions, check_rule_args,
                                                  gated_norm_value, state_is_bf16, token_decay_beta, token_gates,
                                                  token_qk_scales)
from pegainfer.kernels.gated_delta.conv import conv_output, conv_ring_store, conv_silu
from pegainfer.kernels.gated_delta.reference import RULE_WARPS
from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import inverse_rms
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, bf16_to_f32, bf16x2_hi, bf16x2_lo, bits_f32, bulk_barrier_init,
                                          bulk_copy, bulk_expect_bytes, cuda, device_fn, f32_bits, f32_to_bf16,
                                          float32, global_timer, grid, pack_bf16x2,
                                          grid_dependency_wait, int32, launch_bounded, launch_dependents, load_f32x2,
                                          load_f32x4, math, pdl_prologue, reads_before_wait, sm_count, store_f32x2,
                                          store_f32x4, uint16, uint32, warp_sum)
from pegainfer.kernels.primitives.barriers import mbar_wait

uint64 = np.uint64

DECODE_TILES_PER_THREAD = 2
"""32-column tiles of the state per thread in ``gated_delta_decode_step``.  With Qwen3.5's 128 × 128 heads and
``RULE_WARPS`` = 8: blocks of 512 threads, each holding 16 rows × 2 columns = 32 state values in registers, no
spills (faster than 1 or 4 tiles on the H200: docs/perf/gated_delta.md).  One tile per thread was not bit-identical
to the reference on the GPU (cause unknown), so the GPU tests cover 2 and 4."""

STATE_COPY_BYTES = 16384
"""Bytes per ``cp.async.bulk`` instruction when a decode block copies its next item's state into shared memory."""


def state_bytes_per_head(key_dim: int, value_dim: int, state_bf16: bool = False) -> int:
    """Bytes of one value head's state ``[Dk, Dv]``: f32, or bf16 bits."""
    return key_dim * value_dim * (2 if state_bf16 else 4)


def next_state_prefetch(key_dim: int, value_dim: int, state_bf16: bool = False) -> bool:
    """Whether a decode block copies its next item's state into shared memory while it works on the current one
    (heads of ``key_dim × value_dim``): the bulk copy moves whole 16-byte runs."""
    return state_bytes_per_head(key_dim, value_dim, state_bf16) % 16 == 0


def next_state_shared_bytes(key_dim: int, value_dim: int, state_bf16: bool = False) -> int:
    """Dynamic shared memory of the decode kernel: one item's state ``[Dk, Dv]`` and its mbarrier (8 bytes)."""
    prefetch = next_state_prefetch(key_dim, value_dim, state_bf16)
    return state_bytes_per_head(key_dim, value_dim, state_bf16) + 8 if prefetch else 0


if SIMULATOR:
    @device_fn
    def opaque(x):
        """``x`` itself (the simulator has no optimizer to hide it from)."""
        return x
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _opaque_f32(typingctx, x):
        """``mov.b32``: an f32 passed through unchanged, as a value the compiler cannot see through."""
        if x != types.float32:
            return None
        sig = types.float32(types.float32)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            return builder.call(ir.InlineAsm(ir.FunctionType(f32, [f32]), "mov.b32 $0, $1;", "=f,f"), [args[0]])

        return sig, codegen

    @device_fn
    def opaque(x):
        """``x`` (f32) unchanged, but hidden from the optimizer: ``opaque(s) * decay`` is a product of its own,
        never merged with another ``s * decay`` (which would change how the compiler fuses it into an FMA)."""
        return _opaque_f32(x)


@device_fn
def _head_channel(c, hk, h, key_dim, value_dim, k_base, v_base):
    """Channel of ``x`` (the conv's input) for a block's local channel ``c``: ``c < Dk`` the q channels of key head
    ``hk``, then its ``Dk`` k channels, then the v channels of value heads ``h, h+1, ..``."""
    if c < key_dim:
        return hk * key_dim + c
    if c < 2 * key_dim:
        return k_base + hk * key_dim + (c - key_dim)
    return v_base + h * value_dim + (c - 2 * key_dim)


@functools.cache
def _decode_step_kernel(key_dim: int, value_dim: int, heads_per_key: int, row_groups: int, tiles_per_thread: int,
                        decode: bool = False, taps: int = 4, stamps: bool = False, state_bf16: bool = False):
    """Build the fused decode step for heads of ``key_dim × value_dim``, ``heads_per_key`` value heads a key head,
    ``row_groups`` key-row classes (the summation order of ``reference_gated_delta`` with that many warps) and
    ``tiles_per_thread`` 32-column tiles per thread.  All are compile-time constants: the per-thread state is a
    register array of ``ceil(Dk / row_groups) · tiles_per_thread`` f32 whose loops unroll, with the head dims known
    every state element's address is one base register plus an immediate offset, and a value head's key head is a
    shift rather than a division.  ``decode``: every sequence is one token and sequence ``b`` is token ``b``; a
    block loads its first item's state, slot, position and head parameters before the PDL wait and keeps them (no
    re-reads after it), and computes the token's decay and write strength as soon as ``a`` and ``b`` arrive, while
    the conv runs (the same operations: the same bits);
    ``taps``: the conv's kernel size (decode mode holds a thread's conv weights and older inputs in registers);
    ``stamps``: each block appends its ``timeline`` record (ready: its first item's outputs written);
    ``state_bf16``: the state is kept as bf16 bits, and the kernel takes it as f32 *words* (each the bits of two bf16
    columns ``2w, 2w+1``, ``state_words``), widens what it loads and rounds what it stores; a thread's columns come in
    pairs (``tiles_per_thread`` even), so every word it stores is its own."""
    STAMPS = stamps
    BF16_STATE = state_bf16
    assert not state_bf16 or (tiles_per_thread % 2 == 0 and value_dim % 2 == 0), (tiles_per_thread, value_dim)
    DECODE = decode
    KD = key_dim
    VD = value_dim
    HPK = heads_per_key
    R = row_groups
    TPT = tiles_per_thread
    ROWS = -(-KD // R)           # key rows per thread: row_class, row_class + R, ...
    REGS = ROWS * TPT            # (array sizes must be closure constants, not expressions)
    QK_WORDS = 2 * KD
    tiles = -(-VD // COL_TILE)
    NT = R * -(-tiles // TPT) * WARP     # threads per block
    CONV_CHANNELS = 2 * KD + VD          # the q, k channels of a key head and the v channels of a value head
    ALL_ROWS = KD % R == 0               # every thread's rows / columns exist: no guards (Qwen3.5: both)
    ALL_COLS = VD % (TPT * WARP) == 0
    TAPS = taps
    CONV_ROUNDS = -(-CONV_CHANNELS // NT)   # conv channels per thread (block-strided)
    CONV_REGS = CONV_ROUNDS * TAPS
    OUT_ROUNDS = -(-VD // NT)               # output columns per thread (block-strided)
    VEC = TPT if TPT in (2, 4) and ALL_COLS else 1   # a thread's columns moved by one 8- / 16-byte access
    PARTIAL = R * VD                        # the per-row-class column sums in shared memory, [R, Dv]
    PREFETCH = DECODE and next_state_prefetch(KD, VD, state_bf16)   # the next item's state into shared memory
    STATE_WORDS = state_bytes_per_head(KD, VD, state_bf16) // 4
    BAR = STATE_WORDS                       # the copy's mbarrier: the two words after the state (8-byte aligned)
    COPY_WORDS = STATE_COPY_BYTES // 4
    COPIES = -(-STATE_WORDS // COPY_WORDS)

    @device_fn
    def next_item(seq, head, stride_seqs, stride_heads, num_v_heads):
        """The (sequence, value head) of the item ``gridDim`` items after item (``seq``, ``head``), the stride
        split as ``stride_seqs · Hv + stride_heads``: items are numbered ``seq · Hv + head``, and a block visits
        every ``gridDim``-th one (no division in the item loop)."""
        head += stride_heads
        seq += stride_seqs
        if head >= num_v_heads:
            head -= num_v_heads
            seq += 1
        return seq, head

    @device_fn
    def state_rows(ssm_state, base, state, row_class, first_col, store):
        """Load (``store`` False) or store this thread's state ``state[m·ROWS + i] = S[row_class + R·i,
        first_col + m]``, which sits at element ``base + R·i·Dv + m``: one ``VEC``-wide access per row (a bf16
        state: ``state_pairs``)."""
        if BF16_STATE:
            state_pairs(ssm_state, base, state, row_class, first_col, store)
            return
        for i in range(ROWS):
            if ALL_ROWS or row_class + R * i < KD:
                at = base + uint64(R * i * VD)
                if VEC == 4:
                    if store:
                        store_f32x4(ssm_state, at, state[i], state[ROWS + i], state[2 * ROWS + i],
                                    state[3 * ROWS + i])
                    else:
                        state[i], state[ROWS + i], state[2 * ROWS + i], state[3 * ROWS + i] = load_f32x4(ssm_state,
                                                                                                         at)
                elif VEC == 2:
                    if store:
                        store_f32x2(ssm_state, at, state[i], state[ROWS + i])
                    else:
                        state[i], state[ROWS + i] = load_f32x2(ssm_state, at)
                else:
                    for m in range(TPT):
                        if ALL_COLS or first_col + m < VD:
                            if store:
                                ssm_state[at + uint64(m)] = state[m * ROWS + i]
                            else:
                                state[m * ROWS + i] = ssm_state[at + uint64(m)]

    @device_fn
    def state_pairs(state_words, base, state, row_class, first_col, store):
        """``state_rows`` of a bf16 state seen as words: element ``e`` is half ``e % 2`` of word ``e // 2``.  A
        thread's ``TPT`` columns are ``TPT / 2`` whole words from an even column: 8 bytes at once for 4 columns."""
        for i in range(ROWS):
            if ALL_ROWS or row_class + R * i < KD:
                at = (base + uint64(R * i * VD)) >> uint64(1)
                if VEC == 4:
                    if store:
                        store_f32x2(state_words, at, bits_f32(pack_bf16x2(state[i], state[ROWS + i])),
                                    bits_f32(pack_bf16x2(state[2 * ROWS + i], state[3 * ROWS + i])))
                    else:
                        w0, w1 = load_f32x2(state_words, at)
                        u0, u1 = f32_bits(w0), f32_bits(w1)
                        state[i], state[ROWS + i] = bf16x2_lo(u0), bf16x2_hi(u0)
                        state[2 * ROWS + i], state[3 * ROWS + i] = bf16x2_lo(u1), bf16x2_hi(u1)
                else:
                    for p in range(TPT // 2):
                        if ALL_COLS or first_col + 2 * p < VD:       # (Dv even: the pair's second column too)
                            if store:
                                state_words[at + uint64(p)] = bits_f32(pack_bf16x2(state[2 * p * ROWS + i],
                                                                                   state[(2 * p + 1) * ROWS + i]))
                            else:
                                u = f32_bits(state_words[at + uint64(p)])
                                state[2 * p * ROWS + i] = bf16x2_lo(u)
                                state[(2 * p + 1) * ROWS + i] = bf16x2_hi(u)

    @device_fn
    def store_cols(dst, at, vals, first_col):
        """``dst[at + m] = vals[m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            store_f32x4(dst, at, vals[0], vals[1], vals[2], vals[3])
        elif VEC == 2:
            store_f32x2(dst, at, vals[0], vals[1])
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    dst[at + uint64(m)] = vals[m]

    @device_fn
    def load_cols(src, at, vals, first_col):
        """``vals[m] = src[at + m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            vals[0], vals[1], vals[2], vals[3] = load_f32x4(src, at)
        elif VEC == 2:
            vals[0], vals[1] = load_f32x2(src, at)
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    vals[m] = src[at + uint64(m)]

    @device_fn
    def add_cols(src, at, vals, first_col):
        """``vals[m] += src[at + m]`` for this thread's columns ``first_col + m`` (shared memory)."""
        if VEC == 4:
            x0, x1, x2, x3 = load_f32x4(src, at)
            vals[0] += x0
            vals[1] += x1
            vals[2] += x2
            vals[3] += x3
        elif VEC == 2:
            x0, x1 = load_f32x2(src, at)
            vals[0] += x0
            vals[1] += x1
        else:
            for m in range(TPT):
                if ALL_COLS or first_col + m < VD:
                    vals[m] += src[at + uint64(m)]

    @device_fn
    def decode_prefetch(conv_weight, conv_state, norm_weight, slot, pos, h, hk, k_base, v_base, wts, hist, nw):
        """Decode mode: what this thread's conv channels and output columns need besides the projection's
        outputs -- the conv weights ``wts[r·K + k]``, the ring's older inputs ``hist[r·K + k]`` (``k < K-1``:
        positions ``pos - (K-1) + k``, zero below 0) and the norm weights ``nw[r]`` -- all read by no kernel of the
        step, so they may be loaded before the PDL wait."""
        tid = cuda.threadIdx.x
        for r in range(CONV_ROUNDS):
            c = r * NT + tid
            if c < CONV_CHANNELS:
                ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                for k in range(TAPS):
                    wts[r * TAPS + k] = conv_weight[ch, k]
                    p = pos - (TAPS - 1) + k
                    if k < TAPS - 1:
                        hist[r * TAPS + k] = conv_state[slot, ch, p % TAPS] if p >= 0 else uint16(0)
        for r in range(OUT_ROUNDS):
            j = r * NT + tid
            if j < VD:
                nw[r] = norm_weight[j]

    @device_fn
    def copy_next_state(next_state, bars, ssm_state, token_slots, seq, head, num_seqs, num_v_heads):
        """Thread 0 of a decode block: start copying the state ``S [Dk, Dv]`` (contiguous: ``STATE_WORDS`` words) of
        item (``seq``, ``head``) into ``next_state`` with the copy engine, counted on the mbarrier at ``bars[BAR]``.
        Nothing past
        the last sequence or for a padding token (padding is last: no later item of the block has a state then
        either)."""
        if seq < num_seqs:
            slot = token_slots[seq]
            if slot >= 0:
                src = uint64(slot * num_v_heads + head) * uint64(STATE_WORDS)
                bulk_expect_bytes(bars, BAR, uint32(STATE_WORDS * 4))
                for c in range(COPIES):
                    bulk_copy(next_state, uint32(c * COPY_WORDS), ssm_state, src + uint64(c * COPY_WORDS),
                              uint32(min(COPY_WORDS, STATE_WORDS - c * COPY_WORDS) * 4), bars, BAR)

    # decode: what a block reads for its first item before the PDL wait (no kernel of the step writes it)
    early_reads = ("ssm_state", "conv_weight", "conv_state", "norm_weight", "a_log", "dt_bias", "positions",
                   "token_slots") if DECODE else ()

    @reads_before_wait(*early_reads)
    @launch_bounded(NT)
    def gated_delta_decode_step_kernel(x, conv_weight, conv_state, z, a, b, a_log, dt_bias, norm_weight, eps,
                                       ssm_state, slot_ids, token_offsets, positions, token_slots, out, stamp_buf):
        """One Gated DeltaNet step after in_proj, for sequences of one token: conv + SiLU, the delta rule and the
        gated RMSNorm in one launch, bit-identical to ``causal_conv1d_silu`` → ``reference_gated_delta`` (with
        ``row_groups`` warps) → ``gated_rms_norm``.

        x ``[tokens, 2·Hk·Dk + Hv·Dv]`` bf16 (in_proj_qkv output: q | k | v before the conv), conv_weight
        ``[2·Hk·Dk + Hv·Dv, K]`` bf16, conv_state ``[slots, 2·Hk·Dk + Hv·Dv, K]`` bf16 (the ring, ``conv.py``),
        z ``[tokens, Hv·Dv]``, a, b ``[tokens, Hv]`` bf16, a_log, dt_bias ``[Hv]`` f32, norm_weight
        ``[Dv]`` bf16, eps f32, ssm_state ``[slots · Hv · Dk · Dv]`` f32 (``[slots, Hv, Dk, Dv]`` seen flat; a
        bf16 state: its words, ``state_pairs``),
        slot_ids ``[B]``, token_offsets ``[B+1]``, positions ``[tokens]`` int32, out ``[tokens, Hv·Dv]`` bf16.
        Per token and value head ``h`` (key head ``hk = h // (Hv/Hk)``)::

            q, k, v = bf16(silu(bf16(conv(x))))      q, k: channels of hk; v: channels of h; ring updated
            S = S·exp(g);  delta = (v − Sᵀk̂)·beta;  S += k̂ ⊗ delta;  o = bf16(Sᵀq̂)     (k̂, q̂ l2-normalised)
            out = bf16(bf16(w · bf16(o · rms(o)⁻¹)) · silu(z))

        Rows of padding tokens (after the last sequence, ``token_offsets[B]:``, and those of a padding sequence,
        slot -1) get the gated norm of a zero row (what the three kernels leave there).  Sequences of several tokens (a prompt scored row by row) are also exact:
        one block per key head then runs its value heads one after another (below).

        Geometry: one block per (sequence, value head), grid-strided (decode: at most one per SM, below), of
        ``row_groups`` warps per ``tiles_per_thread`` 32-column tiles (Qwen3.5: 8 row classes × 2 column groups =
        16 warps).  Warp ``w``
        owns key rows ``d ≡ w mod row_groups`` and, in column group ``c = w // row_groups``, ``tiles_per_thread``
        tiles of 32 columns: lane ``l`` holds the ``T = tiles_per_thread`` consecutive columns ``32·T·c + T·l + m``,
        which it loads and stores with one 8- or 16-byte access per row (T = 2 or 4), i.e. ``S[d, j]`` for ``d``
        in its row class: read once into registers (issued before the conv, whose loads they overlap), decayed and
        updated there, written once.  The block first computes the conv of the 2·Dk q/k and Dv v channels it needs
        (threads stride over channels; the two value heads of a key head both compute its q/k: cheap), then every
        warp its own l2 norms (as the reference kernel, one warp reduction each), then the column sums ``Sᵀk`` and
        ``Sᵀq``: per thread over its rows, then over the row classes in order through shared memory (the reference
        kernel's order).  With the head's Dv outputs in shared memory, every warp reduces their squares the way
        ``gated_rms_norm`` does and threads stride over the columns for the output.  Four barriers per token.

        Conv ring: a one-token step reads entries ``(p−K+1 .. p−1) % K`` and writes entry ``p % K``; two blocks
        sharing a key head write the same q/k values there, and neither reads it, so their lack of order is
        harmless.  A longer sequence would overwrite entries the other block may still read, so for ``n > 1``
        tokens the block of the first value head of each key head does all of them (the others skip) and writes
        the ring last.

        PDL: without ``decode`` the kernel lets the next one launch and waits for the previous one at its start.
        With ``decode`` (a decode step: sequence ``b`` is token ``b``, its slot ``token_slots[b]`` and position
        ``positions[b]``, which the host wrote before the step; ``slot_ids`` / ``token_offsets`` are then not read)
        a block first loads what no kernel of the step writes for its first item (``reads_before_wait`` above; of
        the conv ring only the older inputs) into registers, then waits for the projection and issues its loads
        of ``x``, ``a``, ``b`` and ``z`` together: one memory round trip after the wait.  It lets the next kernel
        (the preloaded out_proj) launch once those loads have arrived, so that out_proj's weight copies do not
        compete with them for HBM (faster than releasing at the start or after the outputs on the H200:
        docs/perf/gated_delta.md).

        Streaming the state (``decode``): a block holds one item's state at a time and only one block fits an SM
        (its registers), so with more items than SMs the launch is one block per SM, each running the items
        ``blockIdx, blockIdx + SMs, ..`` while the next one's state ``[Dk, Dv]`` (64 KB, contiguous) streams into
        dynamic shared memory: thread 0 starts ``cp.async.bulk`` copies of it on an mbarrier (the second item's
        before the PDL wait, each later one once every thread has moved the current item's state from shared
        memory into registers, i.e. after the conv's barrier), and a later item waits on the barrier's next phase
        instead of a round trip to HBM.  The HBM reads of item ``i + 1`` thus overlap the arithmetic and the state
        writes of item ``i``.
        """
        t_entry = t_wait = t_ready = uint64(0)
        if STAMPS:
            t_entry = global_timer()
        if not DECODE:
            pdl_prologue()
        num_v_heads = a_log.shape[0]
        k_base = (num_v_heads // HPK) * KD      # the k channels of x (after every key head's q)
        v_base = 2 * k_base
        q_scale = float32(1.0) / float32(math.sqrt(float32(KD)))
        eps = float32(eps)

        qk_s = cuda.shared.array(QK_WORDS, float32)              # this token's q then k (f32 of the bf16 conv outputs)
        # (16-byte aligned: the vector accesses of store_cols / load_cols / add_cols)
        v_s = cuda.shared.array(VD, float32, alignment=16)       # its v for head h
        o_s = cuda.shared.array(VD, float32)                     # the rule's outputs (bf16 values)
        partial_kv = cuda.shared.array(PARTIAL, float32, alignment=16)    # [R, Dv] per row class: Σ_d S·decay·k̂
        partial_out = cuda.shared.array(PARTIAL, float32, alignment=16)   # [R, Dv] per row class: Σ_d S·q̂
        state = cuda.local.array(REGS, float32)                  # state[m·ROWS + i] = S[row_class + R·i, col m]
        next_state = cuda.shared.array(0, nbtypes.float32)   # decode: the next item's state [Dk, Dv] (dynamic)
        bars = cuda.shared.array(0, nbtypes.uint32)          # the same bytes as words: its mbarrier at BAR
        col_acc = cuda.local.array(TPT, float32)                 # per column of the thread: its partial sum
        col_delta = cuda.local.array(TPT, float32)               # per column: kv_mem, then delta
        col_v = cuda.local.array(TPT, float32)                   # per column: v

        # Indices into shared memory and the state are unsigned (no negative-index wraparound code) and the
        # block-stride loops step by the compile-time block size: every address is then a base register plus an
        # immediate, and nothing else is computed ahead and kept live across the loops (which costs registers).
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        row_class = warp % R
        first_col = (warp // R) * (TPT * WARP) + lane * TPT     # this thread's columns: first_col + m
        u_tid = uint64(tid)
        u_row = uint64(row_class)
        u_col = uint64(first_col)
        num_seqs = slot_ids.shape[0]
        seq = cuda.blockIdx.x // num_v_heads              # the block's first item: (sequence, first value head)
        first_head = cuda.blockIdx.x % num_v_heads
        stride_seqs = cuda.gridDim.x // num_v_heads      # the block's item stride as (sequences, heads)
        stride_heads = cuda.gridDim.x % num_v_heads

        wts = cuda.local.array(CONV_REGS, uint16)     # decode: this thread's conv weights [round, tap]
        hist = cuda.local.array(CONV_REGS, uint16)    # decode: their older inputs (taps < K-1)
        xin = cuda.local.array(CONV_ROUNDS, uint16)   # decode: this token's inputs of those channels
        zin = cuda.local.array(OUT_ROUNDS, uint16)    # decode: z of this thread's output columns
        nw = cuda.local.array(OUT_ROUNDS, uint16)     # decode: their norm weights
        inv_rms_zero = inverse_rms(float32(0.0), VD, eps)

        pre = False  # decode: the block's first item was loaded before the wait
        pre_slot = pre_pos = int32(0)
        pre_a_log = pre_dt_bias = decay = beta = float32(0.0)
        if DECODE:
            if cuda.blockIdx.x < num_seqs * num_v_heads:
                pre_slot = token_slots[seq]
                if pre_slot >= 0:
                    pre = True
                    pre_pos = positions[seq]
                    pre_a_log = float32(a_log[first_head])
                    pre_dt_bias = float32(dt_bias[first_head])
                    base = uint64(((pre_slot * num_v_heads + first_head) * KD + row_class) * VD + first_col)
                    state_rows(ssm_state, base, state, row_class, first_col, False)
                    decode_prefetch(conv_weight, conv_state, norm_weight, pre_slot, pre_pos, first_head,
                                    first_head // HPK, k_base, v_base, wts, hist, nw)
            if PREFETCH and tid == 0:   # the second item's state streams in while the first is worked on
                bulk_barrier_init(bars, BAR)
                second_seq, second_head = next_item(seq, first_head, stride_seqs, stride_heads, num_v_heads)
                copy_next_state(next_state, bars, ssm_state, token_slots, second_seq, second_head, num_seqs,
                                num_v_heads)
            grid_dependency_wait()
            if STAMPS:
                t_wait = global_timer()
        else:
            # padding rows: the rule's zeros through the gated norm
            first_pad = token_offsets[num_seqs]
            width = out.shape[1]
            for idx in range(cuda.blockIdx.x * NT + tid, (out.shape[0] - first_pad) * width, cuda.gridDim.x * NT):
                row = first_pad + idx // width
                col = idx % width
                out[row, col] = gated_norm_value(float32(0.0), inv_rms_zero, norm_weight[col % VD], z[row, col])

        phase = uint32(0)   # parity of the next_state copy's mbarrier phase a later item waits for
        for item in range(cuda.blockIdx.x, num_seqs * num_v_heads, cuda.gridDim.x):
            if item != cuda.blockIdx.x:
                seq, first_head = next_item(seq, first_head, stride_seqs, stride_heads, num_v_heads)
            kept = DECODE and pre and item == cuda.blockIdx.x   # what was read before the wait still holds
            heads = 1
            if DECODE:
                slot = pre_slot if kept else token_slots[seq]
                if slot < 0:  # a padding token: the rule's zeros through the gated norm
                    for r in range(OUT_ROUNDS):
                        j = r * NT + tid
                        if j < VD:
                            col = first_head * VD + j
                            out[seq, col] = gated_norm_value(float32(0.0), inv_rms_zero, norm_weight[j],
                                                             z[seq, col])
                    continue
                start = seq
                n = 1
            else:
                start = token_offsets[seq]
                n = token_offsets[seq + 1] - start
                slot = slot_ids[seq]
                if slot < 0:  # a padding sequence (``state.sequence_table``): the rule's zeros through the norm
                    for idx in range(tid, max(n, 0) * VD, NT):
                        pad_t = start + idx // VD
                        pad_col = first_head * VD + idx % VD
                        out[pad_t, pad_col] = gated_norm_value(float32(0.0), inv_rms_zero, norm_weight[idx % VD],
                                                               z[pad_t, pad_col])
                    continue
                if n > 1:
                    heads = HPK if first_head % HPK == 0 else 0
                if n <= 0 or heads == 0:
                    continue  # uniform across the block: an empty sequence leaves its slot alone
            first_pos = pre_pos if kept else positions[start]
            hk = first_head // HPK
            # one (head, token) per step: a single step for a decode token
            for step in range(heads * n):
                h = first_head          # decode: one token of one head
                t = start
                if not DECODE:
                    h += step // n
                    t += step % n
                # this thread's S[row_class + R·i, first_col + m] sits at base + R·i·Dv + m
                base = uint64(((slot * num_v_heads + h) * KD + row_class) * VD + first_col)
                loaded = pre and item == cuda.blockIdx.x
                if t == start and not loaded:  # the head's first token: its state into registers, ahead of the conv
                    if PREFETCH:   # a decode block's later item: its state has been copied into shared memory
                        mbar_wait(bars, BAR, phase)
                        phase ^= uint32(1)
                        state_rows(next_state, uint64(row_class * VD + first_col), state, row_class, first_col,
                                   False)
                    else:
                        state_rows(ssm_state, base, state, row_class, first_col, False)
                # conv + SiLU of the channels this head reads
                if DECODE:
                    if not loaded:    # a later item of the block (one block an SM, or a capped grid)
                        decode_prefetch(conv_weight, conv_state, norm_weight, slot, first_pos, h, hk, k_base,
                                        v_base, wts, hist, nw)
                    a_t = a[t, h]
                    b_t = b[t, h]
                    # the token's decay and write strength while the conv runs
                    decay, beta = token_decay_beta(a_t, b_t, pre_a_log if kept else a_log[h],
                                                   pre_dt_bias if kept else dt_bias[h])
                    for r in range(OUT_ROUNDS):
                        if r * NT + tid < VD:
                            zin[r] = z[t, h * VD + r * NT + tid]
                    for r in range(CONV_ROUNDS):
                        c = r * NT + tid
                        if c < CONV_CHANNELS:
                            ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                            xin[r] = x[t, ch]
                            acc = float32(0.0)   # conv_silu's sum, in its order: the older inputs, then x
                            for k in range(TAPS - 1):
                                acc += bf16_to_f32(wts[r * TAPS + k]) * bf16_to_f32(hist[r * TAPS + k])
                            acc += bf16_to_f32(wts[r * TAPS + TAPS - 1]) * bf16_to_f32(xin[r])
                            val = bf16_to_f32(conv_output(acc))
                            if c < 2 * KD:
                                qk_s[uint64(c)] = val
                            else:
                                v_s[uint64(c - 2 * KD)] = val
                    launch_dependents()     # every load that waited for in_proj has arrived: out_proj may start
                else:
                    for c0 in range(0, CONV_CHANNELS, NT):
                        c = c0 + tid
                        if c < CONV_CHANNELS:
                            ch = _head_channel(c, hk, h, KD, VD, k_base, v_base)
                            val = bf16_to_f32(conv_silu(x, conv_weight, conv_state, slot, ch, start, t - start,
                                                        first_pos))
                            if c < 2 * KD:
                                qk_s[uint64(c)] = val
                            else:
                                v_s[uint64(c - 2 * KD)] = val
                    a_t = a[t, h]
                    b_t = b[t, h]
                cuda.syncthreads()
                if PREFETCH and tid == 0 and not loaded:   # every thread holds its part: refill next_state
                    after_seq, after_head = next_item(seq, first_head, stride_seqs, stride_heads, num_v_heads)
                    copy_next_state(next_state, bars, ssm_state, token_slots, after_seq, after_head, num_seqs,
                                    num_v_heads)
                # l2 norms (every warp, as the reference kernel), decay, write strength (decode: computed above)
                ssq = float32(0.0)
                ssk = float32(0.0)
                for d0 in range(0, KD, WARP):
                    if d0 + lane < KD:
                        qv = qk_s[uint64(d0 + lane)]
                        kv = qk_s[uint64(KD + d0 + lane)]
                        ssq += qv * qv
                        ssk += kv * kv
                if DECODE:
                    q_mul, k_mul = token_qk_scales(ssq, ssk, q_scale)
                else:
                    q_mul, k_mul, decay, beta = token_gates(ssq, ssk, q_scale, a_t, b_t, a_log[h], dt_bias[h])

                # pass 1: this thread's part of kv_mem = (S·decay)ᵀ k̂ (expressions as in the reference kernel).  Rows
                # outermost: each k̂_d is read once for all of the thread's columns (summed in row order per column).
                for m in range(TPT):
                    col_acc[m] = float32(0.0)
                for i in range(ROWS):
                    if ALL_ROWS or row_class + R * i < KD:
                        k_d = qk_s[u_row + uint64(KD + R * i)] * k_mul
                        for m in range(TPT):
                            if ALL_COLS or first_col + m < VD:
                                col_acc[m] += state[m * ROWS + i] * decay * k_d
                store_cols(partial_kv, u_row * uint64(VD) + u_col, col_acc, first_col)
                cuda.syncthreads()

                # pass 2: S = S·decay + k̂ ⊗ delta and this thread's part of Sᵀq̂.  ``opaque``: the reference
                # kernel reloads S here, so its S·decay is a product of its own, contracted with the add
                # (fma(S, decay, k̂·delta)); merged with pass 1's S·decay it would be rounded first instead.
                for m in range(TPT):
                    col_delta[m] = float32(0.0)
                    col_v[m] = float32(0.0)
                for w in range(R):              # kv_mem of each column: the row classes' parts, in order
                    add_cols(partial_kv, uint64(w * VD) + u_col, col_delta, first_col)
                load_cols(v_s, u_col, col_v, first_col)
                for m in range(TPT):
                    col_delta[m] = (col_v[m] - col_delta[m]) * beta
                    col_acc[m] = float32(0.0)
                for i in range(ROWS):
                    if ALL_ROWS or row_class + R * i < KD:
                        k_d = qk_s[u_row + uint64(KD + R * i)] * k_mul
                        q_d = qk_s[u_row + uint64(R * i)] * q_mul
                        for m in range(TPT):
                            if ALL_COLS or first_col + m < VD:
                                s_new = opaque(state[m * ROWS + i]) * decay + k_d * col_delta[m]
                                state[m * ROWS + i] = s_new
                                col_acc[m] += s_new * q_d
                store_cols(partial_out, u_row * uint64(VD) + u_col, col_acc, first_col)
                cuda.syncthreads()
                for j0 in range(0, VD, NT):
                    if j0 + tid < VD:
                        j = uint64(j0) + u_tid
                        o = float32(0.0)
                        for w in range(R):
                            o += partial_out[uint64(w * VD) + j]
                        o_s[j] = bf16_to_f32(f32_to_bf16(o))
                cuda.syncthreads()

                # gated RMSNorm of the head's Dv outputs (every warp reduces them as gated_rms_norm_kernel)
                ss = float32(0.0)
                for i0 in range(0, VD, WARP):
                    if i0 + lane < VD:
                        ov = o_s[uint64(i0 + lane)]
                        ss += ov * ov
                inv_rms = inverse_rms(warp_sum(ss), VD, eps)
                for r in range(OUT_ROUNDS):
                    j = r * NT + tid
                    if j < VD:
                        col = h * VD + j
                        if DECODE:
                            out[t, col] = gated_norm_value(o_s[uint64(j)], inv_rms, nw[r], zin[r])
                        else:
                            out[t, col] = gated_norm_value(o_s[uint64(j)], inv_rms, norm_weight[j], z[t, col])
                if STAMPS and t_ready == uint64(0):
                    t_ready = global_timer()

                if t == start + n - 1:  # the head's last token: its state back
                    state_rows(ssm_state, base, state, row_class, first_col, True)
            cuda.syncthreads()  # every read of the slot's old ring entries by this block is done
            if DECODE:          # the token's inputs, still in registers, at entry position % K
                for r in range(CONV_ROUNDS):
                    c = r * NT + tid
                    if c < CONV_CHANNELS:
                        ch = _head_channel(c, hk, first_head, KD, VD, k_base, v_base)
                        conv_state[slot, ch, first_pos % TAPS] = xin[r]
            else:
                for c in range(tid, 2 * KD + heads * VD, NT):
                    ch = _head_channel(c, hk, first_head, KD, VD, k_base, v_base)
                    conv_ring_store(x, conv_state, slot, ch, start, n, first_pos)
        if STAMPS and tid == 0:
            t_wait = t_wait if t_wait != uint64(0) else t_entry
            timeline.record(stamp_buf, 6, t_entry, t_wait, t_ready if t_ready != uint64(0) else t_wait, 0)

    return gated_delta_decode_step_kernel


def gated_delta_decode_step(x, conv_weight, conv_state, z, a, b, a_log, dt_bias, norm_weight, eps: float,
                            ssm_state, slot_ids, token_offsets, positions, out, row_groups: int = RULE_WARPS,
                            tiles_per_thread: int = DECODE_TILES_PER_THREAD, decode_token_slots=None, *,
                            policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """The whole Gated DeltaNet step between in_proj and out_proj for a decode batch, in one launch:
    ``out = RMSNormGated(rule(silu(conv(x))), z)``, updating ``conv_state`` and ``ssm_state`` of ``slot_ids``.

    Shapes as in ``gated_delta_decode_step_kernel``, except ``ssm_state`` ``[slots, Hv, Dk, Dv]`` (contiguous).
    Bit-identical to ``causal_conv1d_silu`` → ``reference_gated_delta(warps=row_groups)`` → ``gated_rms_norm``
    (``row_groups`` is a test knob: keep the default, the reference kernel's own).  ``tiles_per_thread``: 32-column
    tiles of the state per thread (``DECODE_TILES_PER_THREAD``).  Meant for one token per sequence; longer
    sequences are exact but run one block per key head.

    ``decode_token_slots`` (``[tokens]`` int32, the step's per-token slots as the host wrote them): the batch is a
    decode step -- one token per sequence, sequence ``b`` = token ``b``, padding tokens (slot -1) last -- and the
    kernel reads each block's state before waiting for the projection (launched as ``gated_delta_decode_step``,
    which overlaps the projection when ``policy`` says so).  ``policy.timeline``: build the kernel that stamps
    its blocks (``kernels/timeline.py``)."""
    check_rule_args(x, a, b, a_log, dt_bias, ssm_state, slot_ids, token_offsets, out)
    for arr, ndim in ((conv_weight, 2), (conv_state, 3), (z, 2), (norm_weight, 1)):
        check_bf16(arr, ndim)
    channels, taps = conv_weight.shape
    num_tokens = x.shape[0]
    num_v_heads, key_dim, value_dim = ssm_state.shape[1:]
    assert x.shape[1] == channels and conv_state.shape[1:] == (channels, taps), (x.shape, conv_state.shape,
                                                                               conv_weight.shape)
    assert conv_state.shape[0] == ssm_state.shape[0], (conv_state.shape, ssm_state.shape)
    assert z.shape == out.shape and norm_weight.shape == (value_dim,), (z.shape, out.shape, norm_weight.shape)
    assert ssm_state.is_c_contiguous(), "the kernel reads the state as one flat array"
    check_positions(positions, num_tokens)
    tiles = -(-value_dim // COL_TILE)
    warps = row_groups * -(-tiles // tiles_per_thread)
    assert 1 <= row_groups and 1 <= tiles_per_thread and warps <= MAX_WARPS, (row_groups, tiles_per_thread)
    if num_tokens == 0:
        return
    decode = decode_token_slots is not None
    if decode:
        assert decode_token_slots.dtype == np.int32 and decode_token_slots.shape == (num_tokens,)
        assert slot_ids.shape[0] == num_tokens, "a decode step has one sequence per token"
    stamps = timeline.buffer() if policy.timeline else timeline.unused()
    items = slot_ids.shape[0] * num_v_heads
    bf16 = state_is_bf16(ssm_state)
    if bf16 and (tiles_per_thread % 2 or value_dim % 2):
        raise ValueError(f"a bf16 state needs an even tiles_per_thread and value dim, got {tiles_per_thread} and "
                         f"{value_dim}")
    # a bf16 state as the f32 words that hold its column pairs (the kernel's vector accesses and copies are of f32)
    state = ssm_state.reshape(ssm_state.size).view(np.float32) if bf16 else ssm_state.reshape(ssm_state.size)
    if decode and next_state_prefetch(key_dim, value_dim, bf16):   # one block per SM, each streaming its next item
        blocks, shared = min(items, sm_count()), next_state_shared_bytes(key_dim, value_dim, bf16)
    else:
        blocks, shared = grid(max(1, items), sim_cap=8), 0
    num_k_heads = (channels - num_v_heads * value_dim) // (2 * key_dim)
    assert num_k_heads > 0 and num_v_heads % num_k_heads == 0, (channels, num_v_heads, key_dim, value_dim)
    launch(_decode_step_kernel(key_dim, value_dim, num_v_heads // num_k_heads, row_groups, tiles_per_thread, decode,
                               taps, policy.timeline, bf16),
           blocks, warps * WARP, x, conv_weight, conv_state, z, a, b, a_log, dt_bias, norm_weight, np.float32(eps),
           state, slot_ids, token_offsets, positions,
           decode_token_slots if decode else slot_ids, out, stamps, shared=shared,
           name="gated_delta_decode_step" if decode else None, policy=policy)
