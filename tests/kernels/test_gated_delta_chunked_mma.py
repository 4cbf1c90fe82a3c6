"""``gated_delta.chunked_mma``: the chunked delta rule on tensor cores against the token-by-token reference kernel
and float64.

Tolerances.  The reference kernel (f32, token by token) is within ~1e-7 of float64 in the state.  The tensor-core
form splits every operand that is not a raw bf16 input into two bf16 parts (2⁻¹⁶ relative: ``split_bf16x2``), so its
states sit ~3e-6 from the reference's (measured in the simulator, whose mma sums exactly): asserted < 1e-5, 3× the
margin.  Outputs are rounded to bf16, so an f32 difference that small flips a rounding now and then: ≥ 99 % of them
bit-equal to the reference's, all within bf16 rounding (relative L2 < 1e-2) of float64.  On the GPU the mma's f32
sums (not IEEE round-to-nearest) and 32 chunks of a 2048-token prompt add their own: states < 1e-4, outputs ≥ 95 %
bit-equal.
"""
import numpy as np
import pytest

from tests.kernels.gated_delta_helpers import QWEN35_4B, make_layer, make_tokens, poison, reference_batch, run_rule
from tests.util import rel_l2

from pegainfer.kernels.gated_delta import ChunkGeometry, chunked_mma


def _compare(layer, lengths, slots, state, num_tokens=None, geometry=None, chunk=16, rng=None, state_tol=1e-5,
             same_bits=0.99):
    """Run the tensor-core form and the reference kernel on the same prompts (rows past ``lengths``, up to
    ``num_tokens``, are padding full of NaN / inf) and assert the tolerances of the module docstring."""
    num_real = sum(lengths)
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, num_tokens or num_real)
    qkv_bits, a_bits, b_bits = (poison(x, num_real, rng) for x in (qkv_bits, a_bits, b_bits))
    out, out_state = run_rule("mma", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=chunk,
                              geometry=geometry)
    rec, rec_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    ref, ref_state = reference_batch(layer, qkv[:num_real], a[:num_real], b[:num_real], state.astype(np.float32),
                                     slots, lengths)
    assert rel_l2(out_state, rec_state) < state_tol, rel_l2(out_state, rec_state)
    assert rel_l2(out_state, ref_state) < state_tol, rel_l2(out_state, ref_state)
    assert np.mean(out[:num_real] == rec[:num_real]) >= same_bits, np.mean(out[:num_real] == rec[:num_real])
    assert rel_l2(out[:num_real], ref) < 1e-2, rel_l2(out[:num_real], ref)
    assert (out[num_real:] == 0).all(), "padding rows of the output must be zeros"
    untouched = [s for s in range(state.shape[0]) if s not in slots]
    np.testing.assert_array_equal(out_state[untouched], state.astype(np.float32)[untouched])


def test_mma_chunked_equals_reference(rng):
    """Prompts of 5, 16 and 37 tokens in one batch (shorter than a 16-token chunk, exactly one, two and a partial
    third), each continuing from a non-zero state (a prefix), two value heads a key head, three padding rows of
    NaN / inf: outputs and states must be the token-by-token rule's, slot 2 untouched -- catches a wrong mma
    fragment, a wrong chunk boundary or triangular mask, a state not carried across chunks, GQA heads mixed up."""
    layer = make_layer(rng, num_k_heads=2, num_v_heads=4, key_dim=32, value_dim=16)
    state = rng.standard_normal((4, 4, 32, 16)) * 0.3
    _compare(layer, [5, 16, 37], [1, 3, 0], state, num_tokens=61, rng=rng)


def test_mma_chunked_other_geometry(rng):
    """Chunks of 8 tokens (half a 16-row tile, the rest zero), 2 warps a scan block over 24 value columns (8 of
    the block's 32 past the head), one stage (copies after the compute): the same rule -- catches rows or columns
    of a padded tile leaking into the state, a second warp's columns mixed with the first's."""
    layer = make_layer(rng, num_k_heads=1, num_v_heads=2, key_dim=16, value_dim=24)
    state = rng.standard_normal((2, 2, 16, 24)) * 0.3
    _compare(layer, [11, 20], [1, 0], state, geometry=ChunkGeometry(chunk=8, scan_warps=2, scan_stages=1), chunk=8,
             rng=rng)


