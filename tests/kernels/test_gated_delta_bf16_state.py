"""The Gated DeltaNet state kept as bf16 bits (``common.state_codec``, vLLM's ``--mamba-ssm-cache-dtype
bfloat16``).  Every kernel widens what it loads and rounds what it stores, so from a state that bf16 holds exactly,
one launch gives the f32 launch's outputs bit for bit and its state rounded to bf16; the fused decode step stays
bit-identical to conv → reference rule → gated norm, through its vector accesses (4 columns a thread), its guarded
pairs (value heads narrower than a thread group's columns) and the copies of a decode block's next state into
shared memory."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.gated_delta_helpers import (QWEN35_4B, assert_fused_equals_three_kernels, decode_inputs,
                                               make_decode_layer, make_layer, make_tokens, run_linear_step, run_rule,
                                               table_of)
from tests.util import bf16_randn, from_bf16_bits, to_bf16_bits

from pegainfer.kernels.gated_delta import clear_state_slots, copy_state_slots
from pegainfer.kernels.primitives import sm_count


def bf16_state(rng, shape, scale=0.3):
    """A random state as bf16 bits, and the same values as f32 (exact)."""
    bits = to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))
    return bits, from_bf16_bits(bits).astype(np.float32)


def rounded(state_f32):
    return to_bf16_bits(state_f32)


@pytest.mark.parametrize("key_dim, value_dim, tiles_per_thread, decode", [
    (16, 16, None, False),   # half a thread group's columns: the guarded pairs
    (16, 16, None, True),    # decode mode: the first item before the wait, later ones copied into shared memory
    (16, 64, None, True),    # whole 2-column pairs, one word a row
    (16, 128, 4, False),     # 4 columns a thread: two words a row in one 8-byte access
])
def test_decode_step_on_a_bf16_state(rng, key_dim, value_dim, tiles_per_thread, decode):
    """Three decode steps of three sequences (and a padded fourth row): the fused step equals conv → reference
    rule → gated norm bit for bit on a bf16 state, and gives the f32 state's outputs and its state rounded."""
    layer = make_decode_layer(rng, key_dim=key_dim, value_dim=value_dim)
    ring = bf16_randn((6, layer["conv_w"].shape[0], 4), rng)[0]
    bits, exact = bf16_state(rng, (6, layer["num_v_heads"], key_dim, value_dim))
    token_slots = [3, 0, 4, -1]
    if decode:
        assert 3 * layer["num_v_heads"] > sm_count() or key_dim * value_dim * 2 % 16, "later items, copied"
    for step in range(3):
        positions = cuda.to_device(np.array([5 + step, 2 + step, 9 + step, 0], np.int32))
        inputs = decode_inputs(rng, layer, 4)
        table = table_of(token_slots, 4)
        fused = assert_fused_equals_three_kernels(layer, ring, bits, inputs, table, positions,
                                                  label=f"step {step}: ", tiles_per_thread=tiles_per_thread,
                                                  decode_slots=token_slots if decode else None)
        f32 = run_linear_step(True, layer, ring, exact, inputs, table, positions,
                              tiles_per_thread=tiles_per_thread, decode_slots=token_slots if decode else None)
        assert fused[1].dtype == np.uint16
        np.testing.assert_array_equal(fused[2], f32[2], err_msg=f"step {step}: outputs")
        np.testing.assert_array_equal(fused[1], rounded(f32[1]), err_msg=f"step {step}: state")
        np.testing.assert_array_equal(fused[0], f32[0], err_msg=f"step {step}: conv ring")
        ring, bits = fused[0], fused[1]
        exact = from_bf16_bits(bits).astype(np.float32)
    for slot in (1, 2, 5):
        assert not np.any(bits[slot] != to_bf16_bits(exact[slot]))


def test_an_odd_tile_count_is_refused_for_a_bf16_state(rng):
    layer = make_decode_layer(rng, key_dim=16, value_dim=64)
    ring = bf16_randn((2, layer["conv_w"].shape[0], 4), rng)[0]
    bits, _ = bf16_state(rng, (2, layer["num_v_heads"], 16, 64))
    with pytest.raises(ValueError, match="a bf16 state needs an even tiles_per_thread"):
        run_linear_step(True, layer, ring, bits, decode_inputs(rng, layer, 1), table_of([1], 1),
                        cuda.to_device(np.array([3], np.int32)), tiles_per_thread=1)


def _rule(form, layer, tokens, state, slots, lengths):
    """``run_rule`` of ``tokens`` (``make_tokens``' bits) from ``state``."""
    qkv_bits, _, a_bits, _, b_bits, _ = tokens
    return run_rule(form, layer, qkv_bits, a_bits, b_bits, state, slots, lengths)


