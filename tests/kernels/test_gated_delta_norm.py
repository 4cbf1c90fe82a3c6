"""``gated_delta.gated_norm``: the gated RMSNorm against float64 NumPy with HF's roundings and against
transformers' own module."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.gated_delta_helpers import EPS, reference_gated_norm
from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2, to_bf16_bits

from pegainfer.kernels.gated_delta import gated_rms_norm


def test_gated_rms_norm_matches_reference_and_hf(rng):
    tokens, heads, dim = 3, 4, 24
    x_bits, x = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    z_bits, z = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    w = bf16_round(1.0 + 0.5 * rng.standard_normal(dim))  # HF initialises this weight to ones
    w_bits = to_bf16_bits(w)
    out = cuda.to_device(np.zeros_like(x_bits))
    gated_rms_norm(cuda.to_device(x_bits), cuda.to_device(z_bits), cuda.to_device(w_bits), out, EPS)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    ref = reference_gated_norm(x.reshape(tokens, heads, dim), z.reshape(tokens, heads, dim), w)
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


@pytest.mark.gpu
def test_gpu_gated_rms_norm_qwen35_shapes(rng):
    tokens, heads, dim = 33, 32, 128
    x_bits, x = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    z_bits, z = bf16_randn((tokens, heads * dim), rng, scale=2.0)
    w = bf16_round(1.0 + 0.1 * rng.standard_normal(dim))
    out = cuda.to_device(np.zeros_like(x_bits))
    gated_rms_norm(cuda.to_device(x_bits), cuda.to_device(z_bits), cuda.to_device(to_bf16_bits(w)), out, EPS)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    ref = reference_gated_norm(x.reshape(tokens, heads, dim), z.reshape(tokens, heads, dim), w)
    assert rel_l2(got, ref) < 1e-2 and np.mean(got == ref) > 0.97
