"""Every linear path on the Qwen3-4B shapes it serves, on a GPU (the real ``mma.sync``, ``cp.async.bulk``, PDL):
against float64 NumPy and, on data whose sums are exact in f32, bit for bit against the reference kernel."""
import numpy as np
import pytest

from tests.kernels.linear_util import exact_inputs, fused_op, reference_bits, separate_ops, silu_mul_reference
from tests.util import bf16_randn, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.linear import (GEMV_TUNED, gemv_geometry, linear, linear_preloaded, linear_silu_mul,
                                      linear_workspace_size, preloads)
from pegainfer.kernels.linear.common import sm_count
from pegainfer.kernels.launch import can_overlap
from pegainfer.kernels.policy import LaunchPolicy

pytestmark = pytest.mark.gpu

QWEN3_4B = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
            "lm_head": (151936, 2560)}
IMPLS = ("gemv", "skinny", "gemm_fma", "gemm_mma", "gemm_mma split", "gemm_wgmma", "gemm_wgmma split")
GEMM_IMPLS = ("gemv", "gemm_fma", "gemm_mma", "gemm_mma split", "gemm_wgmma", "gemm_wgmma split")


def _run(x_dev, w_dev, T, N, gated, impl):
    """``impl`` "... split": that GEMM given a workspace, so it splits K where its geometry does."""
    out = cuda.to_device(np.zeros((T, N // 2 if gated else N), np.uint16))
    ws = None
    if impl.endswith(" split"):
        impl = impl.removesuffix(" split")
        ws = cuda.device_array(linear_workspace_size(T, [(N, w_dev.shape[1], gated)]), np.float32)
    (linear_silu_mul if gated else linear)(x_dev, w_dev, out, impl=impl, workspace=ws)
    return out.copy_to_host()


@pytest.mark.parametrize("name", list(QWEN3_4B))
def test_qwen3_4b_shapes_every_path(name):
    """Every implementation at decode (1, 5, 8 tokens), small-batch (16, 40) and prefill (130) sizes; one weight
    per shape, uploaded once.  Each token's row is held to the bound on its own (catches a wrong row or tile that
    one rel-L2 over the whole output would average away)."""
    rng = np.random.default_rng(7)
    N, K = QWEN3_4B[name]
    gated = name == "gate_up"
    wb, w = bf16_randn((N, K), rng, scale=K ** -0.5)
    w_dev = cuda.to_device(wb)
    failures = []
    for T in (1, 5, 8, 16, 40, 130):
        xb, x = bf16_randn((T, K), rng)
        expected = silu_mul_reference(x, w) if gated else x @ w.T
        x_dev = cuda.to_device(xb)
        for impl in IMPLS if T <= 16 else GEMM_IMPLS:
            got = from_bf16_bits(_run(x_dev, w_dev, T, N, gated, impl))
            err = max(rel_l2(got[t], expected[t]) for t in range(T))
            if not err < 1e-2:
                failures.append((impl, T, err))
    assert not failures, f"{name}: (impl, T, rel L2) over 1e-2: {failures}"


@pytest.mark.parametrize("name", ["qkv", "gate_up", "down"])
def test_qwen3_4b_shapes_match_the_reference_kernel(name):
    """Bit for bit on exact data: the GEMVs, the skinny kernel and both GEMMs compute the reference's sums."""
    rng = np.random.default_rng(3)
    N, K = QWEN3_4B[name]
    gated = name == "gate_up"
    failures = []
    for T in (1, 16, 130):
        (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
        expected = reference_bits(xb, wb, gated)
        x_dev, w_dev = cuda.to_device(xb), cuda.to_device(wb)
        for impl in IMPLS if T <= 16 else GEMM_IMPLS:
            got = _run(x_dev, w_dev, T, N, gated, impl)
            if not np.array_equal(got, expected):
                failures.append((impl, T, int(np.sum(got != expected))))
    assert not failures, f"{name}: (impl, T, outputs that differ): {failures}"


def test_linear_preloaded_qwen3_4b_o():
    """The preloaded GEMV on the o projection it serves (2560 × 4096), against the reference kernel (exact data)
    and NumPy, whatever PDL set the default policy has (``pdl=None``: every launch may overlap)."""
    if not can_overlap():
        pytest.skip("the preloaded GEMV needs PDL (sm_90)")
    policy = LaunchPolicy(pdl=None)
    N, K = QWEN3_4B["o"]
    assert preloads(1, cuda.to_device(np.zeros((N, K), np.uint16)), policy)
    rng = np.random.default_rng(5)
    (xb, _), (wb, _) = exact_inputs(1, N, K, rng)
    for busy in (0, 8):
        out = cuda.to_device(np.zeros((1, N), np.uint16))
        linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out, busy_sms=busy, policy=policy)
        assert np.array_equal(out.copy_to_host(), reference_bits(xb, wb)), busy
    wb, w = bf16_randn((N, K), rng, scale=K ** -0.5)
    xb, x = bf16_randn((1, K), rng)
    out = cuda.to_device(np.zeros((1, N), np.uint16))
    linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out, busy_sms=8, policy=policy)
    assert rel_l2(from_bf16_bits(out.copy_to_host()), x @ w.T) < 1e-2


def test_gemv_geometry_covers_all_sms():
    """The heuristic picker gives the short-and-wide matrices enough warps to occupy every SM (shapes with a
    measured entry in GEMV_TUNED use that instead: the H200 sweep found fewer, busier warps faster there)."""
    for N, K in [(2560, 4096), (2560, 9728), (6144, 2560), (2560, 9216), (12352, 2560), (10240, 2560)]:
        geo = gemv_geometry(N, K, 1)
        if any(key[:2] == (N, K) for key in GEMV_TUNED):
            continue
        warps = -(-N // geo.rows_per_warp) * geo.k_split
        assert warps >= 16 * sm_count(), (N, K, geo)


@pytest.mark.parametrize("name", ["qkv", "gate_up", "lm_head"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_linear_add_rms_norm_qwen3_4b(name, with_delta):
    """The fused one-token path on the Qwen3-4B shapes it serves: bit for bit what add_rms_norm + linear give."""
    rng = np.random.default_rng(11)
    N, H = QWEN3_4B[name]
    gated = name == "gate_up"
    rb, _ = bf16_randn((1, H), rng)
    db = bf16_randn((1, H), rng)[0] if with_delta else None
    wnb, _ = bf16_randn((H,), rng)
    wb, _ = bf16_randn((N, H), rng, scale=H ** -0.5)
    _, res_out, _, out = fused_op(rb, db, wnb, wb, gated, "qwen3", 1e-6, residual_ready=True)
    ref_residual, _, ref_out = separate_ops(rb, db, wnb, wb, gated, "qwen3", 1e-6)
    assert np.array_equal(res_out, ref_residual)
    assert np.array_equal(out, ref_out), np.mean(out != ref_out)
