"""Numba's CUDA simulator made faster and its shared-memory allocator race-free (``patch_simulator``, called once
when the kernels run in the simulator: the tests, and the demo without a GPU)."""
from __future__ import annotations

import numpy as np


def patch_simulator():
    """Make Numba's simulator faster without changing what any kernel computes: blocks on persistent threads with
    a barrier the last arriving thread releases (``simulator_blocks``), device-function calls straight through
    (``simulator_calls``), and shared arrays found by a locked lookup of their call site (below).  Idempotent."""
    from pegainfer.kernels.primitives.simulator_blocks import patch_block_runner
    from pegainfer.kernels.primitives.simulator_calls import patch_device_calls
    patch_block_runner()
    patch_device_calls()

    # Shared arrays are keyed by call site. Upstream finds the site with traceback.extract_stack (slow: it
    # reads source lines) and without a lock (two threads can each create "the" array). Same keys, locked.
    import sys as _sys
    import threading as _threading

    from numba.core import types as _types
    from numba.np import numpy_support as _npsup
    from numba.cuda.simulator import kernelapi as _kapi

    _lock = _threading.Lock()
    _orig_array = _kapi.FakeCUDAShared.array

    def shared_array(self, shape, dtype, alignment=None):   # alignment: nothing to do (nothing checks it here)
        if shape == 0:
            return _orig_array(self, shape, dtype, alignment)
        f = _sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)
        with _lock:
            res = self._allocations.get(caller)
            if res is None:
                if isinstance(dtype, _types.Type):
                    dtype = _npsup.as_dtype(dtype)
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    _kapi.FakeCUDAShared.array = shared_array
