"""The Python heap of a running engine: frozen once warm-up is done, and every garbage collection timed.

A warmed-up engine holds a few million long-lived Python objects: the compiled kernels' dispatchers and launch
configurations, the CUDA graphs of every step shape with the arguments of each kernel they hold, the tokenizer.
Python's cyclic garbage collector walks all of them in every full (generation-2) collection, and a collection stops
the engine thread -- so every stream -- until it ends: serving 64 streams, one such pause put a 1.1 s gap into every
stream (``docs/perf/engine.md``).  ``freeze`` moves every object alive after warm-up into the permanent generation,
which collections skip (``gc.freeze``; vLLM and SGLang freeze their start-up heap for the same reason), so a full
collection walks only what serving allocated since.

``GcPauses`` times every collection through ``gc.callbacks``: the cumulative pause, the count of full collections
and the longest pause are engine stats (``/metrics``: ``pegainfer:gc_pause_seconds``,
``pegainfer:gc_full_collections``, ``pegainfer:gc_longest_pause_seconds``),
and a pause of ``SLOW_PAUSE_S`` or more is logged with its generation and the objects it collected.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time

log = logging.getLogger("pegainfer.engine")

SLOW_PAUSE_S = 0.02
"""A collection that stops the process this long or longer is logged (a decode step of 64 streams is ~5 ms)."""


def freeze() -> dict:
    """Collect once, then move every live object to the permanent generation.  Returns what it did:
    ``objects`` frozen, ``full_collect_s`` (the full collection before freezing: what one would cost from now on
    without the freeze) and ``after_s`` (one right after, which skips the frozen objects)."""
    t0 = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t0
    gc.freeze()
    t0 = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - t0
    return {"objects": gc.get_freeze_count(), "full_collect_s": full, "after_s": after}


def pause_stats(pauses: "GcPauses | None") -> dict:
    """The engine stats of ``pauses`` (zeros without a timer): ``gc_pause_seconds``, ``gc_full_collections``,
    ``gc_longest_pause_seconds``."""
    if pauses is None:
        return {"gc_pause_seconds": 0.0, "gc_full_collections": 0, "gc_longest_pause_seconds": 0.0}
    return {"gc_pause_seconds": pauses.seconds, "gc_full_collections": pauses.full_collections,
            "gc_longest_pause_seconds": pauses.longest_s}


class GcPauses:
    """Times every garbage collection of the process (``install`` once; ``gc.callbacks`` is process-wide)."""

    _instance: "GcPauses | None" = None
    _lock = threading.Lock()

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds = 0.0            # every collection's pause, summed
        self.full_collections = 0     # generation-2 collections
        self.longest_s = 0.0
        self._start = None

    @classmethod
    def install(cls) -> "GcPauses":
        """The process's timer, registered with ``gc.callbacks`` the first time."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                gc.callbacks.append(cls._instance.callback)
            return cls._instance

    def callback(self, phase: str, info: dict) -> None:
        """``gc.callbacks`` hook: ``phase`` "start" or "stop"; ``info`` has the ``generation`` and, at "stop",
        the objects ``collected``.  The interpreter's own collections as it exits are not counted (nothing waits on
        them, and logging is going away)."""
        if sys.is_finalizing():
            return
        if phase == "start":
            self._start = self.clock()
            return
        if self._start is None:
            return
        pause = self.clock() - self._start
        self._start = None
        self.seconds += pause
        self.longest_s = max(self.longest_s, pause)
        if info.get("generation") == 2:
            self.full_collections += 1
        if pause >= SLOW_PAUSE_S:
            log.warning("garbage collection of generation %s paused the process for %.0f ms (%s objects collected)",
                        info.get("generation"), pause * 1e3, info.get("collected"))
