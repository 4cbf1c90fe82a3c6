"""Gated DeltaNet kernels (Qwen3.5 linear attention) against float64 NumPy, against each other (chunked vs
recurrent; the fused decode step vs conv → recurrent rule → gated norm, bit for bit), and against transformers' own
torch reference functions."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2, to_bf16_bits
from numba import cuda

from pegainfer.kernels.gated_delta import (allocate_chunk_scratch, causal_conv1d_silu, clear_state_slots,
                                           gated_delta_chunked, gated_delta_decode_step, gated_delta_recurrent,
                                           gated_rms_norm, sequence_table)

EPS = 1e-6


# ------------------------------------------------------------------------------------------------ float64 references
def silu(x):
    return x / (1.0 + np.exp(-x))


def reference_conv(x, w, state):
    """x [T, C], w [C, K], state [C, K-1] (the K-1 inputs before x, oldest first; float64 of bf16s) → (out [T, C]
    with HF's two roundings, the last K-1 inputs)."""
    taps = w.shape[1]
    full = np.concatenate([state.T, x], axis=0)  # [K-1+T, C]
    out = np.stack([(full[t:t + taps] * w.T).sum(0) for t in range(x.shape[0])])
    return bf16_round(silu(bf16_round(out))), full[-(taps - 1):].T.copy()


def ring_history(ring, first_pos):
    """The K-1 inputs a sequence at ``first_pos`` continues from, oldest first ([C, K-1]), read from a conv ring
    [C, K] (entry p % K holds position p); positions below 0 are zeros."""
    taps = ring.shape[-1]
    cols = [ring[..., (first_pos + s) % taps] if first_pos + s >= 0 else np.zeros_like(ring[..., 0])
            for s in range(-(taps - 1), 0)]
    return np.stack(cols, axis=-1)


def ring_after(ring, x, first_pos):
    """The ring [C, K] after a sequence of x [T, C] starting at ``first_pos``: its last K-1 inputs stored at their
    positions' entries, the other entries as they were."""
    ring = ring.copy()
    taps = ring.shape[-1]
    for s in range(max(0, x.shape[0] - (taps - 1)), x.shape[0]):
        ring[:, (first_pos + s) % taps] = x[s]
    return ring


def reference_gates(a, b, a_log, dt_bias):
    """g = −exp(A_log)·softplus(a + dt_bias) (f64), beta = bf16(sigmoid(b))."""
    z = a + dt_bias
    softplus = np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20))))
    return -np.exp(a_log) * softplus, bf16_round(1.0 / (1.0 + np.exp(-b)))


def reference_rule(qkv, g, beta, state, num_k_heads, key_dim):
    """Token-by-token gated delta rule in float64 (HF torch_recurrent_gated_delta_rule).
    qkv [T, 2·Hk·Dk + Hv·Dv], g/beta [T, Hv], state [Hv, Dk, Dv] → (out [T, Hv·Dv] unrounded, final state)."""
    num_v_heads, _, value_dim = state.shape
    s = state.copy()
    q = qkv[:, :num_k_heads * key_dim].reshape(-1, num_k_heads, key_dim)
    k = qkv[:, num_k_heads * key_dim:2 * num_k_heads * key_dim].reshape(-1, num_k_heads, key_dim)
    v = qkv[:, 2 * num_k_heads * key_dim:].reshape(-1, num_v_heads, value_dim)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS) / np.sqrt(key_dim)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
    group = num_v_heads // num_k_heads
    out = np.zeros((qkv.shape[0], num_v_heads, value_dim))
    for t in range(qkv.shape[0]):
        for h in range(num_v_heads):
            qt, kt = q[t, h // group], k[t, h // group]
            s[h] *= np.exp(g[t, h])
            delta = (v[t, h] - s[h].T @ kt) * beta[t, h]
            s[h] += np.outer(kt, delta)
            out[t, h] = s[h].T @ qt
    return out.reshape(qkv.shape[0], -1), s


# ------------------------------------------------------------------------------------------------ helpers
def sequences(lengths, slots):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return cuda.to_device(np.asarray(slots, np.int32)), cuda.to_device(offsets), offsets


def positions_of(lengths, first_positions):
    """Per-token positions [T] int32 (device) of sequences of ``lengths`` tokens starting at ``first_positions``."""
    return cuda.to_device(np.concatenate([np.arange(p, p + n) for n, p in zip(lengths, first_positions)] +
                                         [np.zeros(0)]).astype(np.int32))


def make_layer(rng, num_k_heads=2, num_v_heads=4, key_dim=16, value_dim=8):
    """Random inputs of one Gated DeltaNet layer's rule (qkv as if from the conv: values in a SiLU-like range)."""
    return dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, key_dim=key_dim, value_dim=value_dim,
                a_log=np.log(rng.uniform(0.05, 2.0, num_v_heads)).astype(np.float32),
                dt_bias=rng.uniform(-1.0, 1.0, num_v_heads).astype(np.float32))


def make_tokens(rng, layer, num_tokens):
    width = 2 * layer["num_k_heads"] * layer["key_dim"] + layer["num_v_heads"] * layer["value_dim"]
    qkv_bits, qkv = bf16_randn((num_tokens, width), rng)
    a_bits, a = bf16_randn((num_tokens, layer["num_v_heads"]), rng)
    b_bits, b = bf16_randn((num_tokens, layer["num_v_heads"]), rng, scale=2.0)
    return qkv_bits, qkv, a_bits, a, b_bits, b


def run_rule(form, layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=4):
    """Run the recurrent or chunked kernel; returns (out as float64, final state array)."""
    slot_ids, token_offsets, _ = sequences(lengths, slots)
    d_state = cuda.to_device(state.astype(np.float32))
    out = cuda.to_device(np.zeros((qkv_bits.shape[0], layer["num_v_heads"] * layer["value_dim"]), np.uint16))
    args = (cuda.to_device(qkv_bits), cuda.to_device(a_bits), cuda.to_device(b_bits),
            cuda.to_device(layer["a_log"]), cuda.to_device(layer["dt_bias"]), d_state, slot_ids, token_offsets, out)
    if form == "recurrent":
        gated_delta_recurrent(*args)
    else:
        scratch = allocate_chunk_scratch(qkv_bits.shape[0], layer["num_k_heads"], layer["num_v_heads"], chunk)
        gated_delta_chunked(*args, scratch, max_seq_tokens=max(lengths))
    return from_bf16_bits(out.copy_to_host()).astype(np.float64), d_state.copy_to_host()


