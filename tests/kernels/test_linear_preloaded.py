"""The preloaded one-token GEMV (``linear_preloaded``): against the reference kernel, and when the launch policy and
the GPU let it preload."""
import numpy as np
import pytest

from tests.kernels.linear_util import assert_same_bits, exact_inputs, reference_bits, run, run_bits
from tests.util import bf16_randn, bf16_round, launches_during, rel_l2
from numba import cuda

from pegainfer.kernels.linear import PRELOAD_THREADS, gemv_preloaded, linear, linear_preloaded, preload_rows, preloads
from pegainfer.kernels.linear.common import sm_count
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import threads

KP = 2 * threads(gpu=PRELOAD_THREADS, sim=32)
"""K of the preloaded GEMV is a multiple of this (two bf16 per lane and block thread): 64 here, 1024 on a GPU."""


@pytest.mark.parametrize("N,k_units", [(40, 1), (9, 2), (64, 3)])
def test_linear_preloaded_matches_reference(N, k_units, rng):
    """Weights copied into shared memory before the PDL wait by the copy engine.  In the simulator (4 SMs
    counted) N = 40 gives 4 blocks of 10 rows, N = 9 gives 3 blocks of 3, N = 64 blocks of 16; on a GPU the last
    block of a run is partial."""
    K = KP * k_units
    assert preload_rows(N, K) > 0
    (xb, _), (wb, _) = exact_inputs(1, N, K, rng)
    assert preloads(1, cuda.to_device(wb))
    assert_same_bits(run_bits(linear_preloaded, xb, wb, N), reference_bits(xb, wb))


def test_linear_preloaded_matches_numpy(rng):
    K, N = 2 * KP, 40
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.1)
    got = run(linear_preloaded, xb, wb, N)
    assert rel_l2(got, x @ w.T) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"


def _launched(xb, wb, N, policy):
    out = cuda.to_device(np.zeros((xb.shape[0], N), np.uint16))
    kernels = launches_during(lambda: linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out, policy=policy))
    names = [(getattr(k, "py_func", None) or k.fn).__name__ for k, _ in kernels]
    return names, out.copy_to_host()


def test_linear_preloaded_falls_back(rng):
    """More tokens, a K that does not split over the block's lanes, or a policy without ``preload_o``: ``linear``
    itself, the same bits."""
    for T, N, K in ((3, 40, KP), (1, 40, KP + 8)):
        (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
        assert not preloads(T, cuda.to_device(wb))
        names, got = _launched(xb, wb, N, LaunchPolicy())
        assert "gemv_preloaded" not in names
        assert np.array_equal(got, run_bits(linear, xb, wb, N))
    (xb, _), (wb, _) = exact_inputs(1, 40, KP, rng)
    off = LaunchPolicy(preload_o=False)
    assert preloads(1, cuda.to_device(wb)) and not preloads(1, cuda.to_device(wb), off)
    names, got = _launched(xb, wb, 40, off)
    assert names == ["gemv_decode"]
    assert np.array_equal(got, _launched(xb, wb, 40, LaunchPolicy())[1])
    assert _launched(xb, wb, 40, LaunchPolicy())[0] == ["gemv_preloaded"]


def test_linear_preloaded_needs_overlap(monkeypatch):
    """On a GPU that cannot overlap launches (before sm_90), or with a policy that does not let ``gemv_preloaded``
    overlap the kernel before, the copies could overlap nothing: no preload."""
    monkeypatch.setattr(gemv_preloaded, "SIMULATOR", False)
    monkeypatch.setattr(gemv_preloaded, "can_overlap", lambda: True)
    assert gemv_preloaded._preload_on(1, LaunchPolicy()) and not gemv_preloaded._preload_on(2, LaunchPolicy())
    assert not gemv_preloaded._preload_on(1, LaunchPolicy(pdl=frozenset()))
    assert gemv_preloaded._preload_on(1, LaunchPolicy(pdl=frozenset({"gemv_preloaded"})))
    monkeypatch.setattr(gemv_preloaded, "can_overlap", lambda: False)
    assert not gemv_preloaded._preload_on(1, LaunchPolicy(pdl=None))


def test_preload_rows_limits(monkeypatch):
    monkeypatch.setattr(gemv_preloaded, "sm_count", lambda: 132)
    monkeypatch.setattr(gemv_preloaded, "shared_optin", lambda: 227 * 1024)
    monkeypatch.setattr(gemv_preloaded, "threads", lambda gpu, sim: gpu)
    assert preload_rows(2560, 4096) == 20          # Qwen3-4B / Qwen3.5-4B o: 160 KB a block, 128 blocks
    assert preload_rows(2560, 4096, busy_sms=8) == 21   # around decode attention's 8 busy SMs: 122 blocks
    assert preload_rows(4096, 4096) == 0           # Qwen3-8B o: 256 KB a block does not fit
    assert preload_rows(2560, 4100) == 0           # K / 2 not a multiple of 512


def test_linear_preloaded_around_busy_sms(rng):
    """``busy_sms``: the matrix spread over all SMs but those (more rows a block, fewer blocks), the same bits; a
    count that leaves no SM falls back to all SMs.  (Three rows per SM: one busy SM makes it four, on the
    simulator's 4 SMs and on a GPU's hundred-odd.)"""
    N, K = 3 * sm_count(), KP
    assert preload_rows(N, K, 1) > preload_rows(N, K) and preload_rows(N, K, sm_count()) == 0
    (xb, _), (wb, _) = exact_inputs(1, N, K, rng)
    expected = reference_bits(xb, wb)
    for busy in (0, 1, 2, sm_count()):
        assert_same_bits(run_bits(linear_preloaded, xb, wb, N, busy_sms=busy), expected, f"busy_sms={busy}")