def test_prepare_blocks_split_over_value_heads_give_the_same_bits(rng):
    """``prepare_split``: a key head's value heads over 1, 2 or 4 prepare blocks (each computing the key head's Gram
    products itself): outputs and states bit for bit the same, and the reference rule's -- catches a part that
    takes another part's heads, skips one, or writes its factors to another head's rows."""
    layer = make_layer(rng, num_k_heads=1, num_v_heads=4, key_dim=16, value_dim=8)
    state = rng.standard_normal((3, 4, 16, 8)) * 0.3
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, 30)
    runs = [run_rule("mma", layer, qkv_bits, a_bits, b_bits, state, [2, 0], [19, 11], chunk=16,
                     geometry=ChunkGeometry(16, 1, 2, prepare_split=split)) for split in (1, 2, 4)]
    for out, out_state in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(out_state, runs[0][1])
    _compare(layer, [19, 11], [2, 0], state, geometry=ChunkGeometry(16, 1, 2, prepare_split=2), rng=rng)


def test_prepare_split_by_the_launch_size():
    """By default a key head's value heads get a prepare block each while the (sequence, chunk, key head) items
    alone would leave SMs idle (the simulator has 4), one block an item otherwise; a split that does not divide the
    value heads of a key head is refused in one line."""
    geo = ChunkGeometry(64, 4, 2)
    assert geo.prepare_parts(3, 2) == 2 and geo.prepare_parts(4, 2) == 1
    assert ChunkGeometry(64, 4, 2, prepare_split=1).prepare_parts(1, 2) == 1
    with pytest.raises(ValueError, match="prepare_split 3: must divide the 2 value heads"):
        ChunkGeometry(64, 4, 2, prepare_split=3).prepare_parts(1, 2)


def test_prepare_split_counts_the_chunks_of_the_tokens_not_of_padding_sequences(rng, monkeypatch):
    """A mixed step's chunked launch carries padding sequences of no tokens (its rows padded for a CUDA graph): one
    5-token prompt beside seven of them is one chunk of work, so its key head's value heads still get a prepare
    block each (fewer items than the simulator's 4 SMs), and the result is the reference rule's."""
    from pegainfer.kernels import launch as launch_module

    layer = make_layer(rng, num_k_heads=1, num_v_heads=2, key_dim=16, value_dim=8)
    state = rng.standard_normal((8, 2, 16, 8)) * 0.3
    qkv_bits, _, a_bits, _, b_bits, _ = make_tokens(rng, layer, 5)
    lengths, slots = [5] + [0] * 7, list(range(8))
    parts, real = [], launch_module._launch

    def record(kernel, grid, block, args, shared, policy, name):
        if name == "gated_delta_chunk_prepare":
            parts.append(int(args[9]))
        real(kernel, grid, block, args, shared, policy, name)
    monkeypatch.setattr(launch_module, "_launch", record)
    out, out_state = run_rule("mma", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=16)
    rec, rec_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    assert parts == [2], parts
    assert rel_l2(out_state, rec_state) < 1e-5 and np.mean(out == rec) >= 0.99


def test_mma_chunked_rejects_shapes_it_cannot_take():
    """Key dims not a multiple of 16, value dims not a multiple of 8, a chunk past 64: one-line ValueErrors, not a
    kernel that reads past its tiles."""
    for geo, kd, vd in ((ChunkGeometry(64, 2, 2), 24, 16), (ChunkGeometry(64, 2, 2), 32, 12),
                        (ChunkGeometry(65, 2, 2), 32, 16), (ChunkGeometry(64, 2, 3), 32, 16)):
        with pytest.raises(ValueError):
            geo.check(kd, vd)
    assert chunked_mma.ChunkScratch.bytes_per_token(16, 32, 64) == 32 * (8 * 64 + 20)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[2048], [150, 64, 5]])
def test_gpu_mma_chunked_qwen35_shapes(rng, lengths):
    """Qwen3.5-4B's heads (16 key / 32 value heads × 128, chunks of 64) on a 2048-token prompt and a batch of three
    from non-zero states: the reference kernel's result -- catches what the simulator cannot: the inline-PTX mma /
    ldmatrix / cp.async, the GPU geometry (4 warps, 2 stages, ~180 KB of shared memory), register-tile unrolling."""
    layer = make_layer(rng, **QWEN35_4B)
    slots = list(range(len(lengths)))[::-1]
    state = rng.standard_normal((len(lengths), 32, 128, 128)) * 0.05
    _compare(layer, lengths, slots, state, num_tokens=sum(lengths) + 5, chunk=64, rng=rng, state_tol=1e-4,
             same_bits=0.95)
