"""What the engine is doing while nothing else shows: warm-up (kernel launches, kernels compiled) and, in the
simulator, a prompt's prefill kernel by kernel.

On a terminal: one self-overwriting line on stderr, drawn only once a wait has lasted half a second (fast steps
print nothing).  Whether or not stderr is a terminal, a GPU's first start logs two lines: that kernels are being
compiled and where numba caches them, then how many it compiled in how long.  Later starts load them from that
cache and log nothing.

Counting uses two hooks that cost nothing when unused: ``kernels.launch.traced`` (a context manager around every
kernel launch) and numba-cuda's compiler events (``numba.cuda.core.event``).  A kernel was compiled, not loaded
from numba's disk cache, when compiler passes ran while numba's compiler lock was held (outermost hold: device
functions compiled for the kernel count with it).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("pegainfer.engine")

SHOW_AFTER_S = 0.5    # a wait shorter than this prints nothing
REDRAW_EVERY_S = 0.1


class StatusLine:
    """One self-overwriting ``[pegainfer] ...`` line on ``stream`` (stderr) when it is a terminal; nothing when not."""

    def __init__(self, stream=None, show_after_s: float = SHOW_AFTER_S):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.show_after_s = show_after_s
        self.shown = False
        self._last_draw = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def show(self, text: str) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if now - self.start < self.show_after_s or now - self._last_draw < REDRAW_EVERY_S:
            return
        self._last_draw = now
        self.stream.write(f"\r[pegainfer] {text}\033[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the line (before other output goes to the terminal, and when done)."""
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


class _OneLaunch:
    """The context manager the launch wrapper enters around one launch: counts it when it returns."""

    __slots__ = ("counter",)

    def __init__(self, counter: "LaunchCounter"):
        self.counter = counter

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.counter.count += 1
        self.counter.on_launch()


class LaunchCounter:
    """Counts kernel launches while active (``with LaunchCounter(cb):`` or until ``close()``), calling
    ``on_launch()`` after each one."""

    def __init__(self, on_launch: Callable[[], None] = lambda: None):
        self.count = 0
        self.on_launch = on_launch
        self._one = _OneLaunch(self)
        self._installed = None

    def __enter__(self) -> "LaunchCounter":
        from pegainfer.kernels.launch import traced
        self._installed = traced(lambda name: self._one)
        self._installed.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        installed, self._installed = self._installed, None
        if installed is not None:
            installed.__exit__(None, None, None)


