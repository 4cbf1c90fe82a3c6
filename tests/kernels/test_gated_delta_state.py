"""``gated_delta.state``: clearing and copying state slots, the sequence table, and what every kernel does with empty sequences
and padding tokens (the state left bit for bit as an unpadded step leaves it)."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.gated_delta_helpers import (make_layer, make_tokens, poison, positions_of, reference_batch,
                                               reference_conv, ring_after, ring_history, run_rule, sequences,
                                               table_of)
from tests.util import bf16_randn, from_bf16_bits, rel_l2

from pegainfer.kernels.gated_delta import (allocate_chunk_scratch, causal_conv1d_silu, clear_state_slots,
                                           copy_state_slots, gated_delta_chunked, reference_gated_delta,
                                           sequence_table)


def test_clear_state_slots(rng):
    conv_bits, _ = bf16_randn((4, 6, 4), rng)
    ssm = rng.standard_normal((4, 2, 4, 5)).astype(np.float32)
    d_conv, d_ssm = cuda.to_device(conv_bits), cuda.to_device(ssm)
    clear_state_slots(d_conv, d_ssm, cuda.to_device(np.array([3, 1], np.int32)))
    conv_after, ssm_after = d_conv.copy_to_host(), d_ssm.copy_to_host()
    for s in (1, 3):
        assert not conv_after[s].any() and not ssm_after[s].any()
    for s in (0, 2):
        np.testing.assert_array_equal(conv_after[s], conv_bits[s])
        np.testing.assert_array_equal(ssm_after[s], ssm[s])


def test_copy_state_slots(rng):
    """Rows 1 and 4 copied to rows 3 and 0 (the prefix cache's snapshots, both ways): the written rows equal their
    sources bit for bit, every other row is untouched."""
    conv_bits, _ = bf16_randn((5, 6, 4), rng)
    ssm = rng.standard_normal((5, 2, 4, 5)).astype(np.float32)
    d_conv, d_ssm = cuda.to_device(conv_bits), cuda.to_device(ssm)
    copy_state_slots(d_conv, d_ssm, cuda.to_device(np.array([1, 4], np.int32)),
                     cuda.to_device(np.array([3, 0], np.int32)))
    conv_after, ssm_after = d_conv.copy_to_host(), d_ssm.copy_to_host()
    for dst, src in ((3, 1), (0, 4), (1, 1), (2, 2), (4, 4)):
        np.testing.assert_array_equal(conv_after[dst], conv_bits[src])
        np.testing.assert_array_equal(ssm_after[dst], ssm[src])


def test_sequence_table_from_token_slots():
    """Runs of equal slots are sequences; the table is padded with empty sequences (offset T, slot 0)."""
    seq_slots = cuda.to_device(np.full(6, -1, np.int32))
    seq_offsets = cuda.to_device(np.full(7, -1, np.int32))
    sequence_table(cuda.to_device(np.array([3, 3, 3, 1, 1, 4, 0], np.int32)), seq_slots, seq_offsets)
    np.testing.assert_array_equal(seq_offsets.copy_to_host(), [0, 3, 5, 6, 7, 7, 7])
    np.testing.assert_array_equal(seq_slots.copy_to_host(), [3, 1, 4, 0, 0, 0])
    sequence_table(cuda.to_device(np.array([2, 2, 2, 2], np.int32)), seq_slots, seq_offsets)  # one prefill
    np.testing.assert_array_equal(seq_offsets.copy_to_host(), [0, 4, 4, 4, 4, 4, 4])


@pytest.mark.parametrize("token_slots, offsets, slots", [
    ([2, 2, 2, -1, -1], [0, 3, 3], [2, 0]),             # a prefill chunk padded to a bucket: the table ends at 3
    ([3, 0, -1, -1], [0, 1, 2], [3, 0]),                 # two decode tokens and padding
    ([-1, -1, -1], [0, 0, 0], [0, 0]),                   # nothing but padding: every sequence empty
    ([3, -1, -1, 2, 2, 2, -1], [0, 1, 3, 6], [3, -1, 2]),   # a padded mixed step: decode, padding rows, chunk, padding
    ([1, -1, 5, 5], [0, 1, 2, 4], [1, -1, 5]),           # ... whose chunk fills its bucket: no trailing padding
])
def test_sequence_table_skips_padding(token_slots, offsets, slots):
    """Catches padding tokens (slot -1) that join a sequence or hide the real tokens after them: the table ends after
    the last real token, a run of padding between real tokens (a mixed step's padding decode rows) is a padding
    sequence of slot -1, and the table has exactly as many entries as the runner asks for (one logits row per run)."""
    seq_slots = cuda.to_device(np.full(len(slots), -7, np.int32))
    seq_offsets = cuda.to_device(np.full(len(slots) + 1, -7, np.int32))
    sequence_table(cuda.to_device(np.array(token_slots, np.int32)), seq_slots, seq_offsets)
    np.testing.assert_array_equal(seq_offsets.copy_to_host(), offsets)
    np.testing.assert_array_equal(seq_slots.copy_to_host(), slots)


def test_empty_sequences_leave_state_alone(rng):
    """Padding entries of the table (empty sequences, slot 0) must not touch slot 0, which a real sequence of the
    same batch updates: every kernel skips them."""
    layer = make_layer(rng, key_dim=16, value_dim=8)   # (the tensor-core chunked form takes key dims by 16)
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, 3)
    state = rng.standard_normal((2, layer["num_v_heads"], 16, 8)) * 0.3
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), [0], [3])
    for form in ("reference", "mma"):
        got, got_state = run_rule(form, layer, qkv_bits, a_bits, b_bits, state, [0, 0, 0], [3, 0, 0])
        assert rel_l2(got, ref) < 1e-2 and rel_l2(got_state, ref_state) < 1e-4, form
    x_bits, x = bf16_randn((3, 8), rng)
    w_bits, w = bf16_randn((8, 4), rng)
    st_bits, st = bf16_randn((2, 8, 4), rng)
    slot_ids, token_offsets, _ = sequences([3, 0, 0], [0, 0, 0])
    d_state, out = cuda.to_device(st_bits), cuda.to_device(np.zeros_like(x_bits))
    causal_conv1d_silu(cuda.to_device(x_bits), cuda.to_device(w_bits), d_state, slot_ids, token_offsets,
                       positions_of([3], [5]), out)
    ref_out, _ = reference_conv(x, w, ring_history(st[0], 5))
    np.testing.assert_array_equal(from_bf16_bits(d_state.copy_to_host()[0]).astype(np.float64),
                                  ring_after(st[0], x, 5))
    assert rel_l2(from_bf16_bits(out.copy_to_host()).astype(np.float64), ref_out) < 1e-2


# (real tokens, padded length, chunk): the last real chunk part real part padding; real tokens an exact multiple of
# the chunk with padding in a chunk of its own; several chunks of nothing but padding; a chunk of 64 (the model's)
PADDED_PREFILLS = [(6, 8, 4), (8, 11, 4), (3, 16, 4), (5, 16, 64)]


@pytest.mark.parametrize("num_real, padded, chunk", PADDED_PREFILLS)
def test_padded_prefill_equals_unpadded(rng, num_real, padded, chunk):
    """One prompt chunk padded to a bucket as the runner pads it (slot -1 after the real tokens), the sequence table
    built from the token slots: conv state, delta-rule state and the real output rows must be bit for bit those of
    the unpadded chunk, with NaN / inf in the padding rows of every input; the rule's padding rows come out zero.
    Both rule forms, each continuing from a non-zero state in slot 1 (slots 0 and 2 untouched)."""
    layer = make_layer(rng, key_dim=16, value_dim=8)   # (the tensor-core chunked form takes key dims by 16)
    slot, num_slots = 1, 3
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, padded)
    conv_dim, taps = qkv_bits.shape[1], 4
    w_bits, _ = bf16_randn((conv_dim, taps), rng, scale=0.5)
    conv_bits, _ = bf16_randn((num_slots, conv_dim, taps), rng)
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], 16, 8)) * 0.3).astype(np.float32)
    d_w, d_a_log, d_dt_bias = (cuda.to_device(x) for x in (w_bits, layer["a_log"], layer["dt_bias"]))
    sentinel = 0x1234
    width = layer["num_v_heads"] * layer["value_dim"]

    def run(num_tokens, seq_slots, seq_offsets, form):
        x, a, b = (cuda.to_device(poison(v[:num_tokens], num_real, rng)) for v in (qkv_bits, a_bits, b_bits))
        d_conv, d_state = cuda.to_device(conv_bits), cuda.to_device(state)
        mixed = cuda.to_device(np.full((num_tokens, conv_dim), sentinel, np.uint16))
        positions = cuda.to_device(np.r_[np.arange(7, 7 + num_real), np.zeros(num_tokens - num_real)].astype(np.int32))
        causal_conv1d_silu(x, d_w, d_conv, seq_slots, seq_offsets, positions, mixed, max_seq_tokens=num_tokens,
                           tokens_per_thread=3)
        mixed_host = mixed.copy_to_host()
        assert (mixed_host[num_real:] == sentinel).all(), "the conv wrote a padding row"
        mixed.copy_to_device(poison(mixed_host, num_real, rng))  # the rule must not read them either
        out = cuda.to_device(np.full((num_tokens, width), sentinel, np.uint16))
        args = (mixed, a, b, d_a_log, d_dt_bias, d_state, seq_slots, seq_offsets, out)
        if form == "reference":
            reference_gated_delta(*args)
        else:
            scratch = allocate_chunk_scratch(num_tokens, layer["num_k_heads"], layer["num_v_heads"], chunk)
            gated_delta_chunked(*args, scratch, max_seq_tokens=num_tokens)
        return d_conv.copy_to_host(), d_state.copy_to_host(), mixed_host[:num_real], out.copy_to_host()

    for form in ("chunked", "reference"):
        plain = run(num_real, *sequences([num_real], [slot])[:2], form)
        padded_run = run(padded, *table_of([slot] * num_real + [-1] * (padded - num_real), 1), form)
        for name, want, got in zip(("conv state", "delta-rule state", "conv output"), plain, padded_run):
            np.testing.assert_array_equal(got, want, err_msg=f"{form}: {name}")
        np.testing.assert_array_equal(padded_run[3][:num_real], plain[3], err_msg=f"{form}: real output rows")
        assert not padded_run[3][num_real:].any(), f"{form}: padding output rows must be zeros"
        for s in (0, 2):
            np.testing.assert_array_equal(padded_run[1][s], state[s])
            np.testing.assert_array_equal(padded_run[0][s], conv_bits[s])
    assert not np.array_equal(plain[1][slot], state[slot]), "the real tokens must have changed the state"


def test_padded_mixed_step_equals_unpadded(rng):
    """Catches a padding run between sequences (a mixed step's decode rows padded to a graph batch, before its chunk)
    that hides the chunk, shifts it, or reads or writes a state (slot -1 would wrap to the last slot): a decode
    (slot 2) and two padding rows, then a 5-token chunk (slot 0, crossing a 4-token chunk boundary) and two padding
    tokens, give the unpadded step's conv and delta-rule states and real output rows bit for bit, with NaN / inf in
    every padding row's inputs; the conv leaves the padding rows alone and the rule writes zeros there.  Both rule
    forms; slots 1 and 3 untouched."""
    layer = make_layer(rng, key_dim=16, value_dim=8)   # (the tensor-core chunked form takes key dims by 16)
    num_slots, taps = 4, 4
    real_rows = np.array([0, 3, 4, 5, 6, 7])               # the padded step's rows of the unpadded step's tokens
    token_slots = [2, -1, -1, 0, 0, 0, 0, 0, -1, -1]
    padded = len(token_slots)
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, len(real_rows))
    conv_dim = qkv_bits.shape[1]
    w_bits, _ = bf16_randn((conv_dim, taps), rng, scale=0.5)
    conv_bits, _ = bf16_randn((num_slots, conv_dim, taps), rng)
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], 16, 8)) * 0.3).astype(np.float32)
    d_w, d_a_log, d_dt_bias = (cuda.to_device(x) for x in (w_bits, layer["a_log"], layer["dt_bias"]))
    positions = np.array([6, 3, 4, 5, 6, 7], np.int32)
    sentinel = 0x1234
    width = layer["num_v_heads"] * layer["value_dim"]

    def spread(bits, rows, num_tokens):
        """``bits``' rows at ``rows`` of a ``num_tokens``-row array whose other rows are NaN / inf / random."""
        out = poison(np.zeros((num_tokens,) + bits.shape[1:], bits.dtype), 0, rng)
        out[rows] = bits
        return out

    def run(rows, num_tokens, table, form):
        x, a, b = (cuda.to_device(spread(v, rows, num_tokens)) for v in (qkv_bits, a_bits, b_bits))
        d_conv, d_state = cuda.to_device(conv_bits), cuda.to_device(state)
        mixed = cuda.to_device(np.full((num_tokens, conv_dim), sentinel, np.uint16))
        pos = np.zeros(num_tokens, np.int32)
        pos[rows] = positions
        causal_conv1d_silu(x, d_w, d_conv, *table, cuda.to_device(pos), mixed, max_seq_tokens=num_tokens,
                           tokens_per_thread=3)
        mixed_host = mixed.copy_to_host()
        pad = np.setdiff1d(np.arange(num_tokens), rows)
        assert (mixed_host[pad] == sentinel).all(), "the conv wrote a padding row"
        mixed.copy_to_device(spread(mixed_host[rows], rows, num_tokens))  # the rule must not read them either
        out = cuda.to_device(np.full((num_tokens, width), sentinel, np.uint16))
        args = (mixed, a, b, d_a_log, d_dt_bias, d_state, *table, out)
        if form == "reference":
            reference_gated_delta(*args)
        else:
            scratch = allocate_chunk_scratch(num_tokens, layer["num_k_heads"], layer["num_v_heads"], 4)
            gated_delta_chunked(*args, scratch, max_seq_tokens=num_tokens)
        out_host = out.copy_to_host()
        assert not out_host[pad].any(), f"{form}: padding output rows must be zeros"
        return d_conv.copy_to_host(), d_state.copy_to_host(), mixed_host[rows], out_host[rows]

    for form in ("chunked", "reference"):
        plain = run(np.arange(len(real_rows)), len(real_rows), sequences([1, 5], [2, 0])[:2], form)
        padded_run = run(real_rows, padded, table_of(token_slots, 4), form)    # 3 runs, a table of Dp + Rp = 4
        for name, want, got in zip(("conv state", "delta-rule state", "conv output", "rule output"), plain,
                                   padded_run):
            np.testing.assert_array_equal(got, want, err_msg=f"{form}: {name}")
        for s in (1, 3):
            np.testing.assert_array_equal(padded_run[1][s], state[s])
            np.testing.assert_array_equal(padded_run[0][s], conv_bits[s])
    assert not np.array_equal(plain[1][0], state[0]), "the chunk must have changed the state"


def test_padded_decode_step_equals_unpadded(rng):
    """A decode step of two sequences padded with two slot -1 tokens (a larger captured batch): token-by-token
    rule and conv give the unpadded states and outputs bit for bit; the padding rows of the rule come out zero."""
    layer = make_layer(rng, key_dim=8, value_dim=8)
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, 4)
    conv_dim = qkv_bits.shape[1]
    w_bits, _ = bf16_randn((conv_dim, 4), rng, scale=0.5)
    conv_bits, _ = bf16_randn((3, conv_dim, 4), rng)
    state = (rng.standard_normal((3, layer["num_v_heads"], 8, 8)) * 0.3).astype(np.float32)
    results = []
    for num_tokens, (seq_slots, seq_offsets) in ((2, sequences([1, 1], [2, 0])[:2]),
                                                 (4, table_of([2, 0, -1, -1], 4))):
        x, a, b = (cuda.to_device(poison(v[:num_tokens], 2, rng)) for v in (qkv_bits, a_bits, b_bits))
        d_conv, d_state = cuda.to_device(conv_bits), cuda.to_device(state)
        mixed = cuda.to_device(np.zeros((num_tokens, conv_dim), np.uint16))
        positions = cuda.to_device(np.array([6, 3, 0, 0][:num_tokens], np.int32))
        causal_conv1d_silu(x, cuda.to_device(w_bits), d_conv, seq_slots, seq_offsets, positions, mixed,
                           max_seq_tokens=1, tokens_per_thread=8)
        out = cuda.to_device(np.full((num_tokens, layer["num_v_heads"] * 8), 0x1234, np.uint16))
        reference_gated_delta(mixed, a, b, cuda.to_device(layer["a_log"]), cuda.to_device(layer["dt_bias"]),
                              d_state, seq_slots, seq_offsets, out)
        results.append((d_conv.copy_to_host(), d_state.copy_to_host(), out.copy_to_host()))
    (conv0, state0, out0), (conv1, state1, out1) = results
    np.testing.assert_array_equal(conv1, conv0)
    np.testing.assert_array_equal(state1, state0)
    np.testing.assert_array_equal(out1[:2], out0)
    assert not out1[2:].any()
    np.testing.assert_array_equal(state1[1], state[1])
