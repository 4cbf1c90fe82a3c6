"""Drive the synchronous ``Engine`` from one background thread, and hand its outputs to asyncio code (the server).

::

    event loop (server)                          engine thread
    ───────────────────                          ─────────────
    await add(id, ids, params) ── command ──►    engine.add_request(...)   (between steps)
          ◄── accepted / RequestError ─────┘
    async for out in stream:      ◄─ queue ──    for out in engine.step(): deliver(out)
    stream.cancel() / aclose()    ── command ──► engine.abort(id)          (pages freed at the next step)

* Every call into the engine happens on the engine thread, so the engine needs no locks.  Other threads only
  append commands to a list and wake the thread through a condition variable; the thread sleeps there when it
  has nothing to do.
* Outputs reach the event loop through a per-request ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``:
  the loop never waits on GPU work, and a slow client only lets its own queue grow.
* A stream that is closed before its request finished (the client went away) aborts the request at once.
* Admission control: when ``max_waiting`` requests are already waiting (queued commands plus the engine's waiting
  list), ``add`` raises ``QueueFullError`` instead of piling up more (the server answers 503 + Retry-After).
* The engine can be built on the thread itself (``engine_factory``: load weights, warm up), so a server can answer
  ``/health`` with 503 while the model loads.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, Optional, Sequence

from pegainfer.engine.types import RequestOutput, SamplingParams
from pegainfer.errors import PegainferError, RequestError

log = logging.getLogger("pegainfer.engine")


class QueueFullError(PegainferError):
    """Too many requests are waiting for the engine: try again later (HTTP 503 with Retry-After)."""


class EngineNotReadyError(PegainferError):
    """The engine is still loading, failed to load, or has shut down (HTTP 503)."""


class EngineStepError(PegainferError):
    """A step of the engine failed while this request was in it (a bug; HTTP 500)."""


class RequestStream:
    """The outputs of one request, as an async iterator.  Closing it early (``aclose``, ``cancel``, leaving
    ``async with``) aborts the request in the engine."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._accepted: asyncio.Future = loop.create_future()
        self.finished = False

    # called on the event loop (scheduled from the engine thread)
    def _put(self, item) -> None:
        self._queue.put_nowait(item)

    def _accept(self, error: Optional[BaseException]) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self._owner._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self._owner._forget(self.request_id)
        return item

    def cancel(self) -> None:
        """Abort the request if it is still running (idempotent; safe from the event loop)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncEngine:
    """One engine, one thread.  Build it with an engine, or with ``engine_factory`` to load on the thread."""

    def __init__(self, engine=None, *, engine_factory: Optional[Callable[[], object]] = None,
                 max_waiting: Optional[int] = None):
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine and engine_factory")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine = engine
        self._factory = engine_factory
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds = 0              # add commands not yet reflected in the engine's stats
        self._stats: dict = {}
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.state = "created"              # created → loading → ready → stopped, or failed
        self.load_error: Optional[BaseException] = None
        self._ready_event = threading.Event()  # set when ready or failed
        self.steps = 0

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        with self._cond:
            if self._thread is not None:
                return self
            if self.engine is not None:  # built already: ready at once (the thread has not touched it yet)
                self._stats = dict(self.engine.stats())
                self.state = "ready"
                self._ready_event.set()
            else:
                self.state = "loading"
            self._thread = threading.Thread(target=self._run, name="pegainfer-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Block until the engine is ready (True) or failed / timed out (False)."""
        self._ready_event.wait(timeout)
        return self.ready

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stats(self) -> dict:
        """The engine's own accounting after its last step (``waiting``, ``running``, ``kv_pages_used``,
        ``slots_used``, ...), plus ``pending`` (requests queued to the thread) and ``streams`` (open streams)."""
        with self._cond:
            out = dict(self._stats)
            out["pending"] = self._pending_adds
            out["streams"] = len(self._streams)
            out["steps"] = self.steps
            out["state"] = self.state
        return out

    # ------------------------------------------------------------------------------------------------ requests
    async def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Queue a request and wait until the engine accepted it (raises ``RequestError`` if it refused it,
        ``QueueFullError`` when the waiting queue is full, ``EngineNotReadyError`` before it is ready)."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        with self._cond:
            if self.state != "ready":
                raise EngineNotReadyError(self._not_ready_message())
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use")
            if self.max_waiting is not None:
                waiting = self._stats.get("waiting", 0) + self._pending_adds
                if waiting >= self.max_waiting:
                    raise QueueFullError(f"{waiting} requests are already waiting (--max-waiting "
                                         f"{self.max_waiting}): retry later")
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._commands.append(("add", request_id, list(prompt_ids), params))
            self._cond.notify()
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except BaseException:
            stream.finished = True
            self._forget(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """``add`` + iterate; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.add(request_id, prompt_ids, params)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Forget a request's stream and tell the engine to drop it.  Callable from any thread."""
        with self._cond:
            self._streams.pop(request_id, None)
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)

    def _not_ready_message(self) -> str:
        if self.state == "failed":
            return f"the engine failed: {self.load_error}"
        if self.state == "stopped":
            return "the engine has shut down"
        return "the model is still loading: retry when GET /health answers 200"

    # ------------------------------------------------------------------------------------------------ thread
    def _send(self, stream: RequestStream, method: str, arg) -> None:
        """Run ``stream.<method>(arg)`` on its event loop (the loop may already be gone: then drop the request)."""
        try:
            stream._loop.call_soon_threadsafe(getattr(stream, method), arg)
        except RuntimeError:  # loop closed
            with self._cond:  # (a re-entrant lock: callers may hold it already)
                self._streams.pop(stream.request_id, None)
                self._commands.append(("abort", stream.request_id))

    def _run(self) -> None:
        if self.engine is None:
            try:
                self.engine = self._factory()
            except BaseException as e:  # noqa: BLE001 - reported through /health and the log
                self.load_error = e
                if isinstance(e, PegainferError):
                    log.error("the model failed to load: %s", e)
                else:
                    log.exception("the model failed to load")
                with self._cond:
                    self.state = "failed"
                self._ready_event.set()
                return
            with self._cond:
                self._stats = dict(self.engine.stats())
                self.state = "ready"
            self._ready_event.set()
        try:
            self._loop()
        finally:
            with self._cond:
                if self.state != "failed":
                    self.state = "stopped"
                streams = list(self._streams.values())
                self._streams.clear()
            for s in streams:
                gone = EngineNotReadyError(self._not_ready_message())
                self._send(s, "_accept", gone)
                self._send(s, "_put", gone)

    def _loop(self) -> None:
        engine = self.engine
        busy = False
        failures = 0  # consecutive failed steps
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                commands, self._commands = self._commands, []
            applied_adds = 0
            for cmd in commands:
                if cmd[0] == "add":
                    applied_adds += 1
                    self._apply_add(*cmd[1:])
                else:
                    engine.abort(cmd[1])
            if commands:
                with self._cond:  # new requests now count in the engine's own waiting list
                    self._pending_adds -= applied_adds
                    self._stats = dict(engine.stats())
            outputs: list[RequestOutput] = []
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                    self.steps += 1
                    failures = 0
                except Exception as e:  # noqa: BLE001 - a bug in a step must not kill the server
                    failures += 1
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
                    if failures >= 3:  # even the steps that only drop the aborted requests fail: give up
                        log.critical("the engine keeps failing; it stops taking requests (GET /health → 503)")
                        with self._cond:
                            self.load_error = e
                            self.state = "failed"
                        return
            with self._cond:
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                        self._send(stream, "_put", out)
                self._stats = dict(engine.stats())
            busy = engine.has_unfinished()

    def _apply_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is None:  # cancelled before it reached the engine
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except PegainferError as e:
            error: Optional[BaseException] = e
        except Exception as e:  # noqa: BLE001
            log.exception("engine.add_request failed")
            error = EngineStepError(f"the engine failed to accept the request ({type(e).__name__}: {e})")
        else:
            error = None
        if error is not None:
            with self._cond:
                self._streams.pop(request_id, None)
        self._send(stream, "_accept", error)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
        for s in streams:
            self.engine.abort(s.request_id)
            self._send(s, "_put", EngineStepError(f"the engine failed during a step "
                                                  f"({type(error).__name__}: {error})"))
