"""Sigmoid output gate (Qwen3.5 full attention) vs float64 NumPy and vs HF's own bf16 expression."""
import numpy as np
import pytest

from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.gating import sigmoid_gate_mul


def reference(attn, qg):
    """attn [T, H, D], qg [T, H·2D] (float64 of bf16s) → bf16(attn · bf16(sigmoid(gate)))."""
    num_tokens, heads, dim = attn.shape
    gate = qg[:, :2 * heads * dim].reshape(num_tokens, heads, 2 * dim)[:, :, dim:]
    return bf16_round(attn * bf16_round(1.0 / (1.0 + np.exp(-gate))))


@pytest.mark.parametrize("out_form", ["separate_3d", "separate_2d", "in_place"])
def test_sigmoid_gate_mul(rng, out_form):
    num_tokens, heads, dim = 3, 4, 12
    attn_bits, attn = bf16_randn((num_tokens, heads, dim), rng)
    qg_bits, qg = bf16_randn((num_tokens, heads * 2 * dim + 8), rng, scale=3.0)  # wider row: a fused projection
    d_attn = cuda.to_device(attn_bits)
    if out_form == "in_place":
        out = d_attn
    elif out_form == "separate_2d":
        out = cuda.to_device(np.zeros((num_tokens, heads * dim), np.uint16))
    else:
        out = cuda.to_device(np.zeros_like(attn_bits))
    sigmoid_gate_mul(d_attn, cuda.to_device(qg_bits), out)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64).reshape(num_tokens, heads, dim)
    ref = reference(attn, qg)
    assert rel_l2(got, ref) < 1e-2, rel_l2(got, ref)
    assert np.mean(got == ref) > 0.98, np.mean(got == ref)


def test_sigmoid_gate_mul_matches_hf_expression(rng):
    """Bit-compare with HF's split of q_proj's output and ``attn_output * torch.sigmoid(gate)`` on CPU bf16."""
    torch = pytest.importorskip("torch")
    num_tokens, heads, dim = 2, 3, 16
    attn_bits, _ = bf16_randn((num_tokens, heads, dim), rng)
    qg_bits, _ = bf16_randn((num_tokens, heads * 2 * dim), rng, scale=3.0)
    as_torch = lambda bits: torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    _, gate = torch.chunk(as_torch(qg_bits).view(num_tokens, heads, 2 * dim), 2, dim=-1)
    expected = as_torch(attn_bits).reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
    out = cuda.to_device(np.zeros((num_tokens, heads * dim), np.uint16))
    sigmoid_gate_mul(cuda.to_device(attn_bits), cuda.to_device(qg_bits), out)
    got = out.copy_to_host()
    exp = expected.contiguous().view(torch.int16).numpy().view(np.uint16)
    assert np.mean(got == exp) > 0.98, np.mean(got == exp)
    assert rel_l2(from_bf16_bits(got), from_bf16_bits(exp)) < 1e-2


@pytest.mark.gpu
def test_gpu_sigmoid_gate_mul_qwen35_shapes(rng):
    num_tokens, heads, dim = 37, 16, 256
    attn_bits, attn = bf16_randn((num_tokens, heads, dim), rng)
    qg_bits, qg = bf16_randn((num_tokens, heads * 2 * dim), rng, scale=3.0)
    out = cuda.to_device(np.zeros_like(attn_bits))
    sigmoid_gate_mul(cuda.to_device(attn_bits), cuda.to_device(qg_bits), out)
    got = from_bf16_bits(out.copy_to_host()).astype(np.float64)
    ref = reference(attn, qg)
    assert rel_l2(got, ref) < 1e-2 and np.mean(got == ref) > 0.98
