"""``timeline``: the per-block stamps of the instrumented decode kernels (what ``benchmarks/step_timeline.py``
reads on a GPU).  In the simulator the clock is the host's, so only the records' shape and order are checked."""
import numpy as np
import pytest

from tests.util import bf16_randn, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels import linear as lin
from pegainfer.kernels import timeline


@pytest.fixture
def stamping(monkeypatch):
    monkeypatch.setattr(timeline, "ENABLED", True)
    timeline.reset()
    yield
    timeline.reset()


def _one_token_gemv(rng, n_out=40, k=64):
    xb, x = bf16_randn((1, k), rng)
    wb, w = bf16_randn((n_out, k), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, n_out), np.uint16))
    lin.linear(cuda.to_device(xb), cuda.to_device(wb), out)
    return from_bf16_bits(out.copy_to_host()).astype(np.float64), x @ w.T


def test_gemv_blocks_append_ordered_records(stamping, rng):
    got, expected = _one_token_gemv(rng)
    assert rel_l2(got, expected) < 1e-2, "stamping must not change the result"
    rec = timeline.records()
    assert len(rec) > 0
    grid = int(rec["grid"][0])
    assert sorted(rec["block"].tolist()) == list(range(grid)), "one record per block"
    assert set(rec["kind"].tolist()) == {1} and set(rec["extra"].tolist()) == {40}
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_ready"])
    assert np.all(rec["t_ready"] <= rec["t_end"])


def test_preloaded_gemv_records_its_kind(stamping, rng):
    K = 2 * lin.threads(gpu=lin.PRELOAD_THREADS, sim=32)
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((40, K), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, 40), np.uint16))
    lin.linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out)
    assert rel_l2(from_bf16_bits(out.copy_to_host()), x @ w.T) < 1e-2
    rec = timeline.records()
    assert set(rec["kind"].tolist()) == {3} and len(rec) == int(rec["grid"][0])
    assert np.all(rec["t_entry"] <= rec["t_end"])


def test_nothing_recorded_when_off(rng):
    assert not timeline.ENABLED
    timeline.reset()
    _one_token_gemv(rng)
    assert len(timeline.records()) == 0