class CompileCounter:
    """Counts kernels numba compiles while active (GPU only: the simulator compiles nothing).  ``on_first()`` runs
    when the first compilation starts, ``on_compiled()`` after each one."""

    def __init__(self, on_first: Callable[[], None] = lambda: None, on_compiled: Callable[[], None] = lambda: None):
        self.compiled = 0
        self.on_first = on_first
        self.on_compiled = on_compiled
        self._depth: dict[int, int] = {}      # compiler-lock depth per thread
        self._passes: dict[int, bool] = {}    # whether passes ran inside the current outermost hold, per thread
        self._listener = None
        self._started = False

    def _lock(self, start: bool) -> None:
        tid = threading.get_ident()
        depth = self._depth.get(tid, 0) + (1 if start else -1)
        self._depth[tid] = depth
        if start and depth == 1:
            self._passes[tid] = False
        elif not start and depth == 0 and self._passes.pop(tid, False):
            self.compiled += 1
            self.on_compiled()

    def _pass(self) -> None:
        tid = threading.get_ident()
        if self._depth.get(tid, 0) > 0 and not self._passes.get(tid, False):
            self._passes[tid] = True
            if not self._started:
                self._started = True
                self.on_first()

    def __enter__(self) -> "CompileCounter":
        try:
            from numba.cuda.core import event
        except ImportError:   # an older numba-cuda without compiler events: count nothing
            return self
        counter = self

        class Listener(event.Listener):
            def on_start(self, ev):
                if ev.kind == "numba-cuda:compiler_lock":
                    counter._lock(True)
                else:
                    counter._pass()

            def on_end(self, ev):
                if ev.kind == "numba-cuda:compiler_lock":
                    counter._lock(False)

        self._listener = Listener()
        event.register("numba-cuda:compiler_lock", self._listener)
        event.register("numba-cuda:run_pass", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        if self._listener is not None:
            from numba.cuda.core import event
            event.unregister("numba-cuda:compiler_lock", self._listener)
            event.unregister("numba-cuda:run_pass", self._listener)
            self._listener = None


def kernel_cache_folder() -> str:
    """Where numba keeps compiled kernels (``cache=True``): ``$NUMBA_CACHE_DIR`` when set; else ``__pycache__``
    folders beside the kernel sources when the package folder is writable; else numba's per-user cache."""
    chosen = os.environ.get("NUMBA_CACHE_DIR")
    if chosen:
        return chosen
    kernels = Path(__file__).resolve().parents[1] / "kernels"
    if os.access(kernels, os.W_OK):
        return f"the __pycache__ folders under {kernels}"
    return str(Path.home() / ".cache" / "numba")


class WarmupProgress:
    """Progress of ``Engine.warmup``: ``phase(text)`` starts a phase (a warm-up request, graph capture), ``step()``
    is entered around each engine step.  Keeps the launch count of every step (``step_launches``)."""

    def __init__(self, phases: int, stream=None):
        self.phases = phases
        self.phase_no = 0
        self.phase_text = ""
        self.line = StatusLine(stream)
        self.step_launches: list[int] = []
        self.launches = LaunchCounter(self._draw)
        self.compiles = CompileCounter(on_first=self._first_compile, on_compiled=self._draw)
        self._step_start = 0

    def __enter__(self) -> "WarmupProgress":
        self.launches.__enter__()
        self.compiles.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.compiles.__exit__(*exc)
        self.launches.__exit__(*exc)
        self.line.clear()
        if self.compiles.compiled and exc[0] is None:
            log.info("compiled %d kernels (warm-up took %.0f s); later starts load them from the cache", self.compiles.compiled,
                     self.line.elapsed())

    def phase(self, text: str) -> None:
        self.phase_no += 1
        self.phase_text = text
        self._draw()

    def step(self) -> "WarmupProgress._Step":
        return WarmupProgress._Step(self)

    class _Step:
        def __init__(self, progress: "WarmupProgress"):
            self.progress = progress

        def __enter__(self):
            self.start = self.progress.launches.count

        def __exit__(self, *exc):
            self.progress.step_launches.append(self.progress.launches.count - self.start)

    def _first_compile(self) -> None:
        self.line.clear()
        log.info("compiling the GPU kernels (first start only: two to three minutes); numba caches them in %s "
                 "(NUMBA_CACHE_DIR chooses another folder)", kernel_cache_folder())

    def _draw(self) -> None:
        compiled = f", {self.compiles.compiled} kernels compiled" if self.compiles.compiled else ""
        self.line.show(f"warming up ({self.phase_no}/{self.phases}: {self.phase_text}): "
                       f"{self.launches.count} kernel launches{compiled}, {self.line.elapsed():.0f} s")


class PrefillProgress:
    """A prompt's prefill, kernel by kernel (for the simulator, where one takes seconds): ``k/N kernels`` with N
    the launches of a warm-up prefill, until ``close()`` (the first token)."""

    def __init__(self, prompt_tokens: int, total_launches: Optional[int] = None, stream=None):
        self.prompt_tokens = prompt_tokens
        self.total = total_launches
        self.line = StatusLine(stream)
        self.launches = LaunchCounter(self._draw)

    def __enter__(self) -> "PrefillProgress":
        if self.line.tty:
            self.launches.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.launches.close()
        self.line.clear()

    def _draw(self) -> None:
        k = self.launches.count
        of = f"/{self.total}" if self.total and k <= self.total else ""
        self.line.show(f"prefill of {self.prompt_tokens} tokens: kernel {k}{of}, {self.line.elapsed():.0f} s")
