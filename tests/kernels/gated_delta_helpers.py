"""What the Gated DeltaNet tests share: float64 NumPy references of the conv, the gates, the delta rule and the whole
layer step (HF's bf16 roundings), random layers and inputs, and runners of the kernels on host arrays."""
import numpy as np
from numba import cuda

from tests.util import bf16_randn, bf16_round, from_bf16_bits, to_bf16_bits

from pegainfer.kernels.gated_delta import (allocate_chunk_scratch, causal_conv1d_silu, gated_delta_chunked,
                                           gated_delta_decode_step, gated_rms_norm, reference_gated_delta,
                                           sequence_table)
from pegainfer.kernels.policy import DEFAULT_POLICY

EPS = 1e-6
QWEN35_4B = dict(num_k_heads=16, num_v_heads=32, key_dim=128, value_dim=128)
NAN_BITS, INF_BITS = 0x7FC0, 0x7F80  # bf16 NaN and +inf


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


def reference_gated_norm(x, z, w):
    """HF's bf16 RMSNormGated in float64: x, z [T, heads, Dv], w [Dv] → [T, heads·Dv]."""
    n = bf16_round(x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS))
    return bf16_round(bf16_round(w * n) * silu(z)).reshape(x.shape[0], -1)


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


def reference_layer(layer, inputs, history, state):
    """float64 Gated DeltaNet step of one sequence: x [T, C] etc. as bf16 bits, history [C, K-1] (the inputs before
    it), state [Hv, Dk, Dv] → the gated-norm output [T, Hv·Dv] with HF's bf16 roundings."""
    x, z, a, b = (from_bf16_bits(v).astype(np.float64) for v in inputs)
    w = from_bf16_bits(layer["conv_w"]).astype(np.float64)
    mixed, _ = reference_conv(x, w, history)
    g, beta = reference_gates(a, b, layer["a_log"].astype(np.float64), layer["dt_bias"].astype(np.float64))
    core, _ = reference_rule(mixed, g, beta, state.astype(np.float64), layer["num_k_heads"], layer["key_dim"])
    o = bf16_round(core).reshape(x.shape[0], layer["num_v_heads"], -1)
    norm_w = from_bf16_bits(layer["norm_w"]).astype(np.float64)
    return reference_gated_norm(o, z.reshape(o.shape), norm_w)


