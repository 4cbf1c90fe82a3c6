"""RoPE tables (against the formula and against transformers) and the fused q/k-norm + RoPE + paged-KV-store kernel
(against a float64 reference that rounds to bf16 where HF's bf16 forward does)."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.rope import qk_norm_rope_store, rope_tables

EPS = 1e-6
QWEN3 = dict(weight_offset=0.0, round_before_weight=True)
QWEN3_5 = dict(weight_offset=1.0, round_before_weight=False)


# ------------------------------------------------------------------------------------------------ tables
@pytest.mark.parametrize("scaling, position_divisor", [(None, 1.0), ({"rope_type": "default"}, 1.0),
                                                       ({"rope_type": "linear", "factor": 4.0}, 4.0)])
def test_rope_tables_follow_the_formula(scaling, position_divisor):
    max_len, rotary_dim, theta = 5000, 64, 10000.0
    cos, sin = rope_tables(max_len, rotary_dim, theta, scaling)
    assert cos.shape == sin.shape == (max_len, rotary_dim // 2) and cos.dtype == np.uint16
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angle = (np.arange(max_len)[:, None] / position_divisor) * inv_freq[None, :]
    # float32 angles at positions ~5000 carry ~3e-4 absolute error; bf16 has ~4e-3 resolution near 1
    np.testing.assert_allclose(from_bf16_bits(cos), np.cos(angle), atol=6e-3)
    np.testing.assert_allclose(from_bf16_bits(sin), np.sin(angle), atol=6e-3)
    assert from_bf16_bits(cos)[0].tolist() == [1.0] * (rotary_dim // 2)


def test_rope_tables_reject_unknown_type():
    with pytest.raises(ValueError, match="dynamic"):
        rope_tables(16, 8, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("model, head_dim, params", [
    ("qwen3", 128, {"rope_type": "default", "rope_theta": 1e6}),
    ("qwen3.5", 256, {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                      "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
    ("qwen3", 128, {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}),
    ("qwen3", 128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                    "rope_theta": 1e6}),
    ("qwen3", 64, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
                   "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}),
])
def test_rope_tables_match_transformers(model, head_dim, params):
    """Compare with transformers' own rotary embeddings (CPU) out to a long position (70k).  Qwen3.5's multimodal
    RoPE reduces to the plain one for text, where all three position components are equal."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    max_len = 70000
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    config_kwargs = dict(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                         max_position_embeddings=32768 * 4, rope_parameters=dict(params))
    if model == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
        embedding = Qwen3RotaryEmbedding(transformers.Qwen3Config(**config_kwargs))
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
        embedding = Qwen3_5TextRotaryEmbedding(transformers.Qwen3_5TextConfig(**config_kwargs))
    position_ids = torch.arange(max_len)[None]                          # [batch 1, positions]
    if model == "qwen3.5":
        # multimodal RoPE takes (temporal, height, width) position ids [3, batch, positions], equal for text;
        # transformers 5.24 broadcasts [batch, positions] itself, 5.17 needs the three components given
        position_ids = position_ids[None].expand(3, -1, -1)
    hf_cos, hf_sin = embedding(torch.zeros(1, dtype=torch.bfloat16), position_ids)
    assert hf_cos.shape[-1] == rotary_dim
    scaling = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    cos, sin = rope_tables(max_len, rotary_dim, params["rope_theta"], scaling)
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        theirs = theirs[0, :, : rotary_dim // 2].float().numpy()
        ours = from_bf16_bits(ours)
        # torch's float32 pow/cos are not always correctly rounded (ours are): a rare last-bit flip is expected
        assert np.mean(ours != theirs) < 1e-4, np.mean(ours != theirs)
        # ... of at most one bf16 ulp (or a tiny absolute amount near a zero of cos/sin)
        np.testing.assert_allclose(ours, theirs, rtol=2 ** -7, atol=1e-5)


# ------------------------------------------------------------------------------------------------ kernel
def reference_head_norm(x, w, eps, weight_offset, round_before_weight):
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if round_before_weight:
        n = bf16_round(n)
    return bf16_round(n * (weight_offset + w))


def reference_rope(x, cos, sin, rotary_dim):
    """HF bf16 RoPE of heads ``x [..., D]`` with per-token bf16 tables ``cos/sin [..., rotary_dim/2]``."""
    half = rotary_dim // 2
    c = np.concatenate([cos, cos], axis=-1)
    s = np.concatenate([sin, sin], axis=-1)
    rot = x[..., :rotary_dim]
    rotated_half = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = x.copy()
    out[..., :rotary_dim] = bf16_round(bf16_round(rot * c) + bf16_round(rotated_half * s))
    return out


@pytest.mark.parametrize("head_dim, rotary_dim, stride_heads, form", [
    (32, 32, 1, QWEN3),      # Qwen3: full rotary, q heads back to back
    (32, 16, 2, QWEN3_5),    # Qwen3.5: partial rotary, a gate after each q head, (1 + w) norm
    (16, 8, 1, QWEN3_5),
    (16, 6, 2, QWEN3),       # rotary half (3) not a divisor of anything: lanes pair across the warp
    (128, 128, 1, QWEN3),    # the served shapes: half a multiple of 32, the pair partner in the lane's registers
    (256, 64, 2, QWEN3_5),
], ids=["qwen3-d32", "qwen3.5-d32-partial", "d16-partial", "d16-odd-half-gated", "qwen3-d128", "qwen3.5-d256"])
@pytest.mark.parametrize("release", ["start", "after_wait"])
def test_qk_norm_rope_store(rng, monkeypatch, head_dim, rotary_dim, stride_heads, form, release):
    """Against float64 with HF's roundings, at either place the kernel lets attention launch
    (``QK_NORM_RELEASE``: it changes nothing computed)."""
    import pegainfer.kernels.rope as rope_module
    monkeypatch.setattr(rope_module, "QK_NORM_RELEASE", release)
    nq, nkv, page_size, num_pages, max_len = 4, 2, 4, 10, 64
    q_head_stride = stride_heads * head_dim
    # two sequences in slots 2 and 0 and one padding token (slot -1); slot 2 spans pages 7 -> 3 -> 9
    token_slots = np.array([2, 2, 2, 2, 2, 0, 0, -1], dtype=np.int32)
    positions = np.array([2, 3, 4, 5, 9, 30, 31, 0], dtype=np.int32)
    block_tables = np.array([[5, 6, 8, 1, 0, 4, 2, 9], [0, 0, 0, 0, 0, 0, 0, 0], [7, 3, 9, 0, 0, 0, 0, 0]],
                            dtype=np.int32)
    tokens = len(positions)
    row = nq * q_head_stride + 2 * nkv * head_dim
    qkv_bits, qkv = bf16_randn((tokens, row), rng, scale=2.0)
    qw_bits, qw = bf16_randn((head_dim,), rng, scale=0.5)
    kw_bits, kw = bf16_randn((head_dim,), rng, scale=0.5)
    cos_bits, sin_bits = rope_tables(max_len, rotary_dim, 100.0)  # small theta: every dim rotates visibly

    sentinel = 0x7FFF
    k_cache = cuda.to_device(np.full((num_pages, page_size, nkv, head_dim), sentinel, np.uint16))
    v_cache = cuda.to_device(np.full((num_pages, page_size, nkv, head_dim), sentinel, np.uint16))
    q_out = cuda.to_device(np.zeros((tokens, nq, head_dim), np.uint16))
    qk_norm_rope_store(cuda.to_device(qkv_bits), cuda.to_device(qw_bits), cuda.to_device(kw_bits),
                       cuda.to_device(cos_bits), cuda.to_device(sin_bits), cuda.to_device(positions),
                       cuda.to_device(token_slots), cuda.to_device(block_tables), k_cache, v_cache, q_out,
                       EPS, rotary_dim, q_head_stride=q_head_stride, **form)

    # reference
    q = qkv[:, : nq * q_head_stride].reshape(tokens, nq, q_head_stride)[:, :, :head_dim]
    k = qkv[:, nq * q_head_stride: nq * q_head_stride + nkv * head_dim].reshape(tokens, nkv, head_dim)
    v_bits = qkv_bits[:, nq * q_head_stride + nkv * head_dim:].reshape(tokens, nkv, head_dim)
    cos = from_bf16_bits(cos_bits).astype(np.float64)[positions][:, None, :]
    sin = from_bf16_bits(sin_bits).astype(np.float64)[positions][:, None, :]
    q_expected = reference_rope(reference_head_norm(q, qw, EPS, **form), cos, sin, rotary_dim)
    k_expected = reference_rope(reference_head_norm(k, kw, EPS, **form), cos, sin, rotary_dim)

    def check(got_bits, expected):
        got = from_bf16_bits(got_bits).astype(np.float64)
        assert rel_l2(got, expected) < 1e-2, rel_l2(got, expected)
        assert np.mean(got == expected) > 0.97, np.mean(got == expected)

    check(q_out.copy_to_host(), q_expected)

    k_got, v_got = k_cache.copy_to_host(), v_cache.copy_to_host()
    written = np.zeros((num_pages, page_size), bool)
    for t in range(tokens):
        if token_slots[t] < 0:
            continue
        page = block_tables[token_slots[t], positions[t] // page_size]
        offset = positions[t] % page_size
        written[page, offset] = True
        check(k_got[page, offset], k_expected[t])
        np.testing.assert_array_equal(v_got[page, offset], v_bits[t])
    # nothing else in the caches was touched (the padding token stored nothing)
    assert np.all(k_got[~written] == sentinel) and np.all(v_got[~written] == sentinel)


def test_qk_norm_rope_store_rejects_unknown_release(monkeypatch):
    """A misspelt ``PEGAINFER_QK_NORM_RELEASE`` is a one-line error naming the choices."""
    import pegainfer.kernels.rope as rope_module
    from pegainfer.errors import PegainferError
    monkeypatch.setattr(rope_module, "QK_NORM_RELEASE", "early")
    D, nq, nkv = 16, 2, 1
    u16 = lambda *shape: cuda.to_device(np.zeros(shape, np.uint16))
    i32 = lambda *shape: cuda.to_device(np.zeros(shape, np.int32))
    with pytest.raises(PegainferError, match="PEGAINFER_QK_NORM_RELEASE"):
        qk_norm_rope_store(u16(1, (nq + 2 * nkv) * D), u16(D), u16(D), u16(8, D // 2), u16(8, D // 2), i32(1),
                           i32(1), i32(1, 2), u16(2, 4, nkv, D), u16(2, 4, nkv, D), u16(1, nq, D), EPS, D)