def reference_batch(layer, qkv, a, b, state, slots, lengths):
    """float64 reference over a batch of sequences: (out [T, Hv·Dv], final state array)."""
    g, beta = reference_gates(a, b, layer["a_log"].astype(np.float64), layer["dt_bias"].astype(np.float64))
    out = np.zeros((qkv.shape[0], layer["num_v_heads"] * layer["value_dim"]))
    final = state.astype(np.float64).copy()
    start = 0
    for slot, n in zip(slots, lengths):
        sl = slice(start, start + n)
        out[sl], final[slot] = reference_rule(qkv[sl], g[sl], beta[sl], final[slot], layer["num_k_heads"],
                                              layer["key_dim"])
        start += n
    return out, final


# ------------------------------------------------------------------------------------------------ conv1d
def test_conv1d_batch_of_sequences_matches_reference(rng):
    """Varlen batch: lengths 1 and 2 (< K-1: older ring entries stay), 5 and 11 (several pieces per channel with
    tokens_per_thread=3); each sequence continues from its own slot's ring at its own position: 9 (the ring wrapped
    twice), 0 (nothing before it: the ring's entries must not be read), 2 (< K-1: one history entry is before
    position 0) and 4 (= K)."""
    channels, taps, slots = 40, 4, 5
    lengths, slot_list, first_pos = [1, 5, 2, 11], [3, 0, 4, 1], [9, 0, 2, 4]
    x_bits, x = bf16_randn((sum(lengths), channels), rng)
    w_bits, w = bf16_randn((channels, taps), rng, scale=0.5)
    ring_bits, ring = bf16_randn((slots, channels, taps), rng)
    slot_ids, token_offsets, offsets = sequences(lengths, slot_list)
    d_ring = cuda.to_device(ring_bits)
    out = cuda.to_device(np.zeros_like(x_bits))
    causal_conv1d_silu(cuda.to_device(x_bits), cuda.to_device(w_bits), d_ring, slot_ids, token_offsets,
                       positions_of(lengths, first_pos), out, max_seq_tokens=max(lengths), tokens_per_thread=3)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    got_ring = from_bf16_bits(d_ring.copy_to_host()).astype(np.float64)
    expected_ring = ring.copy()
    for b, (slot, n, p) in enumerate(zip(slot_list, lengths, first_pos)):
        sl = slice(offsets[b], offsets[b + 1])
        ref, _ = reference_conv(x[sl], w, ring_history(ring[slot], p))
        expected_ring[slot] = ring_after(ring[slot], x[sl], p)
        assert rel_l2(got[sl], ref) < 1e-2, (b, rel_l2(got[sl], ref))
        assert np.mean(got[sl] == ref) > 0.95, (b, np.mean(got[sl] == ref))
    np.testing.assert_array_equal(got_ring, expected_ring)  # untouched slot 2 included


def test_conv1d_prefill_chunks_then_decode_equals_one_pass(rng):
    """Two sequences: a 6-token prompt prefilled in chunks of 4 and 2 (the second continues from the ring the
    first left), then 5 single-token decode steps with both sequences in each step (the ring wraps): every output
    equals one float64 conv over all 11 tokens from zeros."""
    channels, taps = 24, 4
    x_bits, x = bf16_randn((11, 2, channels), rng)  # [token, sequence, channel]
    w_bits, w = bf16_randn((channels, taps), rng, scale=0.5)
    d_w = cuda.to_device(w_bits)
    d_ring = cuda.to_device(np.zeros((3, channels, taps), np.uint16))
    outs = np.zeros((11, 2, channels), np.uint16)
    for s, slot in enumerate((2, 0)):  # prefill each sequence on its own
        for start, n in ((0, 4), (4, 2)):
            slot_ids, token_offsets, _ = sequences([n], [slot])
            out = cuda.to_device(np.zeros((n, channels), np.uint16))
            causal_conv1d_silu(cuda.to_device(np.ascontiguousarray(x_bits[start:start + n, s])), d_w, d_ring,
                               slot_ids, token_offsets, positions_of([n], [start]), out, tokens_per_thread=3)
            outs[start:start + n, s] = out.copy_to_host()
    slot_ids, token_offsets, _ = sequences([1, 1], [2, 0])
    for t in range(6, 11):  # decode: B=2 sequences of one token
        out = cuda.to_device(np.zeros((2, channels), np.uint16))
        causal_conv1d_silu(cuda.to_device(np.ascontiguousarray(x_bits[t])), d_w, d_ring, slot_ids, token_offsets,
                           positions_of([1, 1], [t, t]), out, max_seq_tokens=1)
        outs[t] = out.copy_to_host()
    for s in range(2):
        ref, _ = reference_conv(x[:, s], w, np.zeros((channels, taps - 1)))
        got = from_bf16_bits(outs[:, s]).astype(np.float64)
        assert rel_l2(got, ref) < 1e-2 and np.mean(got == ref) > 0.95, (s, rel_l2(got, ref))


