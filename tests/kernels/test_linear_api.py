"""``linear`` / ``linear_silu_mul``: every path the simulator runs by default against float64 NumPy and the
reference kernel; dispatch and argument checks."""
import numpy as np
import pytest

from tests.kernels.linear_util import (assert_same_bits, exact_inputs, reference_bits, run, run_bits,
                                       silu_mul_reference)
from tests.util import SIMULATOR, bf16_randn, bf16_round, launches_during, rel_l2

from pegainfer.kernels import linear as lin
from pegainfer.kernels.linear import linear, linear_silu_mul

SIM_IMPLS = ["gemv", "gemm_fma"]


@pytest.mark.parametrize("impl", SIM_IMPLS)
@pytest.mark.parametrize("T,N,K", [(1, 40, 64), (3, 41, 128), (17, 50, 72)])
def test_linear_matches_numpy(impl, T, N, K, rng):
    """N with a tail (41, 50 are not multiples of any tile), K = 72 not a multiple of the 16/32-wide K tiles,
    T = 17 spans several GEMV passes and two GEMM token tiles."""
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.1)
    got = run(linear, xb, wb, N, impl=impl)
    assert rel_l2(got, x @ w.T) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"


@pytest.mark.parametrize("impl", SIM_IMPLS)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_linear_silu_mul_matches_hf_rounding(impl, T, rng):
    K, inter = 64, 36
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((2 * inter, K), rng, scale=0.3)
    got = run(linear_silu_mul, xb, wb, inter, impl=impl)
    expected = silu_mul_reference(x, w)
    assert rel_l2(got, expected) < 1e-2
    # the f32 sums differ from float64 only in the last bits: nearly every rounded output is the same bf16
    assert np.mean(got == expected) > 0.9, np.mean(got == expected)


@pytest.mark.parametrize("impl", SIM_IMPLS)
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("T", [1, 17])
def test_paths_match_the_reference_kernel(impl, gated, T, rng):
    """Bit for bit on data whose sums are exact in f32 (N = 50 logical columns with a tail, K = 72)."""
    (xb, _), (wb, _) = exact_inputs(T, 50, 72, rng)
    got = run_bits(linear_silu_mul if gated else linear, xb, wb, 25 if gated else 50, impl=impl)
    assert_same_bits(got, reference_bits(xb, wb, gated), impl)


@pytest.mark.parametrize("T", [2, 9])
def test_default_dispatch(T, rng):
    """impl=None: the GEMV for T <= 8, the GEMM above (``gemm_fma`` in the simulator), with the default geometries,
    giving the reference kernel's bits."""
    (xb, _), (wb, _) = exact_inputs(T, 33, 64, rng)
    got = []
    launched = launches_during(lambda: got.append(run_bits(linear, xb, wb, 33)))
    assert_same_bits(got[0], reference_bits(xb, wb))
    if SIMULATOR:
        assert [(getattr(k, "py_func", None) or k.fn).__name__ for k, _ in launched] == [
            "gemv" if T <= 8 else "gemm_fma"]


def test_rejects_bad_shapes():
    x = np.zeros((2, 12), np.uint16)
    with pytest.raises(ValueError, match="multiple of 8"):
        linear(x, np.zeros((4, 12), np.uint16), np.zeros((2, 4), np.uint16))
    x = np.zeros((2, 16), np.uint16)
    with pytest.raises(ValueError, match="does not match"):
        linear(x, np.zeros((4, 8), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="4-byte boundary"):     # pairs of outputs are written in one store
        linear(x, np.zeros((4, 16), np.uint16), np.zeros(9, np.uint16)[1:].reshape(2, 4))
    with pytest.raises(ValueError, match="out"):
        linear_silu_mul(x, np.zeros((8, 16), np.uint16), np.zeros((2, 8), np.uint16))
    with pytest.raises(ValueError, match="even number of rows"):
        linear_silu_mul(x, np.zeros((7, 16), np.uint16), np.zeros((2, 3), np.uint16))
    with pytest.raises(ValueError, match="uint16"):
        linear(x.astype(np.float32), np.zeros((4, 16), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        linear(np.zeros((16, 2), np.uint16).T, np.zeros((4, 16), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="impl"):
        linear(x, np.zeros((4, 16), np.uint16), np.zeros((2, 4), np.uint16), impl="cublas")


def test_default_impl():
    if SIMULATOR:
        assert [lin.default_impl(t) for t in (1, 8, 9)] == ["gemv", "gemv", "gemm_fma"]
    else:
        from pegainfer.device import has_wgmma
        gemm = "gemm_wgmma" if has_wgmma() else "gemm_mma"
        assert [lin.default_impl(t) for t in (1, 2, 16, 17, 256)] == ["gemv", "skinny", "skinny", gemm, gemm]
