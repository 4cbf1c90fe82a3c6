"""The simulator's block scheduler and shared-memory allocator, made faster and race-free (``patch_simulator``,
called once when the kernels run in Numba's CUDA simulator)."""
from __future__ import annotations

import numpy as np


def patch_simulator():
    """Numba's simulator runs each CUDA thread as a Python thread and releases ``syncthreads`` from a manager
    loop that busy-polls every thread, holding the GIL while the threads it waits for cannot run: a barrier
    costs ~12 ms for one warp. Yielding the GIL between polls makes barriers (and our emulated warp
    shuffles) ~10x cheaper without changing what any kernel computes."""
    import time as _time

    from numba.cuda.simulator import kernel as _simk

    def run(self, grid_point, *args):
        threads, live, blocked = set(), set(), set()
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)
            t = _simk.BlockThread(target, self, grid_point, block_point, self._debug)
            t.start()
            threads.add(t)
            live.add(t)
        while live:
            _time.sleep(0.0001)
            for t in live:
                if t.syncthreads_blocked:
                    blocked.add(t)
                elif t.exception:
                    for other in threads:
                        other.abort = True
                        other.syncthreads_blocked = False
                        other.syncthreads_event.set()
                    raise t.exception[0].with_traceback(t.exception[1])
            if live == blocked:
                for t in blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                blocked = set()
            live = {t for t in live if t.is_alive()}
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    _simk.BlockManager.run = run

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