def test_conv1d_matches_hf_torch(rng):
    """Against transformers' causal_conv1d_fn (prefill) and causal_conv1d_update (decode) on CPU bf16."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    channels, taps, num_tokens = 32, 4, 7
    x_bits, _ = bf16_randn((num_tokens + 1, channels), rng)
    w_bits, _ = bf16_randn((channels, taps), rng, scale=0.5)
    as_torch = lambda bits: torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    xt, wt = as_torch(x_bits), as_torch(w_bits)
    with torch.no_grad():
        expected = hf.causal_conv1d_fn(xt[:num_tokens].T[None], wt, None, activation="silu")[0].T
        hf_state = torch.nn.functional.pad(xt[:num_tokens].T[None], (taps - num_tokens, 0))[..., -taps:].clone()
        expected_step = hf.causal_conv1d_update(xt[num_tokens:].T[None], hf_state, wt, None, "silu")[0].T
    d_state = cuda.to_device(np.zeros((1, channels, taps), np.uint16))
    d_w = cuda.to_device(w_bits)
    slot_ids, token_offsets, _ = sequences([num_tokens], [0])
    out = cuda.to_device(np.zeros((num_tokens, channels), np.uint16))
    causal_conv1d_silu(cuda.to_device(x_bits[:num_tokens].copy()), d_w, d_state, slot_ids, token_offsets,
                       positions_of([num_tokens], [0]), out)
    slot_ids, token_offsets, _ = sequences([1], [0])
    out_step = cuda.to_device(np.zeros((1, channels), np.uint16))
    causal_conv1d_silu(cuda.to_device(x_bits[num_tokens:].copy()), d_w, d_state, slot_ids, token_offsets,
                       positions_of([1], [num_tokens]), out_step, max_seq_tokens=1)
    for got, exp in ((out, expected), (out_step, expected_step)):
        exp = exp.float().numpy().astype(np.float64)
        got = from_bf16_bits(got.copy_to_host()).astype(np.float64)
        assert rel_l2(got, exp) < 1e-2 and np.mean(got == exp) > 0.95, (rel_l2(got, exp), np.mean(got == exp))


# ------------------------------------------------------------------------------------------------ the rule
def test_recurrent_matches_float64(rng):
    layer = make_layer(rng)
    lengths, slots = [3, 5], [2, 0]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((3, layer["num_v_heads"], layer["key_dim"], layer["value_dim"])) * 0.3
    got, got_state = run_rule("recurrent", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(got, ref) < 1e-2, rel_l2(got, ref)
    assert rel_l2(got_state, ref_state) < 1e-4, rel_l2(got_state, ref_state)
    np.testing.assert_array_equal(got_state[1], state[1].astype(np.float32))  # slot not in the batch: untouched


def test_chunked_equals_recurrent(rng):
    """Prompts of 3, 8 and 13 tokens in one varlen batch, each continuing from a non-zero state, with chunks of 4
    and 8 (shorter than, equal to, longer than a chunk; exact multiples and a partial last chunk): the chunked form
    must give the token-by-token result."""
    layer = make_layer(rng)
    lengths, slots = [3, 8, 13], [1, 3, 0]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((4, layer["num_v_heads"], layer["key_dim"], layer["value_dim"])) * 0.3
    rec, rec_state = run_rule("recurrent", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(rec, ref) < 1e-2 and rel_l2(rec_state, ref_state) < 1e-4
    for chunk in (4, 8):
        chk, chk_state = run_rule("chunked", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=chunk)
        assert rel_l2(chk_state, rec_state) < 1e-5, (chunk, rel_l2(chk_state, rec_state))
        assert rel_l2(chk, rec) < 1e-2, (chunk, rel_l2(chk, rec))
        assert np.mean(chk == rec) > 0.95, (chunk, np.mean(chk == rec))  # bf16 outputs: nearly all bit-equal
        assert rel_l2(chk, ref) < 1e-2, (chunk, rel_l2(chk, ref))
        assert rel_l2(chk_state, ref_state) < 1e-4, (chunk, rel_l2(chk_state, ref_state))


def test_rule_matches_hf_torch(rng):
    """Against transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (f32 on CPU)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    layer = make_layer(rng, key_dim=8, value_dim=16)
    num_tokens = 6
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, num_tokens)
    state = rng.standard_normal((1, layer["num_v_heads"], layer["key_dim"], layer["value_dim"])) * 0.3
    hk, dk, hv, dv = layer["num_k_heads"], layer["key_dim"], layer["num_v_heads"], layer["value_dim"]
    assert hv > hk, "the test must cover grouped value heads (several value heads per key head)"
    t = lambda x: torch.tensor(x, dtype=torch.float32)[None]  # noqa: E731
    g, beta = reference_gates(a, b, layer["a_log"].astype(np.float64), layer["dt_bias"].astype(np.float64))
    q, k, v = (qkv[:, :hk * dk].reshape(-1, hk, dk), qkv[:, hk * dk:2 * hk * dk].reshape(-1, hk, dk),
               qkv[:, 2 * hk * dk:].reshape(-1, hv, dv))
    # Value head h reads key head h // (hv / hk).  Repeat q and k to one head per value head, as HF's model does
    # before calling these functions: transformers 5.24 repeats them inside when given fewer key heads, 5.17 does
    # not (it fails on [T, hk, dk] keys); with the heads already repeated both compute the same thing.
    q, k = np.repeat(q, hv // hk, axis=1), np.repeat(k, hv // hk, axis=1)
    with torch.no_grad():
        s0 = torch.tensor(state, dtype=torch.float32)
        hf_chunk, hf_chunk_state = hf.torch_chunk_gated_delta_rule(
            t(q), t(k), t(v), g=t(g), beta=t(beta), chunk_size=4, initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        hf_rec, hf_rec_state = hf.torch_recurrent_gated_delta_rule(
            t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    for form in ("recurrent", "chunked"):
        got, got_state = run_rule(form, layer, qkv_bits, a_bits, b_bits, state, [0], [num_tokens])
        for hf_out, hf_state in ((hf_chunk, hf_chunk_state), (hf_rec, hf_rec_state)):
            assert rel_l2(got, hf_out[0].reshape(num_tokens, -1).double().numpy()) < 1e-2, form
            assert rel_l2(got_state[0], hf_state[0].double().numpy()) < 1e-4, form


# ------------------------------------------------------------------------------------------------ gated norm
def test_gated_rms_norm_matches_reference_and_hf(rng):
    tokens, heads, dim = 3, 4, 24
    x_bits, x = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    z_bits, z = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    w = bf16_round(1.0 + 0.5 * rng.standard_normal(dim))  # HF initialises this weight to ones
    w_bits = to_bf16_bits(w)
    out = cuda.to_device(np.zeros_like(x_bits))
    gated_rms_norm(cuda.to_device(x_bits), cuda.to_device(z_bits), cuda.to_device(w_bits), out, EPS)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    xr = x.reshape(tokens, heads, dim)
    n = bf16_round(xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + EPS))
    ref = bf16_round(bf16_round(w * n) * silu(z.reshape(tokens, heads, dim))).reshape(tokens, -1)
    assert rel_l2(got, ref) < 1e-2 and np.mean(got == ref) > 0.95, (rel_l2(got, ref), np.mean(got == ref))

    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    as_torch = lambda bits: torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    module = hf.Qwen3_5RMSNormGated(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(as_torch(w_bits).float())
        module.to(torch.bfloat16)
        expected = module(as_torch(x_bits).reshape(-1, dim), as_torch(z_bits).reshape(-1, dim))
    expected = expected.float().numpy().astype(np.float64).reshape(tokens, -1)
    assert np.mean(got == expected) > 0.97, np.mean(got == expected)
    assert rel_l2(got, expected) < 1e-2


# ------------------------------------------------------------------------------------------------ fused decode step
def make_decode_layer(rng, key_dim=16, value_dim=16, taps=4, **heads):
    """A layer's rule parameters plus its conv weight [conv_dim, K] and gated-norm weight [Dv] (bf16 bits)."""
    layer = make_layer(rng, key_dim=key_dim, value_dim=value_dim, **heads)
    conv_dim = 2 * layer["num_k_heads"] * key_dim + layer["num_v_heads"] * value_dim
    layer["conv_w"] = bf16_randn((conv_dim, taps), rng, scale=0.5)[0]
    layer["norm_w"] = to_bf16_bits(bf16_round(1.0 + 0.3 * rng.standard_normal(value_dim)))
    return layer


def decode_inputs(rng, layer, num_tokens):
    """One step's in_proj outputs: x (the conv's input), z, a, b as bf16 bits."""
    conv_dim = layer["conv_w"].shape[0]
    width = layer["num_v_heads"] * layer["value_dim"]
    return (bf16_randn((num_tokens, conv_dim), rng)[0], bf16_randn((num_tokens, width), rng)[0],
            bf16_randn((num_tokens, layer["num_v_heads"]), rng)[0],
            bf16_randn((num_tokens, layer["num_v_heads"]), rng, scale=2.0)[0])


def run_linear_step(fused, layer, ring, state, inputs, table, positions, row_groups=None, decode_slots=None,
                    tiles_per_thread=None):
    """One Gated DeltaNet step from host ``ring`` [slots, C, K] / ``state`` [slots, Hv, Dk, Dv]: the fused decode
    step (``decode_slots``: in decode mode, given the per-token slots), or conv → recurrent rule → gated norm
    (``row_groups`` warps; ``tiles_per_thread`` for the fused step); returns the new (ring, state, out)."""
    x, z, a, b = (cuda.to_device(v) for v in inputs)
    slot_ids, token_offsets = table
    d_ring, d_state = cuda.to_device(ring), cuda.to_device(state)
    num_tokens = x.shape[0]
    out = cuda.to_device(np.full((num_tokens, z.shape[1]), 0x1234, np.uint16))
    conv_w, norm_w, a_log, dt_bias = (cuda.to_device(layer[k]) for k in ("conv_w", "norm_w", "a_log", "dt_bias"))
    groups = {} if row_groups is None else dict(row_groups=row_groups)
    if decode_slots is not None:
        groups["decode_token_slots"] = cuda.to_device(np.asarray(decode_slots, np.int32))
    if fused:
        gated_delta_decode_step(x, conv_w, d_ring, z, a, b, a_log, dt_bias, norm_w, EPS, d_state, slot_ids,
                                token_offsets, positions, out, tiles_per_thread=tiles_per_thread, **groups)
    else:
        mixed = cuda.to_device(np.zeros((num_tokens, conv_w.shape[0]), np.uint16))
        causal_conv1d_silu(x, conv_w, d_ring, slot_ids, token_offsets, positions, mixed, max_seq_tokens=num_tokens,
                           tokens_per_thread=max(3, num_tokens))
        gated_delta_recurrent(mixed, a, b, a_log, dt_bias, d_state, slot_ids, token_offsets, out,
                              **({} if row_groups is None else dict(warps=row_groups)))
        gated_rms_norm(out, z, norm_w, out, EPS)
    return d_ring.copy_to_host(), d_state.copy_to_host(), out.copy_to_host()


def assert_fused_equals_three_kernels(layer, ring, state, inputs, table, positions, row_groups=None, label="",
                                      decode_slots=None, tiles_per_thread=None):
    """Run the fused step and conv → recurrent rule → gated norm on the same inputs; the new ring, state and
    output must be equal bit for bit.  Returns the fused step's (ring, state, out)."""
    fused = run_linear_step(True, layer, ring, state, inputs, table, positions, row_groups, decode_slots,
                            tiles_per_thread)
    ref = run_linear_step(False, layer, ring, state, inputs, table, positions, row_groups)
    for name, got, want in zip(("conv ring", "delta-rule state", "output"), fused, ref):
        np.testing.assert_array_equal(got, want, err_msg=f"{label}{name}")
    return fused


def reference_layer(layer, inputs, history, state):
    """float64 Gated DeltaNet step of one sequence: x [T, C] etc. as bf16 bits, history [C, K-1] (the inputs before
    it), state [Hv, Dk, Dv] → the gated-norm output [T, Hv·Dv] with HF's bf16 roundings."""
    x, z, a, b = (from_bf16_bits(v).astype(np.float64) for v in inputs)
    w = from_bf16_bits(layer["conv_w"]).astype(np.float64)
    mixed, _ = reference_conv(x, w, history)
    g, beta = reference_gates(a, b, layer["a_log"].astype(np.float64), layer["dt_bias"].astype(np.float64))
    core, _ = reference_rule(mixed, g, beta, state.astype(np.float64), layer["num_k_heads"], layer["key_dim"])
    o = bf16_round(core).reshape(x.shape[0], layer["num_v_heads"], -1)
    normed = bf16_round(o / np.sqrt((o * o).mean(-1, keepdims=True) + EPS))
    norm_w = from_bf16_bits(layer["norm_w"]).astype(np.float64)
    return bf16_round(bf16_round(norm_w * normed) * silu(z.reshape(o.shape))).reshape(x.shape[0], -1)


@pytest.mark.parametrize("key_dim, value_dim, row_groups, tiles_per_thread", [
    (16, 16, None, None),   # the default summation order (the recurrent kernel's own); half a column tile
    (16, 64, 2, None),      # two column tiles, two row classes
    (16, 64, 2, 1),         # ... one tile per thread: two column groups of warps per row class
    (16, 128, 2, 4),        # four tiles per thread: its state rows and shared sums moved by 16-byte accesses
    (20, 32, 3, None),      # key rows not a multiple of the row classes
])
def test_decode_step_equals_conv_rule_norm(rng, key_dim, value_dim, row_groups, tiles_per_thread):
    """Consecutive decode steps of three sequences (slots 3, 0, 4; GQA ratio 2), from random rings and states:
    the fused step and conv → recurrent rule → gated norm leave bit-identical rings, states and outputs after every
    step.  Positions start at 0 (no history: ring entries must not be read), 2 (< K-1) and 9 (> K), so the ring
    wraps; the last step is padded to a larger batch (slot -1 tokens: the padding rows must match too).  The first
    step is also checked against float64.  ``row_groups``: the fused step against the recurrent kernel with that many
    warps (the simulator's default is one), in two steps.  With the default, steps 1 and 3 run the fused step in
    decode mode (state read before the PDL wait from the per-token slots; step 3 with padding tokens).
    ``tiles_per_thread``: the fused step's state tiles per thread (default ``DECODE_TILES_PER_THREAD``)."""
    layer = make_decode_layer(rng, key_dim=key_dim, value_dim=value_dim)
    num_slots, taps = 6, 4
    conv_dim = layer["conv_w"].shape[0]
    ring = bf16_randn((num_slots, conv_dim, taps), rng)[0]
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], key_dim, value_dim)) * 0.3).astype(np.float32)
    slots, first_pos = [3, 0, 4], np.array([0, 2, 9])
    carried = (ring, state)  # both paths start each step from it: they were equal bit for bit after the last
    steps = 4 if row_groups is None else 2  # (the simulator's time: the other geometries take fewer steps)
    for step in range(steps):
        padded = step == steps - 1
        token_slots = slots + [-1, -1] if padded else slots
        table = _table(token_slots, len(token_slots))
        positions = cuda.to_device(np.r_[first_pos + step, [0, 0][:len(token_slots) - 3]].astype(np.int32))
        inputs = decode_inputs(rng, layer, len(token_slots))
        decode_slots = token_slots if row_groups is None and step % 2 else None
        fused = assert_fused_equals_three_kernels(layer, *carried, inputs, table, positions, row_groups,
                                                  label=f"step {step}: ", decode_slots=decode_slots,
                                                  tiles_per_thread=tiles_per_thread)
        if step == 0:
            got = from_bf16_bits(fused[2]).astype(np.float64)
            for r, slot in enumerate(slots):
                want = reference_layer(layer, [v[r:r + 1] for v in inputs],
                                       ring_history(from_bf16_bits(ring[slot]).astype(np.float64), first_pos[r]),
                                       state[slot])
                assert rel_l2(got[r:r + 1], want) < 1e-2, (r, rel_l2(got[r:r + 1], want))
        carried = fused[:2]
    for slot in (1, 2, 5):  # not in the batch
        np.testing.assert_array_equal(carried[0][slot], ring[slot])
        np.testing.assert_array_equal(carried[1][slot], state[slot])