def test_chunked_prefill_on_a_bf16_state(rng):
    """Prompts of 7 and 5 tokens in chunks of 4 (two chunks each, the state carried across them in f32 registers):
    the same outputs as from the f32 state, and its final state rounded once."""
    layer = make_layer(rng, key_dim=16, value_dim=16)
    tokens = make_tokens(rng, layer, 12)
    bits, exact = bf16_state(rng, (4, layer["num_v_heads"], 16, 16))
    out16, state16 = _rule("mma", layer, tokens, bits, [2, 0], [7, 5])
    out32, state32 = _rule("mma", layer, tokens, exact, [2, 0], [7, 5])
    np.testing.assert_array_equal(out16, out32)
    np.testing.assert_array_equal(state16, rounded(state32))
    np.testing.assert_array_equal(state16[[1, 3]], bits[[1, 3]])        # slots not in the batch


def test_the_reference_rounds_the_state_after_every_token(rng):
    """The token-by-token reference keeps the state in memory, so a bf16 state is rounded after each token: one
    token gives the f32 run's output and rounded state; a sequence of three equals three one-token launches."""
    layer = make_layer(rng, key_dim=16, value_dim=8)
    tokens = make_tokens(rng, layer, 3)
    bits, exact = bf16_state(rng, (2, layer["num_v_heads"], 16, 8))
    first = tuple(t[:1] for t in tokens)
    out16, state16 = _rule("reference", layer, first, bits, [1], [1])
    out32, state32 = _rule("reference", layer, first, exact, [1], [1])
    np.testing.assert_array_equal(out16, out32)
    np.testing.assert_array_equal(state16, rounded(state32))
    whole_out, whole_state = _rule("reference", layer, tokens, bits, [1], [3])
    state, outs = bits, []
    for t in range(3):
        out, state = _rule("reference", layer, tuple(v[t:t + 1] for v in tokens), state, [1], [1])
        outs.append(out)
    np.testing.assert_array_equal(whole_out, np.concatenate(outs))
    np.testing.assert_array_equal(whole_state, state)


def test_state_slots_clear_and_copy_a_bf16_state(rng):
    conv = bf16_randn((5, 12, 4), rng)[0]
    bits, _ = bf16_state(rng, (5, 2, 8, 8))
    d_conv, d_state = cuda.to_device(conv), cuda.to_device(bits)
    copy_state_slots(d_conv, d_state, cuda.to_device(np.array([1, 3], np.int32)),
                     cuda.to_device(np.array([4, 0], np.int32)))
    clear_state_slots(d_conv, d_state, cuda.to_device(np.array([2], np.int32)))
    got_conv, got_state = d_conv.copy_to_host(), d_state.copy_to_host()
    want_conv, want_state = conv.copy(), bits.copy()
    want_conv[[4, 0]], want_state[[4, 0]] = conv[[1, 3]], bits[[1, 3]]
    want_conv[2], want_state[2] = 0, 0
    np.testing.assert_array_equal(got_conv, want_conv)
    np.testing.assert_array_equal(got_state, want_state)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [None, 4])
def test_gpu_decode_step_on_a_bf16_state_qwen35_shapes(rng, tiles):
    """Qwen3.5-4B shapes on the GPU, a decode step of 8 sequences and 2 padding rows (320 items: later ones copied
    into shared memory, 32 KB each): bit-identical to conv → reference rule → gated norm, and to the f32 state's
    step rounded."""
    layer = make_decode_layer(rng, **QWEN35_4B)
    ring = bf16_randn((10, layer["conv_w"].shape[0], 4), rng)[0]
    bits, exact = bf16_state(rng, (10, 32, 128, 128), scale=0.05)
    token_slots = [5, 0, 3, 6, 9, 1, 8, 2, -1, -1]
    positions = cuda.to_device(np.array([0, 2, 9, 40, 3, 7, 1, 100, 0, 0], np.int32))
    inputs = decode_inputs(rng, layer, 10)
    fused = assert_fused_equals_three_kernels(layer, ring, bits, inputs, table_of(token_slots, 10), positions,
                                              decode_slots=token_slots, tiles_per_thread=tiles)
    f32 = run_linear_step(True, layer, ring, exact, inputs, table_of(token_slots, 10), positions,
                          decode_slots=token_slots, tiles_per_thread=tiles)
    np.testing.assert_array_equal(fused[2], f32[2])
    np.testing.assert_array_equal(fused[1], rounded(f32[1]))
