"""``gated_delta.chunked``: the chunked prompt form of the gated delta rule against the reference kernel (and
float64)."""
import numpy as np
import pytest

from tests.kernels.gated_delta_helpers import QWEN35_4B, make_layer, make_tokens, reference_batch, run_rule
from tests.util import rel_l2


def test_chunked_equals_reference(rng):
    """Prompts of 3, 8 and 13 tokens in one varlen batch, each continuing from a non-zero state, with chunks of 4
    and 8 (shorter than, equal to, longer than a chunk; exact multiples and a partial last chunk): the chunked form
    must give the token-by-token result."""
    layer = make_layer(rng)
    lengths, slots = [3, 8, 13], [1, 3, 0]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((4, layer["num_v_heads"], layer["key_dim"], layer["value_dim"])) * 0.3
    rec, rec_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(rec, ref) < 1e-2 and rel_l2(rec_state, ref_state) < 1e-4
    for chunk in (4, 8):
        chk, chk_state = run_rule("chunked", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=chunk)
        assert rel_l2(chk_state, rec_state) < 1e-5, (chunk, rel_l2(chk_state, rec_state))
        assert rel_l2(chk, rec) < 1e-2, (chunk, rel_l2(chk, rec))
        assert np.mean(chk == rec) > 0.95, (chunk, np.mean(chk == rec))  # bf16 outputs: nearly all bit-equal
        assert rel_l2(chk, ref) < 1e-2, (chunk, rel_l2(chk, ref))
        assert rel_l2(chk_state, ref_state) < 1e-4, (chunk, rel_l2(chk_state, ref_state))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 16])
def test_gpu_chunked_prompt_qwen35_shapes(rng, chunk):
    layer = make_layer(rng, **QWEN35_4B)
    lengths, slots = [150, 64, 5], [2, 0, 1]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((3, 32, 128, 128)) * 0.05
    rec, rec_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    chk, chk_state = run_rule("chunked", layer, qkv_bits, a_bits, b_bits, state, slots, lengths, chunk=chunk)
    assert rel_l2(chk_state, rec_state) < 1e-4 and rel_l2(chk, rec) < 1e-2
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(chk, ref) < 1e-2 and rel_l2(chk_state, ref_state) < 1e-4