@pytest.mark.parametrize("release,early_gates", [("start", False), ("loads", False), ("outputs", False),
                                                 ("loads", True)])
def test_decode_step_release_points(rng, monkeypatch, release, early_gates):
    """Where the decode step lets out_proj launch (``DECODE_STEP_RELEASE``), and whether it keeps its first item's
    reads from before the PDL wait and computes the decay early (``DECODE_EARLY_GATES``), changes nothing it
    computes: a padded decode-mode step of three sequences equals conv → recurrent rule → gated norm bit for bit
    (the simulator's capped grid also runs later items, which recompute what the first one kept)."""
    import pegainfer.kernels.gated_delta as gd
    monkeypatch.setattr(gd, "DECODE_STEP_RELEASE", release)
    monkeypatch.setattr(gd, "DECODE_EARLY_GATES", early_gates)
    layer = make_decode_layer(rng, key_dim=16, value_dim=16)
    conv_dim = layer["conv_w"].shape[0]
    ring = bf16_randn((6, conv_dim, 4), rng)[0]
    state = (rng.standard_normal((6, layer["num_v_heads"], 16, 16)) * 0.3).astype(np.float32)
    token_slots = [3, 0, 4, -1]
    positions = cuda.to_device(np.array([5, 2, 9, 0], np.int32))
    assert_fused_equals_three_kernels(layer, ring, state, decode_inputs(rng, layer, 4), _table(token_slots, 4),
                                      positions, label=f"{release}: ", decode_slots=token_slots)


