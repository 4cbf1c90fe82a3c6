"""Cheaper device-function calls in Numba's CUDA simulator (``patch_device_calls``).

In the simulator every call of a ``@cuda.jit(device=True)`` function goes through a context manager that takes two
locks, rescans the function's module globals for the ``cuda`` module, points them at the launch's fake module and
restores them on the way out: a large share of the simulator's CPU time in a tiny model's decode step.  Here
the first call from a module during a launch points that module's ``cuda`` names at the launch's fake module, later
calls find them pointed already and call straight through, and the launch puts every module back when it ends.
What a kernel computes is unchanged: device functions see the same fake module as upstream gives them."""
from __future__ import annotations

import threading


def patch_device_calls() -> None:
    """Replace ``FakeCUDAKernel.__call__`` (device calls: straight through once the module is pointed at the
    launch; launches: upstream's, then every module this launch pointed is restored).  Idempotent."""
    from numba import cuda as real_cuda
    from numba.cuda.simulator import kernel as simulated
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    if getattr(simulated.FakeCUDAKernel.__call__, "cheap_device_calls", False):
        return
    lock = threading.Lock()
    pointed: dict[int, tuple[dict, dict]] = {}   # this launch: id(module globals) -> (globals, their real values)
    upstream_call = simulated.FakeCUDAKernel.__call__

    def restore() -> None:
        with lock:
            for module_globals, real in pointed.values():
                module_globals.update(real)
            pointed.clear()

    def call(self, *args):
        fake = simulated._kernel_context                      # the running launch's fake cuda module, if any
        if fake is None:
            if self._device:                                  # a device function called from host code
                return upstream_call(self, *args)
            try:
                return upstream_call(self, *args)             # a launch: blocks run one after another
            finally:
                restore()
        module_globals = self.fn.__globals__
        names = self.__dict__.get("_cuda_names")     # the module's names for the cuda module, found once
        if names is None:
            names = self._cuda_names = tuple(k for k, v in list(module_globals.items())
                                             if v is real_cuda or isinstance(v, FakeCUDAModule))
        if names and module_globals[names[0]] is not fake:
            with lock:
                if module_globals[names[0]] is not fake:
                    key = id(module_globals)
                    if key not in pointed:
                        pointed[key] = (module_globals, {k: module_globals[k] for k in names})
                    for k in names:
                        module_globals[k] = fake
        return self.fn(*args)

    call.cheap_device_calls = True
    simulated.FakeCUDAKernel.__call__ = call
