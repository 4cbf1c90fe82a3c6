"""The one launch wrapper: every kernel launch in pegainfer goes through ``launch``.

It owns the stream kernels are launched on (so a whole decode step can be captured into a CUDA graph by pointing
it at a capturing stream), an optional tracer that times each launch with CUDA events (Chrome trace output), and
programmatic dependent launch.

**Programmatic dependent launch (PDL).**  At batch 1 a decode step is a chain of ~250 short kernels, and between
two of them the GPU idles: the last blocks of one kernel drain, then the next kernel's blocks start and wait for
their first weights to arrive from HBM.  On sm_90 a kernel launched with the PDL attribute may start *before* the
previous kernel on the stream has finished: its blocks take SMs as soon as the previous kernel calls
``launch_dependents()`` (or its blocks exit), issue their first weight loads, and only then call
``grid_dependency_wait()``, which returns once the previous kernel's writes are visible (``primitives``: what a
kernel may do before the wait).  Captured into a CUDA graph these launches become programmatic edges, so the
overlap replays every token.

A kernel that follows that contract (what it reads before its wait: its ``reads_before_wait``; checked on the
compiled code by ``tools/pdl_early_reads.py``) is launched with ``policy=``: it overlaps the kernel before it when
the launch policy names it (``LaunchPolicy.pdl``, by the launch's ``name``) and the GPU can (sm_90+, not the
simulator).  Which launches overlap by default, and why, is in ``policy.py`` and ``docs/perf/launch.md``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from pegainfer.device import SIMULATOR
from pegainfer.kernels import numba_internals
from pegainfer.kernels.policy import LaunchPolicy
from pegainfer.kernels.primitives import GRID_DEPENDENCY_CONTROL

_stream: Any = 0
_tracer: Optional[Callable] = None


def _programmatic_launcher() -> Optional[Callable]:
    """``launch_pdl(kernel, grid, block, stream, shared, args)`` when the GPU can overlap launches, else None."""
    if not GRID_DEPENDENCY_CONTROL:
        return None
    from cuda.core import LaunchConfig, launch as core_launch
    numba_internals.check()
    LaunchConfig(grid=1, block=32, programmatic_stream_serialization=True)

    def launch_pdl(kernel, grid, block, stream, shared, args):
        # what numba's own launch does (compiled overload, arguments marshalled by numba), plus the PDL attribute
        compiled = numba_internals.compiled(kernel, args)
        core_stream, kernel_args = numba_internals.marshal(compiled, args, stream)
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared, programmatic_stream_serialization=True)
        core_launch(core_stream, config, numba_internals.cu_function(compiled).kernel, *kernel_args)

    return launch_pdl


_launch_pdl = _programmatic_launcher()


def launch(kernel, grid: int, block: int, *args, shared: int = 0, name: str | None = None,
           policy: LaunchPolicy | None = None) -> None:
    """Launch ``kernel[grid, block, stream, shared](*args)`` on the current stream (1-D grids and blocks).

    ``policy``: the kernel follows the PDL contract (module docstring); it overlaps the kernel before it when
    ``policy.overlaps(name)`` and the GPU can.  Without one it never overlaps (a kernel outside the contract)."""
    if _tracer is not None:
        with _tracer(name or getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None), "__name__", "kernel")):
            _launch(kernel, grid, block, args, shared, policy, name)
    else:
        _launch(kernel, grid, block, args, shared, policy, name)


STATIC_SHARED_LIMIT = 48 * 1024   # shared memory a block may have without opting in
_shared_opt_ins: dict = {}


def _allow_shared(kernel, args, shared: int) -> None:
    """Let ``kernel`` (compiled for ``args``) launch with ``shared`` bytes of dynamic shared memory, beyond the
    48 KB a kernel gets by default: set its ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute once (sm_70+; up to
    227 KB a block on the H200).  Not needed, and not possible, in the simulator."""
    cufunc = numba_internals.cu_function(numba_internals.compiled(kernel, args))
    key = (id(kernel), id(cufunc))
    if _shared_opt_ins.get(key, 0) >= shared:
        return
    from numba.cuda.cudadrv.driver import binding, driver
    from numba import cuda
    optin = int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    if shared > optin:
        raise ValueError(f"{getattr(kernel, '__name__', 'kernel')}: {shared} bytes of shared memory asked, the GPU "
                         f"allows {optin} per block")
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, shared, cufunc.handle, cufunc.device.id)
    _shared_opt_ins[key] = shared


def can_overlap() -> bool:
    """Whether this GPU overlaps launches at all (PDL: sm_90+, not the simulator)."""
    return _launch_pdl is not None


def _launch(kernel, grid, block, args, shared, policy, name):
    """The launch itself; ``policy`` is None for a kernel that does not follow the PDL contract."""
    if shared > STATIC_SHARED_LIMIT and not SIMULATOR:
        _allow_shared(kernel, args, shared)
    if policy is not None and _launch_pdl is not None and policy.overlaps(name):
        _launch_pdl(kernel, grid, block, _stream, shared, args)
    else:
        kernel[grid, block, _stream, shared](*args)


def current_stream():
    return _stream


@contextlib.contextmanager
def on_stream(stream):
    """Launch every kernel inside the block on ``stream``."""
    global _stream
    old, _stream = _stream, stream
    try:
        yield stream
    finally:
        _stream = old


@contextlib.contextmanager
def traced(tracer):
    """``tracer(name)`` must return a context manager wrapping one launch (see ``pegainfer.trace``)."""
    global _tracer
    old, _tracer = _tracer, tracer
    try:
        yield
    finally:
        _tracer = old