def test_decode_step_release_rejects_unknown(rng, monkeypatch):
    """A misspelt ``PEGAINFER_GDN_RELEASE`` is a one-line error naming the choices, not a kernel build failure."""
    import pegainfer.kernels.gated_delta as gd
    from pegainfer.errors import PegainferError
    monkeypatch.setattr(gd, "DECODE_STEP_RELEASE", "later")
    layer = make_decode_layer(rng, key_dim=16, value_dim=16)
    ring = bf16_randn((6, layer["conv_w"].shape[0], 4), rng)[0]
    state = np.zeros((6, layer["num_v_heads"], 16, 16), np.float32)
    with pytest.raises(PegainferError, match="PEGAINFER_GDN_RELEASE"):
        run_linear_step(True, layer, ring, state, decode_inputs(rng, layer, 3), _table([3, 0, 4], 3),
                        cuda.to_device(np.array([5, 2, 9], np.int32)), decode_slots=[3, 0, 4])


def test_decode_step_sequences_of_several_tokens(rng):
    """Token by token with longer sequences (a prompt scored row by row: T == B but one sequence of many tokens):
    lengths 3, 1, 0 (empty: slot 0 untouched) and 5, at positions 6, 0, -, 1.  The block of each key head's first
    value head runs all of them; bit-identical to conv → recurrent rule → gated norm, and close to float64."""
    layer = make_decode_layer(rng)
    num_slots, taps = 4, 4
    conv_dim = layer["conv_w"].shape[0]
    ring = bf16_randn((num_slots, conv_dim, taps), rng)[0]
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], 16, 16)) * 0.3).astype(np.float32)
    lengths, slots, first_pos = [3, 1, 0, 5], [2, 1, 0, 3], [6, 0, 0, 1]
    slot_ids, token_offsets, offsets = sequences(lengths, slots)
    positions = positions_of(lengths, first_pos)
    inputs = decode_inputs(rng, layer, sum(lengths))
    fused = assert_fused_equals_three_kernels(layer, ring, state, inputs, (slot_ids, token_offsets), positions)
    np.testing.assert_array_equal(fused[0][0], ring[0])
    np.testing.assert_array_equal(fused[1][0], state[0])
    got = from_bf16_bits(fused[2]).astype(np.float64)
    for k, (slot, n, p) in enumerate(zip(slots, lengths, first_pos)):
        if n:
            sl = slice(offsets[k], offsets[k + 1])
            want = reference_layer(layer, [v[sl] for v in inputs],
                                   ring_history(from_bf16_bits(ring[slot]).astype(np.float64), p), state[slot])
            assert rel_l2(got[sl], want) < 1e-2, (k, rel_l2(got[sl], want))


