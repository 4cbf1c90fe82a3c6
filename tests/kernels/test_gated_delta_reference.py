"""``gated_delta.reference``: the token-by-token gated delta rule against float64 NumPy and against transformers'
own torch functions (the chunked form on tensor cores is checked against the same torch functions here too)."""
import numpy as np
import pytest

from tests.kernels.gated_delta_helpers import (QWEN35_4B, make_layer, make_tokens, reference_batch, reference_gates,
                                               run_rule)
from tests.util import rel_l2


def test_reference_matches_float64(rng):
    """Two sequences (3 and 5 tokens, GQA ratio 2) continuing from random states: outputs within bf16 rounding of
    float64, states to 1e-4; a slot outside the batch is untouched."""
    layer = make_layer(rng)
    lengths, slots = [3, 5], [2, 0]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, sum(lengths))
    state = rng.standard_normal((3, layer["num_v_heads"], layer["key_dim"], layer["value_dim"])) * 0.3
    got, got_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, lengths)
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, lengths)
    assert rel_l2(got, ref) < 1e-2, rel_l2(got, ref)
    assert rel_l2(got_state, ref_state) < 1e-4, rel_l2(got_state, ref_state)
    np.testing.assert_array_equal(got_state[1], state[1].astype(np.float32))  # slot not in the batch: untouched


def test_rule_matches_hf_torch(rng):
    """The reference and the chunked form (chunks of 4: one full, one partial) against transformers'
    torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (f32 on CPU)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    layer = make_layer(rng, key_dim=16, value_dim=16)   # (the tensor-core chunked form takes key dims by 16)
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
    for form in ("reference", "mma"):
        got, got_state = run_rule(form, layer, qkv_bits, a_bits, b_bits, state, [0], [num_tokens])
        for hf_out, hf_state in ((hf_chunk, hf_chunk_state), (hf_rec, hf_rec_state)):
            assert rel_l2(got, hf_out[0].reshape(num_tokens, -1).double().numpy()) < 1e-2, form
            assert rel_l2(got_state[0], hf_state[0].double().numpy()) < 1e-4, form


@pytest.mark.gpu
def test_gpu_reference_qwen35_shapes(rng):
    """A decode batch of four one-token sequences at Qwen3.5-4B shapes against float64."""
    layer = make_layer(rng, **QWEN35_4B)
    slots = [3, 0, 6, 1]
    qkv_bits, qkv, a_bits, a, b_bits, b = make_tokens(rng, layer, len(slots))
    state = rng.standard_normal((8, 32, 128, 128)) * 0.05
    got, got_state = run_rule("reference", layer, qkv_bits, a_bits, b_bits, state, slots, [1] * len(slots))
    ref, ref_state = reference_batch(layer, qkv, a, b, state.astype(np.float32), slots, [1] * len(slots))
    assert rel_l2(got, ref) < 1e-2 and rel_l2(got_state, ref_state) < 1e-4
