"""A line in the server's log every ``INTERVAL_S`` seconds while it works, as vLLM writes one::

    Avg prompt throughput: 8192.0 tokens/s, Avg generation throughput: 11843.5 tokens/s, Running: 64 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

Throughputs and the hit rate are over the interval (from the engine's cumulative counters, ``Engine.stats``); the
request counts and KV usage are the current ones; ``Preempted: N reqs`` is added in an interval with preemptions.
Nothing is logged while the server is idle but the first idle interval's line (all zeros, as vLLM's: the work
has ended).  ``serve --disable-log-stats`` turns it off.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

INTERVAL_S = 10.0   # vLLM's default

log = logging.getLogger("pegainfer.stats")


class StatsLogger:
    """Turns successive ``stats()`` readings into log lines (``line``), and logs them from a daemon thread
    (``start`` / ``stop``).  ``clock`` and ``emit`` are for tests."""

    def __init__(self, stats: Callable[[], dict], interval: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[[str], None] = log.info):
        self.stats, self.clock, self.emit = stats, clock, emit
        self.interval = INTERVAL_S if interval is None else interval
        self._last: Optional[tuple[float, dict]] = None
        self._busy = False                       # the last line reported work: one more (idle) line follows
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def line(self) -> Optional[str]:
        """The line for the interval since the previous call (None on the first call, and while idle)."""
        now, s = self.clock(), self.stats()
        last, self._last = self._last, (now, s)
        if last is None or not s:
            return None
        t0, s0 = last
        dt = max(now - t0, 1e-9)
        get = lambda d, key: d.get(key, 0) or 0                        # noqa: E731 (a loading engine has no keys)
        delta = lambda key: max(0, get(s, key) - get(s0, key))         # noqa: E731
        prompt, generated, preempted = delta("prompt_tokens_computed"), delta("generation_tokens"), \
            delta("num_preemptions")
        running, waiting = get(s, "running"), get(s, "waiting") + get(s, "pending")
        busy = bool(prompt or generated or running or waiting)
        if not busy and not self._busy:
            return None
        self._busy = busy
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        total = get(s, "kv_pages_total")
        text = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: "
                f"{generated / dt:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache "
                f"usage: {100.0 * get(s, 'kv_pages_used') / total if total else 0.0:.1f}%, Prefix cache hit rate: "
                f"{100.0 * hits / queries if queries else 0.0:.1f}%")
        return text + (f", Preempted: {preempted} reqs" if preempted else "")

    def _run(self) -> None:
        self.line()                               # the first reading: what the first interval counts from
        while not self._stop.wait(self.interval):
            text = self.line()
            if text is not None:
                self.emit(text)

    def start(self) -> "StatsLogger":
        self._thread = threading.Thread(target=self._run, name="pegainfer-stats-log", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