def test_prefill_chunks_then_fused_decode(rng):
    """A 7-token prompt prefilled in chunks of 4 and 3 (conv ring, chunked rule, gated norm, each chunk continuing
    from the state the last one left), then 4 fused decode steps: every output row equals the float64 layer over
    all 11 tokens from an empty state, so the ring carries over from prefill to decode (and wraps)."""
    layer = make_decode_layer(rng)
    conv_dim = layer["conv_w"].shape[0]
    hv, width = layer["num_v_heads"], layer["num_v_heads"] * layer["value_dim"]
    d_ring = cuda.to_device(np.zeros((2, conv_dim, 4), np.uint16))
    d_state = cuda.to_device(np.zeros((2, hv, 16, 16), np.float32))
    clear_state_slots(d_ring, d_state, cuda.to_device(np.array([1], np.int32)))
    inputs = decode_inputs(rng, layer, 11)
    conv_w, norm_w, a_log, dt_bias = (cuda.to_device(layer[k]) for k in ("conv_w", "norm_w", "a_log", "dt_bias"))
    outs = []
    for start, n in ((0, 4), (4, 3)):
        x, z, a, b = (cuda.to_device(np.ascontiguousarray(v[start:start + n])) for v in inputs)
        slot_ids, token_offsets, _ = sequences([n], [1])
        positions = positions_of([n], [start])
        mixed = cuda.to_device(np.zeros((n, conv_dim), np.uint16))
        out = cuda.to_device(np.zeros((n, width), np.uint16))
        causal_conv1d_silu(x, conv_w, d_ring, slot_ids, token_offsets, positions, mixed, tokens_per_thread=3)
        scratch = allocate_chunk_scratch(n, layer["num_k_heads"], hv, 4)
        gated_delta_chunked(mixed, a, b, a_log, dt_bias, d_state, slot_ids, token_offsets, out, scratch)
        gated_rms_norm(out, z, norm_w, out, EPS)
        outs.append(out.copy_to_host())
    slot_ids, token_offsets, _ = sequences([1], [1])
    for t in range(7, 11):
        x, z, a, b = (cuda.to_device(np.ascontiguousarray(v[t:t + 1])) for v in inputs)
        out = cuda.to_device(np.zeros((1, width), np.uint16))
        gated_delta_decode_step(x, conv_w, d_ring, z, a, b, a_log, dt_bias, norm_w, EPS, d_state, slot_ids,
                                token_offsets, positions_of([1], [t]), out)
        outs.append(out.copy_to_host())
    got = from_bf16_bits(np.concatenate(outs)).astype(np.float64)
    want = reference_layer(layer, inputs, np.zeros((conv_dim, 3)), np.zeros((hv, 16, 16)))
    for t in range(11):
        assert rel_l2(got[t], want[t]) < 2e-2, (t, rel_l2(got[t], want[t]))
    assert rel_l2(got, want) < 1e-2, rel_l2(got, want)


# ------------------------------------------------------------------------------------------------ state slots
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
    ([4, 4, -1, 4, 1], [0, 2, 2], [4, 0]),               # tokens after the first padding token are ignored
])
def test_sequence_table_ends_at_padding(token_slots, offsets, slots):
    """Padding tokens (slot < 0) belong to no sequence: the table ends at the first one, with a table of exactly
    as many entries as the runner asks for (one logits row per real sequence)."""
    seq_slots = cuda.to_device(np.full(2, -7, np.int32))
    seq_offsets = cuda.to_device(np.full(3, -7, np.int32))
    sequence_table(cuda.to_device(np.array(token_slots, np.int32)), seq_slots, seq_offsets)
    np.testing.assert_array_equal(seq_offsets.copy_to_host(), offsets)
    np.testing.assert_array_equal(seq_slots.copy_to_host(), slots)


def test_empty_sequences_leave_state_alone(rng):
    """Padding entries of the table (empty sequences, slot 0) must not touch slot 0, which a real sequence of the
    same batch updates: every kernel skips them."""
    layer = make_layer(rng, key_dim=8, value_dim=8)
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, 3)
    state = rng.standard_normal((2, layer["num_v_heads"], 8, 8)) * 0.3
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), [0], [3])
    for form in ("recurrent", "chunked"):
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


