"""Decide, once and before numba is imported, whether kernels run on a GPU or in Numba's CUDA simulator.

Numba reads ``NUMBA_ENABLE_CUDASIM`` when it is first imported, so this module must be imported before anything that
imports numba (``pegainfer/__init__.py`` does it first).  Rules:

* ``NUMBA_ENABLE_CUDASIM=1`` already set by the user: simulator.
* ``PEGAINFER_DEVICE=sim`` forces the simulator, ``PEGAINFER_DEVICE=gpu`` forces the GPU (and fails loudly without one).
* otherwise: the GPU when the CUDA driver library loads and reports at least one device, else the simulator.
"""
from __future__ import annotations

import ctypes
import os
import sys


def _driver_device_count() -> int:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    try:
        if lib.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except Exception:  # pragma: no cover - exotic driver stubs
        return 0


def _decide() -> bool:
    """Return True when kernels run in the simulator."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    forced = os.environ.get("PEGAINFER_DEVICE", "").lower()
    if forced == "sim":
        return True
    if forced == "gpu":
        return False
    return _driver_device_count() == 0


SIMULATOR: bool = _decide()
if SIMULATOR:
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise RuntimeError("pegainfer must be imported before numba when no GPU is present "
                           "(or set NUMBA_ENABLE_CUDASIM=1 yourself)")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
else:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")


MIN_COMPUTE_CAPABILITY = (8, 0)
"""Oldest GPU the kernels run on: bf16 tensor-core ``mma`` and the bf16 conversion instructions are sm_80+."""


def require_supported_gpu() -> None:
    """Raise a one-line ``PegainferError`` on a GPU older than ``MIN_COMPUTE_CAPABILITY`` (its kernels would fail
    to compile with a long numba traceback); nothing in the simulator."""
    if SIMULATOR:
        return
    from numba import cuda
    from pegainfer.errors import PegainferError
    dev = cuda.get_current_device()
    cc = tuple(dev.compute_capability)
    if cc < MIN_COMPUTE_CAPABILITY:
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise PegainferError(f"GPU {name} has compute capability {cc[0]}.{cc[1]}, and pegainfer's kernels need {need} "
                             "or newer (bf16 tensor cores: Ampere, Ada, Hopper, Blackwell); use such a GPU, or run "
                             "without one (PEGAINFER_DEVICE=sim: the simulator, tiny models only)")


def has_wgmma() -> bool:
    """Whether the GPU runs Hopper's warpgroup MMA (``wgmma``: sm_90a only, not Ampere/Ada and not Blackwell)."""
    if SIMULATOR:
        return True
    from numba import cuda
    return tuple(cuda.get_current_device().compute_capability)[:2] == (9, 0)


def describe() -> str:
    """One line saying where kernels run, for the CLI and server logs."""
    if SIMULATOR:
        return "no GPU found: running every kernel in Numba's CUDA simulator (slow; tiny models only)"
    from numba import cuda
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    return f"GPU: {name} (compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]})"
