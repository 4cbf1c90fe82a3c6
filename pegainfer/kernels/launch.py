"""The one launch wrapper: every kernel launch in pegainfer goes through ``launch``.

It owns the stream kernels are launched on (so a whole decode step can be captured into a CUDA graph by pointing
it at a capturing stream) and an optional tracer that times each launch with CUDA events (Chrome trace output).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

_stream: Any = 0
_tracer: Optional[Callable] = None


def launch(kernel, grid: int, block: int, *args, shared: int = 0, name: str | None = None) -> None:
    """Launch ``kernel[grid, block, stream, shared](*args)`` on the current stream (1-D grids and blocks)."""
    if _tracer is not None:
        with _tracer(name or getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None), "__name__", "kernel")):
            kernel[grid, block, _stream, shared](*args)
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