# ------------------------------------------------------------------------------------------------ padding tokens
NAN_BITS, INF_BITS = 0x7FC0, 0x7F80  # bf16 NaN and +inf


def _poison(bits, num_real, rng):
    """``bits`` [T, ...] with the rows from ``num_real`` on overwritten by NaN, inf and random words: a kernel that
    read a padding row would spread them into the state or the real outputs."""
    out = bits.copy()
    pad = out[num_real:]
    pad[...] = rng.integers(0, 1 << 16, size=pad.shape, dtype=np.uint16)
    pad[:, 0] = NAN_BITS
    pad[:, -1] = INF_BITS
    return out


def _table(token_slots, num_seqs):
    """The device sequence table the model builds from per-token slots (``sequence_table``)."""
    seq_slots = cuda.to_device(np.zeros(num_seqs, np.int32))
    seq_offsets = cuda.to_device(np.zeros(num_seqs + 1, np.int32))
    sequence_table(cuda.to_device(np.asarray(token_slots, np.int32)), seq_slots, seq_offsets)
    return seq_slots, seq_offsets


# (real tokens, padded length, chunk): the last real chunk part real part padding; real tokens an exact multiple of
# the chunk with padding in a chunk of its own; several chunks of nothing but padding; a chunk of 64 (the model's)
PADDED_PREFILLS = [(6, 8, 4), (8, 11, 4), (3, 16, 4), (5, 16, 64)]


@pytest.mark.parametrize("num_real, padded, chunk", PADDED_PREFILLS)
def test_padded_prefill_equals_unpadded(rng, num_real, padded, chunk):
    """One prompt chunk padded to a bucket as the runner pads it (slot -1 after the real tokens), the sequence table
    built from the token slots: conv state, delta-rule state and the real output rows must be bit for bit those of
    the unpadded chunk, with NaN / inf in the padding rows of every input; the rule's padding rows come out zero.
    Both rule forms, each continuing from a non-zero state in slot 1 (slots 0 and 2 untouched)."""
    layer = make_layer(rng, key_dim=8, value_dim=8)
    slot, num_slots = 1, 3
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, padded)
    conv_dim, taps = qkv_bits.shape[1], 4
    w_bits, _ = bf16_randn((conv_dim, taps), rng, scale=0.5)
    conv_bits, _ = bf16_randn((num_slots, conv_dim, taps), rng)
    state = (rng.standard_normal((num_slots, layer["num_v_heads"], 8, 8)) * 0.3).astype(np.float32)
    d_w, d_a_log, d_dt_bias = (cuda.to_device(x) for x in (w_bits, layer["a_log"], layer["dt_bias"]))
    sentinel = 0x1234
    width = layer["num_v_heads"] * layer["value_dim"]

    def run(num_tokens, seq_slots, seq_offsets, form):
        x, a, b = (cuda.to_device(_poison(v[:num_tokens], num_real, rng)) for v in (qkv_bits, a_bits, b_bits))
        d_conv, d_state = cuda.to_device(conv_bits), cuda.to_device(state)
        mixed = cuda.to_device(np.full((num_tokens, conv_dim), sentinel, np.uint16))
        positions = cuda.to_device(np.r_[np.arange(7, 7 + num_real), np.zeros(num_tokens - num_real)].astype(np.int32))
        causal_conv1d_silu(x, d_w, d_conv, seq_slots, seq_offsets, positions, mixed, max_seq_tokens=num_tokens,
                           tokens_per_thread=3)
        mixed_host = mixed.copy_to_host()
        assert (mixed_host[num_real:] == sentinel).all(), "the conv wrote a padding row"
        mixed.copy_to_device(_poison(mixed_host, num_real, rng))  # the rule must not read them either
        out = cuda.to_device(np.full((num_tokens, width), sentinel, np.uint16))
        args = (mixed, a, b, d_a_log, d_dt_bias, d_state, seq_slots, seq_offsets, out)
        if form == "recurrent":
            gated_delta_recurrent(*args)
        else:
            scratch = allocate_chunk_scratch(num_tokens, layer["num_k_heads"], layer["num_v_heads"], chunk)
            gated_delta_chunked(*args, scratch, max_seq_tokens=num_tokens)
        return d_conv.copy_to_host(), d_state.copy_to_host(), mixed_host[:num_real], out.copy_to_host()

    for form in ("chunked", "recurrent"):
        plain = run(num_real, *sequences([num_real], [slot])[:2], form)
        padded_run = run(padded, *_table([slot] * num_real + [-1] * (padded - num_real), 1), form)
        for name, want, got in zip(("conv state", "delta-rule state", "conv output"), plain, padded_run):
            np.testing.assert_array_equal(got, want, err_msg=f"{form}: {name}")
        np.testing.assert_array_equal(padded_run[3][:num_real], plain[3], err_msg=f"{form}: real output rows")
        assert not padded_run[3][num_real:].any(), f"{form}: padding output rows must be zeros"
        for s in (0, 2):
            np.testing.assert_array_equal(padded_run[1][s], state[s])
            np.testing.assert_array_equal(padded_run[0][s], conv_bits[s])
    assert not np.array_equal(plain[1][slot], state[slot]), "the real tokens must have changed the state"


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
                                                 (4, _table([2, 0, -1, -1], 4))):
        x, a, b = (cuda.to_device(_poison(v[:num_tokens], 2, rng)) for v in (qkv_bits, a_bits, b_bits))
        d_conv, d_state = cuda.to_device(conv_bits), cuda.to_device(state)
        mixed = cuda.to_device(np.zeros((num_tokens, conv_dim), np.uint16))
        positions = cuda.to_device(np.array([6, 3, 0, 0][:num_tokens], np.int32))
        causal_conv1d_silu(x, cuda.to_device(w_bits), d_conv, seq_slots, seq_offsets, positions, mixed,
                           max_seq_tokens=1, tokens_per_thread=8)
        out = cuda.to_device(np.full((num_tokens, layer["num_v_heads"] * 8), 0x1234, np.uint16))
        gated_delta_recurrent(mixed, a, b, cuda.to_device(layer["a_log"]), cuda.to_device(layer["dt_bias"]),
                              d_state, seq_slots, seq_offsets, out)
        results.append((d_conv.copy_to_host(), d_state.copy_to_host(), out.copy_to_host()))
    (conv0, state0, out0), (conv1, state1, out1) = results
    np.testing.assert_array_equal(conv1, conv0)
    np.testing.assert_array_equal(state1, state0)
    np.testing.assert_array_equal(out1[:2], out0)
    assert not out1[2:].any()
    np.testing.assert_array_equal(state1[1], state[1])


