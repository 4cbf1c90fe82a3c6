"""RMSNorm and fused add+RMSNorm in both roundings (Qwen3: two roundings; Qwen3.5: 1+w, one rounding): the tuned
kernel against the reference kernel, the reference against float64 NumPy, the tuned kernel against HF's modules."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.norm import (add_rms_norm, add_rms_norm_into, reference_add_rms_norm, reference_rms_norm,
                                    rms_norm)

EPS = 1e-6
QWEN3 = dict(weight_offset=0.0, round_before_weight=True)
QWEN3_5 = dict(weight_offset=1.0, round_before_weight=False)
FORMS = pytest.mark.parametrize("form", [QWEN3, QWEN3_5], ids=["qwen3", "qwen3.5"])


def numpy_rms_norm(x, w, eps, weight_offset, round_before_weight):
    """float64 RMSNorm rounding to bf16 where HF does (x, w: float64 values of bf16s, rows = tokens)."""
    n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if round_before_weight:
        n = bf16_round(n)
    return bf16_round(n * (weight_offset + w))


def assert_close_to_numpy(got_bits, expected):
    got = from_bf16_bits(got_bits).astype(np.float64)
    assert rel_l2(got, expected) < 1e-2, rel_l2(got, expected)
    # f32 (kernel) vs f64 (NumPy) may flip a rounding now and then; nearly every value must be bit-exact
    assert np.mean(got == expected) > 0.97, np.mean(got == expected)


def assert_within_one_ulp(tuned_bits, reference_bits):
    """The tuned and reference norms differ only in the order of the f32 sum of squares (``norm.reference``): at most
    one bf16 ulp apart, and nearly always equal."""
    diff = np.abs(tuned_bits.astype(np.int32) - reference_bits.astype(np.int32))
    assert diff.max() <= 1 and np.mean(diff == 0) >= 0.99, (diff.max(), np.mean(diff == 0))


def zeros(shape):
    return cuda.to_device(np.zeros(shape, np.uint16))


@FORMS
def test_rms_norm(rng, form):
    tokens, hidden = 3, 72  # hidden not a multiple of the block: exercises the tail
    x_bits, x = bf16_randn((tokens, hidden), rng, scale=4.0)
    w_bits, w = bf16_randn((hidden,), rng, scale=0.5)
    out, ref = zeros((tokens, hidden)), zeros((tokens, hidden))
    rms_norm(cuda.to_device(x_bits), cuda.to_device(w_bits), out, EPS, **form)
    reference_rms_norm(cuda.to_device(x_bits), cuda.to_device(w_bits), ref, EPS, **form)
    assert_within_one_ulp(out.copy_to_host(), ref.copy_to_host())
    assert_close_to_numpy(ref.copy_to_host(), numpy_rms_norm(x, w, EPS, **form))


@FORMS
def test_add_rms_norm_updates_residual_and_normalizes_rounded_sum(rng, form):
    tokens, hidden = 3, 72
    r_bits, r = bf16_randn((tokens, hidden), rng, scale=4.0)
    d_bits, d = bf16_randn((tokens, hidden), rng, scale=1.0)
    w_bits, w = bf16_randn((hidden,), rng, scale=0.5)
    residual, ref_residual = cuda.to_device(r_bits), cuda.to_device(r_bits)
    out, ref = zeros((tokens, hidden)), zeros((tokens, hidden))
    add_rms_norm(residual, cuda.to_device(d_bits), cuda.to_device(w_bits), out, EPS, **form)
    reference_add_rms_norm(ref_residual, cuda.to_device(d_bits), cuda.to_device(w_bits), ref_residual, ref, EPS,
                           **form)

    # one rounding of r + d (exact in f32 for these values, whose exponents differ by < 16): bit-exact
    s = bf16_round(r + d)
    np.testing.assert_array_equal(residual.copy_to_host(), ref_residual.copy_to_host())
    np.testing.assert_array_equal(from_bf16_bits(ref_residual.copy_to_host()).astype(np.float64), s)
    assert_within_one_ulp(out.copy_to_host(), ref.copy_to_host())
    assert_close_to_numpy(ref.copy_to_host(), numpy_rms_norm(s, w, EPS, **form))


@FORMS
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_add_rms_norm_into_equals_in_place_ops(rng, form, with_delta):
    """``add_rms_norm_into`` writes the sum to another buffer: bit for bit what ``add_rms_norm`` (``rms_norm``
    without a delta) gives in place, residual_in untouched, within an ulp of the reference; overlapping residual
    buffers are refused."""
    tokens, hidden = 3, 72
    r_bits, r = bf16_randn((tokens, hidden), rng, scale=4.0)
    d_bits, d = bf16_randn((tokens, hidden), rng, scale=1.0)
    w_bits, w = bf16_randn((hidden,), rng, scale=0.5)
    weight = cuda.to_device(w_bits)
    delta = cuda.to_device(d_bits) if with_delta else None
    residual_in = cuda.to_device(r_bits)
    residual_out = cuda.to_device(np.full((tokens, hidden), 0x7FC1, np.uint16))
    normed = zeros((tokens, hidden))
    add_rms_norm_into(residual_in, delta, weight, residual_out, normed, EPS, **form)

    in_place = cuda.to_device(r_bits)
    in_place_normed = zeros((tokens, hidden))
    if with_delta:
        add_rms_norm(in_place, delta, weight, in_place_normed, EPS, **form)
    else:
        rms_norm(in_place, weight, in_place_normed, EPS, **form)
    np.testing.assert_array_equal(residual_in.copy_to_host(), r_bits)
    np.testing.assert_array_equal(residual_out.copy_to_host(), in_place.copy_to_host())
    np.testing.assert_array_equal(normed.copy_to_host(), in_place_normed.copy_to_host())

    ref_out = cuda.to_device(np.full((tokens, hidden), 0x7FC1, np.uint16))
    ref_normed = zeros((tokens, hidden))
    reference_add_rms_norm(cuda.to_device(r_bits), delta, weight, ref_out, ref_normed, EPS, **form)
    np.testing.assert_array_equal(residual_out.copy_to_host(), ref_out.copy_to_host())
    assert_within_one_ulp(normed.copy_to_host(), ref_normed.copy_to_host())
    s = bf16_round(r + d) if with_delta else r
    np.testing.assert_array_equal(from_bf16_bits(ref_out.copy_to_host()).astype(np.float64), s)
    assert_close_to_numpy(ref_normed.copy_to_host(), numpy_rms_norm(s, w, EPS, **form))

    with pytest.raises(ValueError, match="overlap"):
        add_rms_norm_into(residual_in, delta, weight, residual_in, normed, EPS, **form)


def test_norm_matches_hf_modules(rng):
    """Bit-compare with transformers' own Qwen3RMSNorm / Qwen3_5RMSNorm on CPU bf16."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    tokens, hidden = 2, 64
    x_bits, _ = bf16_randn((tokens, hidden), rng, scale=4.0)
    w_bits, _ = bf16_randn((hidden,), rng, scale=0.5)
    as_torch = lambda bits: torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    modules = ((qwen3.Qwen3RMSNorm(hidden, eps=EPS), QWEN3), (qwen3_5.Qwen3_5RMSNorm(hidden, eps=EPS), QWEN3_5))
    for module, form in modules:
        with torch.no_grad():
            module.weight.copy_(as_torch(w_bits).float())
            module.to(torch.bfloat16)
            expected = module(as_torch(x_bits)).view(torch.int16).numpy().view(np.uint16)
        out = zeros((tokens, hidden))
        rms_norm(cuda.to_device(x_bits), cuda.to_device(w_bits), out, EPS, **form)
        got = out.copy_to_host()
        # last-ulp rsqrt/summation-order differences may flip a rare rounding: allow one bf16 ulp on ≤ 2% of values
        diff = np.abs(got.astype(np.int32) - expected.astype(np.int32))
        assert diff.max() <= 1 and np.mean(diff != 0) <= 0.02, (type(module).__name__, diff.max(), np.mean(diff != 0))
