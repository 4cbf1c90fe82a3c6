"""The GPU check before a model loads: a GPU too old for the kernels is a one-line error, not a compile traceback."""
import types

import pytest

import pegainfer.device as device
from pegainfer.errors import PegainferError


def _fake_gpu(monkeypatch, cc):
    from numba import cuda
    monkeypatch.setattr(device, "SIMULATOR", False)
    monkeypatch.setattr(cuda, "get_current_device",
                        lambda: types.SimpleNamespace(name=b"Tesla T4", compute_capability=cc))


def test_old_gpu_is_a_one_line_error(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5))
    with pytest.raises(PegainferError) as err:
        device.require_supported_gpu()
    msg = str(err.value)
    assert "Tesla T4" in msg and "7.5" in msg and "8.0" in msg and "\n" not in msg


def test_supported_gpu_and_simulator_pass(monkeypatch):
    device.require_supported_gpu()                 # the simulator: nothing to check
    _fake_gpu(monkeypatch, (9, 0))
    device.require_supported_gpu()