# ------------------------------------------------------------------------------------------------ GPU, real shapes
QWEN35_4B = dict(num_k_heads=16, num_v_heads=32, key_dim=128, value_dim=128)


@pytest.mark.gpu
def test_gpu_conv1d_qwen35_shapes(rng):
    channels, taps, lengths, slots = 2 * 16 * 128 + 32 * 128, 4, [77, 1, 2], [5, 0, 3]
    x_bits, x = bf16_randn((sum(lengths), channels), rng)
    w_bits, w = bf16_randn((channels, taps), rng, scale=0.5)
    st_bits, st = bf16_randn((8, channels, taps), rng)
    first_pos = [0, 9, 2]
    slot_ids, token_offsets, offsets = sequences(lengths, slots)
    d_state, out = cuda.to_device(st_bits), cuda.to_device(np.zeros_like(x_bits))
    causal_conv1d_silu(cuda.to_device(x_bits), cuda.to_device(w_bits), d_state, slot_ids, token_offsets,
                       positions_of(lengths, first_pos), out)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    expected_state = st.copy()
    for b, (slot, n, p) in enumerate(zip(slots, lengths, first_pos)):
        sl = slice(offsets[b], offsets[b + 1])
        ref, _ = reference_conv(x[sl], w, ring_history(st[slot], p))
        expected_state[slot] = ring_after(st[slot], x[sl], p)
        assert rel_l2(got[sl], ref) < 1e-2
    np.testing.assert_array_equal(from_bf16_bits(d_state.copy_to_host()).astype(np.float64), expected_state)


@pytest.mark.gpu
def test_gpu_decode_step_qwen35_shapes(rng):
    layer = make_layer(rng, **QWEN35_4B)
    slots = [3, 0, 6, 1]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, len(slots))
    state = rng.standard_normal((8, 32, 128, 128)) * 0.05
    got, got_state = run_rule("recurrent", layer, qkv_bits, a_bits, b_bits, state, slots, [1] * len(slots))
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, [1] * len(slots))
    assert rel_l2(got, ref) < 1e-2 and rel_l2(got_state, ref_state) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 16])
def test_gpu_chunked_prompt_qwen35_shapes(rng, chunk):
    layer = make_layer(rng, **QWEN35_4B)
    lengths, slots = [150, 64, 5], [2, 0, 1]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((3, 32, 128, 128)) * 0.05
    rec, rec_state = run_rule("recurrent", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    chk, chk_state = run_rule("chunked", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=chunk)
    assert rel_l2(chk_state, rec_state) < 1e-4 and rel_l2(chk, rec) < 1e-2
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(chk, ref) < 1e-2 and rel_l2(chk_state, ref_state) < 1e-4


@pytest.mark.gpu
def test_gpu_gated_rms_norm_qwen35_shapes(rng):
    tokens, heads, dim = 33, 32, 128
    x_bits, x = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    z_bits, z = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    w = bf16_round(1.0 + 0.1 * rng.standard_normal(dim))
    out = cuda.to_device(np.zeros_like(x_bits))
    gated_rms_norm(cuda.to_device(x_bits), cuda.to_device(z_bits), cuda.to_device(to_bf16_bits(w)), out, EPS)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    xr = x.reshape(tokens, heads, dim)
    n = bf16_round(xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + EPS))
    ref = bf16_round(bf16_round(w * n) * silu(z.reshape(tokens, heads, dim))).reshape(tokens, -1)
    assert rel_l2(got, ref) < 1e-2 and np.mean(got == ref) > 0.97


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,decode,release,tiles,early_gates", [
    ([1, 1, 1, 1], False, "start", None, False), ([1, 1, 1, 1], True, "start", None, False),
    ([1, 1, 1, 1], True, "loads", None, False), ([1, 1, 1, 1], True, "outputs", None, False),
    ([1, 9, 0, 2], False, "start", None, False), ([1, 1, 1, 1], True, "loads", 4, False),
    ([1, 1, 1, 1], True, "loads", None, True), ([1, 1, 1, 1], True, "loads", 4, True)])
def test_gpu_fused_decode_step_qwen35_shapes(rng, monkeypatch, lengths, decode, release, tiles, early_gates):
    """Qwen3.5-4B shapes on the GPU (where FMA contraction and the compiled code could differ): the fused step equals
    conv → recurrent rule → gated norm bit for bit, for a decode batch (also in decode mode: state loaded before
    the PDL wait, with each place it may let out_proj launch, with 4 state tiles per thread besides the default 2:
    256 threads, and keeping the first item's pre-wait reads with the decay computed early) and for sequences of
    several tokens."""
    import pegainfer.kernels.gated_delta as gd
    monkeypatch.setattr(gd, "DECODE_STEP_RELEASE", release)
    monkeypatch.setattr(gd, "DECODE_EARLY_GATES", early_gates)
    layer = make_decode_layer(rng, **QWEN35_4B)
    conv_dim = layer["conv_w"].shape[0]
    ring = bf16_randn((8, conv_dim, 4), rng)[0]
    state = (rng.standard_normal((8, 32, 128, 128)) * 0.05).astype(np.float32)
    slots, first_pos = [5, 0, 3, 6], [0, 2, 9, 40]
    slot_ids, token_offsets, _ = sequences(lengths, slots)
    positions = positions_of(lengths, first_pos)
    inputs = decode_inputs(rng, layer, sum(lengths))
    assert_fused_equals_three_kernels(layer, ring, state, inputs, (slot_ids, token_offsets), positions,
                                      decode_slots=slots if decode else None, tiles_per_thread=tiles)
