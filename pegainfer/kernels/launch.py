"""The one launch wrapper: every kernel launch in pegainfer goes through ``launch``.

It owns the stream kernels are launched on (so a whole decode step can be captured into a CUDA graph by pointing
it at a capturing stream), an optional tracer that times each launch with CUDA events (Chrome trace output), and
programmatic dependent launch.

**Programmatic dependent launch (PDL).**  At batch 1 a decode step is a chain of ~250 short kernels, and between
two of them the GPU idles: the last blocks of one kernel drain, then the next kernel's blocks start and wait for
their first weights to arrive from HBM (a few µs each time, ~25 % of a Qwen3-4B step).  On sm_90 a kernel launched
with ``pdl=True`` may start *before* the previous kernel on the stream has finished: its blocks take SMs as soon as
the previous kernel calls ``launch_dependents()`` (or its blocks exit), issue their first weight loads, and only
then call ``grid_dependency_wait()``, which returns once the previous kernel's writes are visible
(``primitives``: what a kernel may do before the wait).  Captured into a CUDA graph these launches become
programmatic edges, so the overlap replays every token.

Every kernel of a step follows the contract and is launched with ``pdl=True``, but by default only the launches
named in ``PDL_BY_DEFAULT`` really overlap: measured on the H200 (Qwen3-4B decode, ``benchmarks/RESULTS.md``), PDL
between the weight-streaming kernels took TPOT from 3.31 to 3.14 ms, while PDL on every launch (the latency-bound
qk-norm/RoPE, attention, sampling kernels too) made it 3.41 ms: a kernel launched early holds SM slots and, worse,
a weight-streaming kernel launched early floods the memory system with its first loads while a latency-bound
kernel before it waits on a chain of dependent ones.  So a latency-bound kernel calls ``launch_dependents()`` only
after its last load (decode attention), and the decode attention itself is launched early (its reads of the older
keys overlap qk-norm/RoPE): 3.16 -> 3.10 ms.  Since session 18 qk-norm/RoPE (``qk_norm_rope_store``) is launched
early too (``qk_norm_rope_store_decode``; a prompt chunk's stays ordered after its projection, a skinny GEMM
whose SMs an early launch would take): its reads of positions, norm weights, cos/sin and the block table overlap the
qkv projection's tail, and attention launches at its start.  Measured slower in session 12 (+0.75 %, before the preloaded o, the late
GEMV triggers and the lean step copies), it measured −2.65 % (Qwen3-4B) and −0.52 % (Qwen3.5-4B) in session 18
(``benchmarks/graph_sweep.py``, decode graph replays alternating in one call).  ``PEGAINFER_PDL=1`` overlaps every launch,
``PEGAINFER_PDL=0`` none (every launch then orders fully after the one before), ``PEGAINFER_PDL=name,name`` the
launches of those names (``launch(..., name=)``).  It is off in the simulator and before sm_90.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives import GRID_DEPENDENCY_CONTROL

_stream: Any = 0
_tracer: Optional[Callable] = None


PDL_BY_DEFAULT = ("gemv", "gemv_add_rms_norm", "gemv_preloaded", "linear_skinny", "add_rms_norm_into",
                  "qk_norm_rope_store_decode", "paged_decode_attention", "gated_delta_decode_step")
_PDL_SETTING = os.environ.get("PEGAINFER_PDL", ",".join(PDL_BY_DEFAULT))
_PDL_ONLY = None if _PDL_SETTING in ("0", "1") else frozenset(_PDL_SETTING.split(","))


def _programmatic_launcher() -> Optional[Callable]:
    """``launch_pdl(kernel, grid, block, stream, shared, args)`` when PDL is available and wanted, else None."""
    if not GRID_DEPENDENCY_CONTROL or _PDL_SETTING == "0":
        return None
    try:
        from cuda.core import LaunchConfig, launch as core_launch
        from numba.cuda.cudadrv.driver import _to_core_stream
        from numba.cuda.dispatcher import CUDADispatcher, _Kernel
        LaunchConfig(grid=1, block=32, programmatic_stream_serialization=True)
        # the numba internals launch_pdl uses (numba-cuda 0.30); another version without them: plain launches
        assert hasattr(CUDADispatcher, "_compile_for_args") and hasattr(_Kernel, "_prepare_args")
    except Exception:      # an older cuda.core without the launch attribute, or other numba internals
        return None

    def launch_pdl(kernel, grid, block, stream, shared, args):
        # what numba's own launch does (compiled overload, arguments marshalled by numba), plus the PDL attribute
        compiled = kernel._compile_for_args(*args)
        core_stream = _to_core_stream(stream)
        kernel_args, writeback = [], []
        for ty, value in zip(compiled.argument_types, args):
            compiled._prepare_args(ty, value, core_stream, writeback, kernel_args)
        config = LaunchConfig(grid=grid, block=block, shmem_size=shared, programmatic_stream_serialization=True)
        core_launch(core_stream, config, compiled._codelibrary.get_cufunc().kernel, *kernel_args)

    return launch_pdl


_launch_pdl = _programmatic_launcher()


def launch(kernel, grid: int, block: int, *args, shared: int = 0, name: str | None = None, pdl: bool = False) -> None:
    """Launch ``kernel[grid, block, stream, shared](*args)`` on the current stream (1-D grids and blocks).

    ``pdl=True``: the kernel follows the PDL contract (module docstring) and may overlap the kernel before it."""
    if _tracer is not None:
        with _tracer(name or getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None), "__name__", "kernel")):
            _launch(kernel, grid, block, args, shared, pdl, name)
    else:
        _launch(kernel, grid, block, args, shared, pdl, name)


STATIC_SHARED_LIMIT = 48 * 1024   # shared memory a block may have without opting in
_shared_opt_ins: dict = {}


def _allow_shared(kernel, args, shared: int) -> None:
    """Let ``kernel`` (compiled for ``args``) launch with ``shared`` bytes of dynamic shared memory, beyond the
    48 KB a kernel gets by default: set its ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute once (sm_70+; up to
    227 KB a block on the H200).  Not needed, and not possible, in the simulator."""
    compiled = kernel._compile_for_args(*args)
    cufunc = compiled._codelibrary.get_cufunc()
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


def overlaps(name: str | None) -> bool:
    """Whether a ``launch(..., name=name, pdl=True)`` really may overlap the kernel before it (PDL available, not
    turned off, and on for that name)."""
    return _launch_pdl is not None and (_PDL_ONLY is None or name in _PDL_ONLY)


def _launch(kernel, grid, block, args, shared, pdl, name):
    if shared > STATIC_SHARED_LIMIT and not SIMULATOR:
        _allow_shared(kernel, args, shared)
    if pdl and overlaps(name):
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
