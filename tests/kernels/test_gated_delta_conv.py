"""``gated_delta.conv``: the causal conv1d + SiLU and its ring of inputs by position, against float64 NumPy and
transformers' own torch functions."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.gated_delta_helpers import positions_of, reference_conv, ring_after, ring_history, sequences
from tests.util import bf16_randn, from_bf16_bits, rel_l2

from pegainfer.kernels.gated_delta import causal_conv1d_silu


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
