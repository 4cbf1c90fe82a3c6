"""RoPE tables (against the formula and against transformers); the reference q/k-norm + RoPE + paged-KV-store kernel
against a float64 computation that rounds to bf16 where HF's bf16 forward does, and the tuned kernel against the
reference kernel (the same bits but for a rare last-place flip of the norm's f32 sum), and its warps of 2 or 4 heads
against its warps of one (the same bits)."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels import timeline
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.rope import qk_norm_rope_store, reference_qk_norm_rope_store, rope_tables
from pegainfer.kernels.rope import store
from pegainfer.kernels.rope.store import MIN_TOKENS_FOR_HEAD_GROUPS, choose_heads_per_warp

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


SENTINEL = 0x7FFF


class StoreCase:
    """One ``qk_norm_rope_store`` call: two sequences in slots 2 and 0 and a padding token (slot -1); slot 2 spans
    pages 7 -> 3 -> 9; caches filled with a sentinel so that stray writes show."""

    def __init__(self, rng, head_dim, rotary_dim, stride_heads, form, nq=4, nkv=2):
        self.nq, self.nkv, self.page_size, self.num_pages, max_len = nq, nkv, 4, 10, 64
        self.head_dim, self.rotary_dim, self.form = head_dim, rotary_dim, form
        self.q_head_stride = stride_heads * head_dim
        self.token_slots = np.array([2, 2, 2, 2, 2, 0, 0, -1], dtype=np.int32)
        self.positions = np.array([2, 3, 4, 5, 9, 30, 31, 0], dtype=np.int32)
        self.block_tables = np.array([[5, 6, 8, 1, 0, 4, 2, 9], [0] * 8, [7, 3, 9, 0, 0, 0, 0, 0]], dtype=np.int32)
        self.tokens = len(self.positions)
        row = nq * self.q_head_stride + 2 * nkv * head_dim
        self.qkv_bits, self.qkv = bf16_randn((self.tokens, row), rng, scale=2.0)
        self.qw_bits, self.qw = bf16_randn((head_dim,), rng, scale=0.5)
        self.kw_bits, self.kw = bf16_randn((head_dim,), rng, scale=0.5)
        self.cos_bits, self.sin_bits = rope_tables(max_len, rotary_dim, 100.0)  # small theta: every dim rotates

    def run(self, fn=qk_norm_rope_store, **kwargs):
        """(q_out, k_cache, v_cache) bits after ``fn``."""
        cache_shape = (self.num_pages, self.page_size, self.nkv, self.head_dim)
        k_cache = cuda.to_device(np.full(cache_shape, SENTINEL, np.uint16))
        v_cache = cuda.to_device(np.full(cache_shape, SENTINEL, np.uint16))
        q_out = cuda.to_device(np.zeros((self.tokens, self.nq, self.head_dim), np.uint16))
        fn(*(cuda.to_device(a) for a in (self.qkv_bits, self.qw_bits, self.kw_bits, self.cos_bits, self.sin_bits,
                                         self.positions, self.token_slots, self.block_tables)),
           k_cache, v_cache, q_out, EPS, self.rotary_dim, q_head_stride=self.q_head_stride, **self.form, **kwargs)
        return q_out.copy_to_host(), k_cache.copy_to_host(), v_cache.copy_to_host()

    def float64(self):
        """(q, k, v) of every token as the model computes them (float64 with HF's bf16 roundings)."""
        nq, nkv, D, qs = self.nq, self.nkv, self.head_dim, self.q_head_stride
        q = self.qkv[:, : nq * qs].reshape(self.tokens, nq, qs)[:, :, :D]
        k = self.qkv[:, nq * qs: nq * qs + nkv * D].reshape(self.tokens, nkv, D)
        v_bits = self.qkv_bits[:, nq * qs + nkv * D:].reshape(self.tokens, nkv, D)
        cos = from_bf16_bits(self.cos_bits).astype(np.float64)[self.positions][:, None, :]
        sin = from_bf16_bits(self.sin_bits).astype(np.float64)[self.positions][:, None, :]
        return (reference_rope(reference_head_norm(q, self.qw, EPS, **self.form), cos, sin, self.rotary_dim),
                reference_rope(reference_head_norm(k, self.kw, EPS, **self.form), cos, sin, self.rotary_dim), v_bits)

    def cache_rows(self):
        """(token, page, offset) of every token whose k / v are stored (not the padding token)."""
        return [(t, self.block_tables[self.token_slots[t], self.positions[t] // self.page_size],
                 self.positions[t] % self.page_size) for t in range(self.tokens) if self.token_slots[t] >= 0]


SHAPES = pytest.mark.parametrize("head_dim, rotary_dim, stride_heads, form", [
    (32, 32, 1, QWEN3),      # Qwen3: full rotary, q heads back to back
    (32, 16, 2, QWEN3_5),    # Qwen3.5: partial rotary, a gate after each q head, (1 + w) norm
    (16, 8, 1, QWEN3_5),
    (16, 6, 2, QWEN3),       # rotary half (3) not a divisor of anything: lanes pair across the warp
    (128, 128, 1, QWEN3),    # the served shapes: half a multiple of 32, the pair partner in the lane's registers
    (256, 64, 2, QWEN3_5),
], ids=["qwen3-d32", "qwen3.5-d32-partial", "d16-partial", "d16-odd-half-gated", "qwen3-d128", "qwen3.5-d256"])


@pytest.mark.parametrize("head_dim, rotary_dim, stride_heads, form", [(32, 32, 1, QWEN3), (32, 16, 2, QWEN3_5),
                                                                       (16, 6, 2, QWEN3)],
                         ids=["qwen3", "qwen3.5-partial", "odd-half-gated"])
def test_reference_against_float64(rng, head_dim, rotary_dim, stride_heads, form):
    """The reference kernel against float64 with HF's roundings: q, the k / v rows of every stored token, nothing
    else in the caches touched (the padding token stores nothing)."""
    case = StoreCase(rng, head_dim, rotary_dim, stride_heads, form)
    q_got, k_got, v_got = case.run(reference_qk_norm_rope_store)
    q_want, k_want, v_want = case.float64()

    def check(got_bits, expected):
        got = from_bf16_bits(got_bits).astype(np.float64)
        assert rel_l2(got, expected) < 1e-2, rel_l2(got, expected)
        assert np.mean(got == expected) > 0.97, np.mean(got == expected)

    check(q_got, q_want)
    written = np.zeros((case.num_pages, case.page_size), bool)
    for t, page, offset in case.cache_rows():
        written[page, offset] = True
        check(k_got[page, offset], k_want[t])
        np.testing.assert_array_equal(v_got[page, offset], v_want[t])
    assert np.all(k_got[~written] == SENTINEL) and np.all(v_got[~written] == SENTINEL)


def assert_bits_near(got, ref):
    """Equal bits but for rare flips by one bf16 step (the norm's f32 sum of squares is reduced in another order
    by the tuned kernel: its 1/rms may differ in the last f32 bit)."""
    diff = np.abs(got.astype(np.int32) - ref.astype(np.int32))
    assert diff.max() <= 1 and np.mean(diff == 0) >= 0.995, (diff.max(), np.mean(diff == 0))


@SHAPES
def test_qk_norm_rope_store(rng, head_dim, rotary_dim, stride_heads, form):
    """The tuned kernel against the reference kernel: q and both caches (including the untouched sentinel rows)."""
    case = StoreCase(rng, head_dim, rotary_dim, stride_heads, form)
    for got, ref in zip(case.run(), case.run(reference_qk_norm_rope_store)):
        assert_bits_near(got, ref)


@pytest.mark.parametrize("nq, nkv, heads_per_warp", [(8, 4, 4), (6, 2, 2)], ids=["8q-4kv-by4", "6q-2kv-by2"])
@SHAPES
def test_qk_norm_rope_store_head_groups(rng, nq, nkv, heads_per_warp, head_dim, rotary_dim, stride_heads, form):
    """Warps of 2 or 4 heads (one kind, one token; 6 q heads: only 2 or 1 divides) write the bits of warps of one
    head, and match the reference kernel: q and both caches, the padding token's k / v not stored."""
    case = StoreCase(rng, head_dim, rotary_dim, stride_heads, form, nq=nq, nkv=nkv)
    grouped = case.run(heads_per_warp=heads_per_warp)
    for got, one_head in zip(grouped, case.run(heads_per_warp=1)):
        np.testing.assert_array_equal(got, one_head)
    for got, ref in zip(grouped, case.run(reference_qk_norm_rope_store)):
        assert_bits_near(got, ref)


def test_choose_heads_per_warp():
    """One head a warp for few tokens (a decode step), else the largest of 4, 2, 1 dividing both head counts."""
    many = MIN_TOKENS_FOR_HEAD_GROUPS
    assert choose_heads_per_warp(many - 1, 32, 8) == 1
    assert choose_heads_per_warp(many, 32, 8) == 4          # Qwen3-4B
    assert choose_heads_per_warp(2112, 16, 4) == 4          # Qwen3.5-4B
    assert choose_heads_per_warp(many, 6, 2) == 2
    assert choose_heads_per_warp(many, 12, 2) == 2
    assert choose_heads_per_warp(many, 3, 1) == 1


def test_qk_norm_rope_store_picks_heads_per_warp(rng, monkeypatch):
    """Without ``heads_per_warp`` the launch builds its kernel for ``choose_heads_per_warp``'s count, and
    rejects a count that does not divide both head counts."""
    built, real = [], store.qk_norm_rope_kernel
    monkeypatch.setattr(store, "qk_norm_rope_kernel",
                        lambda head_dim, rotary_dim, heads_per_warp, stamps: built.append(heads_per_warp)
                        or real(head_dim, rotary_dim, heads_per_warp, stamps))
    case = StoreCase(rng, 16, 16, 1, QWEN3, nq=8, nkv=4)
    case.run()                                                      # 8 tokens: one head a warp
    monkeypatch.setattr(store, "MIN_TOKENS_FOR_HEAD_GROUPS", case.tokens)
    case.run()
    assert built == [1, 4]
    with pytest.raises(AssertionError):
        StoreCase(rng, 16, 16, 1, QWEN3, nq=6, nkv=2).run(heads_per_warp=4)


def test_qk_norm_rope_store_stamps_the_timeline(rng):
    """``policy.timeline``: every block appends one ``qk_norm_rope`` record (kind 4) with ordered stamps, and the
    results keep their bits."""
    case = StoreCase(rng, 32, 32, 1, QWEN3)
    plain = case.run(decode=True)
    timeline.reset()
    try:
        stamped = case.run(decode=True, policy=LaunchPolicy(timeline=True))
        rec = timeline.records()
    finally:
        timeline.reset()
    for a, b in zip(stamped, plain):
        np.testing.assert_array_equal(a, b)
    assert len(rec) == int(rec["grid"][0]) > 0 and set(rec["kind"].tolist()) == {4}
    assert sorted(rec["block"].tolist()) == list(range(len(rec)))
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_end"])


def test_qk_norm_rope_store_launch_follows_the_policy(rng, monkeypatch):
    """The launch carries the caller's policy, named ``qk_norm_rope_store_decode`` for a decode step (the name the
    policy's PDL set uses) and ``qk_norm_rope_store`` for a prompt chunk."""
    from pegainfer.kernels import launch as launch_module

    seen, real = [], launch_module._launch

    def record(kernel, grid, block, args, shared, policy, name):
        seen.append((name, policy))
        real(kernel, grid, block, args, shared, policy, name)

    monkeypatch.setattr(launch_module, "_launch", record)
    policy = LaunchPolicy(pdl=frozenset())
    case = StoreCase(rng, 16, 16, 1, QWEN3)
    case.run(decode=True, policy=policy)
    case.run(policy=policy)
    assert seen == [("qk_norm_rope_store_decode", policy), ("qk_norm_rope_store", policy)]
