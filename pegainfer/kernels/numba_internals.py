"""The numba-cuda internals pegainfer relies on, in one place.

numba's public launch (``kernel[grid, block, stream, shared](*args)``) has no way to set a launch attribute, and
two of ours need one: programmatic dependent launch (``launch.py``) and more than 48 KB of dynamic shared memory a
block.  Both need the compiled kernel behind a dispatcher and numba's own argument marshalling, which are private
(numba-cuda 0.30): ``CUDADispatcher._compile_for_args``, ``_Kernel._prepare_args`` and ``driver._to_core_stream``
(and the public ``_Kernel.library``).  And numba's on-disk kernel cache keys a kernel on its bytecode and closure
but not on its ``launch_bounds``, so two kernels that differ only in their bounds would load each other's binary:
``key_cache_on`` adds the bounds to the key through the dispatcher's ``CUDACache._index_key``.  ``check()`` says in
one line which of them a numba-cuda upgrade removed; ``tests/kernels/test_numba_internals.py`` runs it, and
``pyproject.toml`` bounds numba-cuda to the versions it passes on.
"""
from __future__ import annotations

REQUIRED = (("numba.cuda.dispatcher", "CUDADispatcher", "_compile_for_args"),
            ("numba.cuda.dispatcher", "_Kernel", "_prepare_args"),
            ("numba.cuda.dispatcher", "_Kernel", "library"),
            ("numba.cuda.cudadrv.driver", None, "_to_core_stream"),
            ("numba.cuda.dispatcher", "CUDACache", "_index_key"))


def missing() -> list[str]:
    """The names in ``REQUIRED`` this numba-cuda lacks (``module.Class.attribute``)."""
    import importlib
    out = []
    for module, cls, attr in REQUIRED:
        try:
            owner = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
        except (ImportError, AttributeError):
            out.append(f"{module}.{cls or ''}")
            continue
        if not hasattr(owner, attr):
            out.append(f"{module}.{cls + '.' if cls else ''}{attr}")
    return out


def check() -> None:
    """Raise ``RuntimeError`` naming what is missing when this numba-cuda lacks an internal pegainfer uses."""
    gone = missing()
    if gone:
        import numba_cuda
        raise RuntimeError(f"numba-cuda {numba_cuda.__version__} lacks {', '.join(gone)}, which pegainfer's "
                           "launches and kernel cache use (pegainfer/kernels/numba_internals.py): install the "
                           "numba-cuda version pyproject.toml names")


def key_cache_on(dispatcher, extra: tuple):
    """Make ``extra`` (e.g. the launch bounds) part of the key under which ``dispatcher``'s compiled kernels are
    cached on disk (a dispatcher made with ``cache=True``); returns the dispatcher."""
    cache = dispatcher._cache
    index_key = cache._index_key
    cache._index_key = lambda sig, codegen: index_key(sig, codegen) + (extra,)
    return dispatcher


def compiled(kernel, args):
    """The compiled kernel (numba's ``_Kernel``) a dispatcher launches for ``args``, compiling it if needed."""
    return kernel._compile_for_args(*args)


def cu_function(compiled_kernel):
    """The driver function (``cuda.core`` kernel handle holder) of a compiled kernel."""
    return compiled_kernel.library.get_cufunc()


def marshal(compiled_kernel, args, stream):
    """``(core_stream, kernel_args)``: the stream as ``cuda.core`` takes it and the arguments as numba's launch
    marshals them (device arrays as their pointer/shape/stride fields, scalars typed)."""
    from numba.cuda.cudadrv.driver import _to_core_stream
    core_stream = _to_core_stream(stream)
    kernel_args, writeback = [], []
    for ty, value in zip(compiled_kernel.argument_types, args):
        compiled_kernel._prepare_args(ty, value, core_stream, writeback, kernel_args)
    return core_stream, kernel_args