# ------------------------------------------------------------------------------------------------ inputs
def sequences(lengths, slots):
    """(slot_ids, token_offsets) on the device and the offsets on the host, of sequences of ``lengths`` tokens."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return cuda.to_device(np.asarray(slots, np.int32)), cuda.to_device(offsets), offsets


def positions_of(lengths, first_positions):
    """Per-token positions [T] int32 (device) of sequences of ``lengths`` tokens starting at ``first_positions``."""
    return cuda.to_device(np.concatenate([np.arange(p, p + n) for n, p in zip(lengths, first_positions)] +
                                         [np.zeros(0)]).astype(np.int32))


def table_of(token_slots, num_seqs):
    """The device sequence table the model builds from per-token slots (``sequence_table``)."""
    seq_slots = cuda.to_device(np.zeros(num_seqs, np.int32))
    seq_offsets = cuda.to_device(np.zeros(num_seqs + 1, np.int32))
    sequence_table(cuda.to_device(np.asarray(token_slots, np.int32)), seq_slots, seq_offsets)
    return seq_slots, seq_offsets


def poison(bits, num_real, rng):
    """``bits`` [T, ...] with the rows from ``num_real`` on overwritten by NaN, inf and random words: a kernel that
    read a padding row would spread them into the state or the real outputs."""
    out = bits.copy()
    pad = out[num_real:]
    pad[...] = rng.integers(0, 1 << 16, size=pad.shape, dtype=np.uint16)
    pad[:, 0] = NAN_BITS
    pad[:, -1] = INF_BITS
    return out


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


# ------------------------------------------------------------------------------------------------ runners
def run_rule(form, layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=4, geometry=None):
    """Run the reference kernel (``form="reference"``) or the chunked one on tensor cores (``"mma"``, chunks of
    ``chunk`` tokens, at ``geometry`` if given) on ``lengths`` tokens of sequences in ``slots`` (rows of ``qkv_bits``
    past them: padding); returns (out as float64, final state).  A state of bf16 bits (uint16) stays one, any other
    becomes f32."""
    slot_ids, token_offsets, _ = sequences(lengths, slots)
    d_state = cuda.to_device(state if state.dtype == np.uint16 else state.astype(np.float32))
    out = cuda.to_device(np.zeros((qkv_bits.shape[0], layer["num_v_heads"] * layer["value_dim"]), np.uint16))
    args = (cuda.to_device(qkv_bits), cuda.to_device(a_bits), cuda.to_device(b_bits),
            cuda.to_device(layer["a_log"]), cuda.to_device(layer["dt_bias"]), d_state, slot_ids, token_offsets, out)
    if form == "reference":
        reference_gated_delta(*args)
    else:
        assert form == "mma", form
        scratch = allocate_chunk_scratch(qkv_bits.shape[0], layer["num_k_heads"], layer["num_v_heads"], chunk)
        options = dict(geometry=geometry) if geometry is not None else {}
        gated_delta_chunked(*args, scratch, max_seq_tokens=max(lengths), **options)
    return from_bf16_bits(out.copy_to_host()).astype(np.float64), d_state.copy_to_host()


def run_linear_step(fused, layer, ring, state, inputs, table, positions, row_groups=None, decode_slots=None,
                    tiles_per_thread=None, policy=DEFAULT_POLICY):
    """One Gated DeltaNet step from host ``ring`` [slots, C, K] / ``state`` [slots, Hv, Dk, Dv]: the fused decode
    step (``decode_slots``: in decode mode, given the per-token slots; ``tiles_per_thread`` and ``policy`` its
    own), or conv → reference rule → gated norm (``row_groups`` warps); returns the new (ring, state, out)."""
    x, z, a, b = (cuda.to_device(v) for v in inputs)
    slot_ids, token_offsets = table
    d_ring, d_state = cuda.to_device(ring), cuda.to_device(state)
    num_tokens = x.shape[0]
    out = cuda.to_device(np.full((num_tokens, z.shape[1]), 0x1234, np.uint16))
    conv_w, norm_w, a_log, dt_bias = (cuda.to_device(layer[k]) for k in ("conv_w", "norm_w", "a_log", "dt_bias"))
    if fused:
        options = {} if row_groups is None else dict(row_groups=row_groups)
        if tiles_per_thread is not None:
            options["tiles_per_thread"] = tiles_per_thread
        if decode_slots is not None:
            options["decode_token_slots"] = cuda.to_device(np.asarray(decode_slots, np.int32))
        gated_delta_decode_step(x, conv_w, d_ring, z, a, b, a_log, dt_bias, norm_w, EPS, d_state, slot_ids,
                                token_offsets, positions, out, policy=policy, **options)
    else:
        mixed = cuda.to_device(np.zeros((num_tokens, conv_w.shape[0]), np.uint16))
        causal_conv1d_silu(x, conv_w, d_ring, slot_ids, token_offsets, positions, mixed, max_seq_tokens=num_tokens,
                           tokens_per_thread=max(3, num_tokens))
        reference_gated_delta(mixed, a, b, a_log, dt_bias, d_state, slot_ids, token_offsets, out,
                              **({} if row_groups is None else dict(warps=row_groups)))
        gated_rms_norm(out, z, norm_w, out, EPS)
    return d_ring.copy_to_host(), d_state.copy_to_host(), out.copy_to_host()


def assert_fused_equals_three_kernels(layer, ring, state, inputs, table, positions, row_groups=None, label="",
                                      decode_slots=None, tiles_per_thread=None, policy=DEFAULT_POLICY):
    """Run the fused step and conv → reference rule → gated norm on the same inputs; the new ring, state and
    output must be equal bit for bit.  Returns the fused step's (ring, state, out)."""
    fused = run_linear_step(True, layer, ring, state, inputs, table, positions, row_groups, decode_slots,
                            tiles_per_thread, policy)
    ref = run_linear_step(False, layer, ring, state, inputs, table, positions, row_groups)
    for name, got, want in zip(("conv ring", "delta-rule state", "output"), fused, ref):
        np.testing.assert_array_equal(got, want, err_msg=f"{label}{name}")
    return fused
