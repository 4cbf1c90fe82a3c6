"""Drive the synchronous ``Engine`` from one background thread, and hand its outputs to asyncio code (the server).

::

    event loop (server)                          engine thread
    ───────────────────                          ─────────────
    stream = submit(id, ids, params) ─ command ─► engine.add_request(...)   (between steps)
    await stream.accepted()       ◄── accepted / RequestError ─┘
    async for out in stream:      ◄── outputs ── for out in engine.step(): ...  (one hand-off per step)
    stream.cancel()               ── command ──► engine.abort(id)          (pages freed at the next step)

* Every call into the engine happens on the engine thread, so the engine needs no locks.  Other threads only
  append commands to a list and wake the thread through a condition variable; the thread sleeps there when it
  has nothing to do.
* What the engine thread hands back (acceptances, the outputs of a step) goes to the event loop in one
  ``loop.call_soon_threadsafe`` per batch, not one per request.  Each request's stream keeps its outputs in a
  deque; the loop never waits on GPU work, and a slow client only lets its own deque grow.
* When: waking the loop starts its work on the outputs (SSE chunks, socket writes: Python that needs the GIL), and
  any GIL release of the engine thread (the wake-up's own ``write``, every CUDA driver call) can hand the GIL to
  the loop, so the loop's work would stretch the engine's host work between two GPU steps — every token.  An
  engine that offers a ``before_gpu_wait`` slot calls it once a step is enqueued on the GPU, right before its
  thread waits (without the GIL) for the result; the engine thread holds acceptances and outputs back until then,
  so the loop works while the GPU does.  Outputs then reach the loop one step's host work later, every token
  alike: TPOT is unchanged.  Engines without the slot get everything at once.
* First-token hand-off: after a step that produced some request's first output, the engine thread waits (without
  the GIL, at most ``first_token_handoff_s``) until the event loop has taken that output and come back for the
  next one — i.e. until the server has written the first chunk — before it starts the next step.  Otherwise the
  next step's host work (inputs, uploads, launch: Python holding the GIL) would run first and the first chunk
  would leave only after it; this way it costs the second token that time instead of the first, once per request.
* A stream that is cancelled before its request finished (the client went away) aborts the request at once, and
  wakes whoever waits on it (``accepted()`` raises ``CancelledError``, iteration stops).
* Admission control: ``max_waiting`` bounds the requests waiting for a place in the batch, i.e. not yet admitted.
  A request being prefilled or decoded is running, not waiting: of the requests queued (commands not yet applied
  plus the engine's waiting list) as many as the batch has free places (``max_batch`` minus running) are about to
  be admitted, the rest wait.  When ``max_waiting`` of them already wait, ``submit`` raises ``QueueFullError``
  instead of piling up more (the server answers 503 + Retry-After).  Counting free places, not the engine's waiting
  list alone, also keeps the count right while a step runs: the engine admits a request inside ``step()``, but its
  counts are read only between steps.
* The engine can be built on the thread itself (``engine_factory``: load weights, warm up), so a server can answer
  ``/health`` with 503 while the model loads.
* A failure of the engine thread (an exception from ``step()``, or from any other call into the engine between
  steps) takes the engine out of service: its traceback is logged once, every request in flight — running, waiting,
  or still queued to the thread — gets ``EngineStepError`` (HTTP 500) from its stream or from ``accepted()``, the
  state turns ``failed`` (``/health`` 503) and later ``submit`` calls raise ``EngineNotReadyError`` (503).  After a
  failed step the engine's state (GPU memory, pages, sequences) is unknown, so it is not stepped again; restarting
  the server is the way back.  Nothing waits forever on a dead thread.
* Request ids: an id stays in use from ``submit`` until the engine has dropped the request (its finished output,
  including the one an abort produces, has come out of a step), so a client reusing an id right after an abort can
  never hand the engine a second request under an id it still holds (``in_use``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable, Iterable, Optional, Sequence

from pegainfer.engine.types import RequestOutput, SamplingParams
from pegainfer.errors import PegainferError, RequestError

log = logging.getLogger("pegainfer.engine")


class QueueFullError(PegainferError):
    """Too many requests are waiting for the engine: try again later (HTTP 503 with Retry-After)."""


class EngineNotReadyError(PegainferError):
    """The engine is still loading, failed to load, or has shut down (HTTP 503)."""


class EngineStepError(PegainferError):
    """The engine raised while handling this request (a bug; HTTP 500): in its thread's loop, which takes the engine
    out of service, or while accepting the request, which fails that request alone."""


class RequestStream:
    """The outputs of one request, as an async iterator.  Closing it early (``aclose``, ``cancel``, leaving
    ``async with``) aborts the request in the engine.  Used on its event loop only."""

    def __init__(self, owner: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._items: deque = deque()                  # outputs (or an exception) not yet taken
        self._waiter: Optional[asyncio.Future] = None  # set while __anext__ waits for an item
        self._accepted: asyncio.Future = loop.create_future()
        self.finished = False   # the last output was taken, or the stream was cancelled
        self._first_output = True   # (engine thread) no output handed over yet
        self._handoff = 0           # > 0: the engine thread waits (hand-off number) until this stream's consumer
                                    # comes back for more

    # called on the event loop (scheduled from the engine thread)
    def _put(self, item) -> None:
        self._items.append(item)
        self._wake()

    def _accept(self, error: Optional[BaseException]) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def _handed_off(self) -> None:
        if self._handoff:
            self._owner._handed_off(self._handoff)
            self._handoff = 0

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def accepted(self) -> None:
        """Wait until the engine took the request.  Raises what the engine refused it with (``RequestError``, ...),
        or ``CancelledError`` when the stream was cancelled first; either way the request is gone."""
        try:
            await self._accepted
        except asyncio.CancelledError:
            self.cancel()
            raise
        except BaseException:
            self.finished = True
            self._owner._forget(self.request_id)
            raise

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            self._handed_off()   # everything handed over has been consumed: the engine thread may go on
            if self.finished:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.finished:  # cancelled while outputs were still queued
            raise StopAsyncIteration
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            self._owner._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self._owner._forget(self.request_id)
        return item

    def cancel(self) -> None:
        """Abort the request if it is still running, and wake a waiting ``accepted()`` or iteration (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)
        if not self._accepted.done():
            self._accepted.cancel()
        self._handed_off()
        self._wake()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncEngine:
    """One engine, one thread.  Build it with an engine, or with ``engine_factory`` to load on the thread."""

    def __init__(self, engine=None, *, engine_factory: Optional[Callable[[], object]] = None,
                 max_waiting: Optional[int] = None, first_token_handoff_s: float = 0.002):
        if (engine is None) == (engine_factory is None):
            raise ValueError("pass exactly one of engine and engine_factory")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.engine = engine
        self._factory = engine_factory
        self.max_waiting = max_waiting
        self.first_token_handoff_s = first_token_handoff_s
        self._cond = threading.Condition()
        self._handoff_done = threading.Event()   # set when the event loop took the first outputs of a step
        self._handoff_number = 0
        self._handoffs_left = 0
        self._held: list[tuple[RequestStream, str, object]] = []  # (engine thread) for the next GPU wait
        self._hold_for_gpu = False   # the engine calls before_gpu_wait
        self._commands: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._engine_ids: set[str] = set()   # ids the engine holds (added, not yet seen finished)
        self._pending_adds = 0              # add commands not yet reflected in the engine's stats
        self._stats: dict = {}
        self._max_batch = 0                 # the engine's batch size (0: unknown, every queued request waits)
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
                self._max_batch = _batch_size(self.engine)
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
        ``slots_used``, ...), plus ``pending`` (requests queued to the thread), ``not_admitted`` (what
        ``max_waiting`` bounds) and ``streams`` (open streams)."""
        with self._cond:
            out = dict(self._stats)
            out["pending"] = self._pending_adds
            out["not_admitted"] = self._not_admitted()
            out["streams"] = len(self._streams)
            out["steps"] = self.steps
            out["state"] = self.state
        return out

    # ------------------------------------------------------------------------------------------------ requests
    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """Queue a request for the engine thread and return its stream at once (call it on the event loop that
        will read the stream).  Raises ``QueueFullError`` when the waiting queue is full, ``EngineNotReadyError``
        before the engine is ready, ``RequestError`` for an id in use; ``await stream.accepted()`` tells whether
        the engine took it."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        with self._cond:
            if self.state != "ready":
                raise EngineNotReadyError(self._not_ready_message())
            if request_id in self._streams or request_id in self._engine_ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            if self.max_waiting is not None:
                waiting = self._not_admitted()
                if waiting >= self.max_waiting:
                    raise QueueFullError(f"{waiting} requests are already waiting for a place in the batch "
                                         f"(--max-waiting {self.max_waiting}): retry later")
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._commands.append(("add", request_id, list(prompt_ids), params))
            self._cond.notify()
        return stream

    async def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> RequestStream:
        """``submit`` and wait until the engine accepted the request (raises ``RequestError`` if it refused it,
        ``QueueFullError`` when the waiting queue is full, ``EngineNotReadyError`` before it is ready)."""
        stream = self.submit(request_id, prompt_ids, params)
        await stream.accepted()
        return stream

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """``add`` + iterate; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.add(request_id, prompt_ids, params)
        async with stream:
            async for out in stream:
                yield out

    def in_use(self, request_id: str) -> bool:
        """Whether ``submit(request_id, ...)`` would be refused because a request with that id is still in flight
        (streamed, queued, or not yet dropped by the engine)."""
        with self._cond:
            return request_id in self._streams or request_id in self._engine_ids

    def abort(self, request_id: str) -> None:
        """Forget a request's stream and tell the engine to drop it.  Callable from any thread."""
        with self._cond:
            self._streams.pop(request_id, None)
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def _not_admitted(self) -> int:
        """(under the lock) Requests waiting for a place in the batch: the queued ones (commands not yet applied,
        the engine's waiting list) beyond the batch's free places (see the module docstring)."""
        queued = self._stats.get("waiting", 0) + self._pending_adds
        free = max(0, self._max_batch - self._stats.get("running", 0)) if self._max_batch else 0
        return max(0, queued - free)

    def _handed_off(self, number: int) -> None:
        """(event loop) A stream of hand-off ``number`` has consumed its outputs."""
        with self._cond:
            if number == self._handoff_number:   # (an older hand-off that timed out no longer counts)
                self._handoffs_left -= 1
                if self._handoffs_left <= 0:
                    self._handoff_done.set()

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)

    def _not_ready_message(self) -> str:
        if self.state == "failed":
            if isinstance(self.load_error, EngineStepError):
                return str(self.load_error)
            return f"the engine failed: {self.load_error}"
        if self.state == "stopped":
            return "the engine has shut down"
        return "the model is still loading: retry when GET /health answers 200"

    # ------------------------------------------------------------------------------------------------ thread
    def _deliver(self, items: Iterable[tuple[RequestStream, str, object]]) -> None:
        """Run ``stream.<method>(arg)`` for every (stream, method, arg) on the streams' event loops, in order, in
        one ``call_soon_threadsafe`` per loop (a loop that is already gone drops its requests)."""
        by_loop: dict = {}
        for item in items:
            by_loop.setdefault(item[0]._loop, []).append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_batch, batch)
            except RuntimeError:  # loop closed
                with self._cond:  # (a re-entrant lock: callers may hold it already)
                    for stream, _, _ in batch:
                        self._streams.pop(stream.request_id, None)
                        self._commands.append(("abort", stream.request_id))

    def _hold(self, items: list) -> None:
        """Hand ``items`` to the event loop at the engine's next GPU wait (at once if it has no such hook)."""
        if self._hold_for_gpu:
            self._held.extend(items)
        else:
            self._deliver(items)

    def _release_held(self) -> None:
        """The engine's ``before_gpu_wait``: the step is on the GPU; the loop may take the GIL now."""
        if self._held:
            held, self._held = self._held, []
            self._deliver(held)

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
                self._max_batch = _batch_size(self.engine)
                self.state = "ready"
            self._ready_event.set()
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - reported to every request in flight, /health and the log
            self._fail(e)
        finally:
            with self._cond:
                if self.state != "failed":
                    self.state = "stopped"
                streams = list(self._streams.values())
                self._streams.clear()
            self._release_held()
            why = self._not_ready_message()   # one exception object per stream: each is raised in its own task
            self._deliver([(s, m, EngineNotReadyError(why)) for s in streams for m in ("_accept", "_put")])

    def _loop(self) -> None:
        engine = self.engine
        if hasattr(engine, "before_gpu_wait"):
            engine.before_gpu_wait = self._release_held
            self._hold_for_gpu = True
        busy = False
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                commands, self._commands = self._commands, []
            if commands:
                accepts = []
                for cmd in commands:
                    if cmd[0] == "add":
                        accepts.append(self._apply_add(*cmd[1:]))
                    else:
                        engine.abort(cmd[1])
                with self._cond:  # new requests now count in the engine's own waiting list
                    self._pending_adds -= len(accepts)
                    self._stats = dict(engine.stats())
                self._hold([(stream, "_accept", error) for stream, error in filter(None, accepts)])
            outputs: list[RequestOutput] = []
            if engine.has_unfinished():
                outputs = engine.step()   # an exception ends the loop: _fail
                self.steps += 1
            ready = []
            handoffs = 0
            with self._cond:
                self._handoff_number += 1
                for out in outputs:
                    if out.finished:
                        self._engine_ids.discard(out.request_id)
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                        if stream._first_output:
                            stream._first_output = False
                            if self.first_token_handoff_s > 0:
                                stream._handoff = self._handoff_number
                                handoffs += 1
                        ready.append((stream, "_put", out))
                self._stats = dict(engine.stats())
                self._handoffs_left = handoffs
                self._handoff_done.clear()
            self._release_held()   # (what the step's own GPU wait did not release: it had no GPU work)
            busy = engine.has_unfinished()
            if handoffs or not busy:
                self._deliver(ready)
            else:
                self._hold(ready)
            if handoffs and busy:  # the first chunks go out before the next step's host work (see the docstring)
                self._handoff_done.wait(self.first_token_handoff_s)

    def _apply_add(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """Hand one queued request to the engine; returns (stream, None or the error) to answer, or None."""
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is None:  # cancelled before it reached the engine
            return None
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except PegainferError as e:
            error: Optional[BaseException] = e
        except Exception as e:  # noqa: BLE001
            log.exception("engine.add_request failed for request %s", request_id)
            error = EngineStepError(f"the engine failed to accept the request ({type(e).__name__}: {e})")
        else:
            error = None
        with self._cond:
            if error is None:
                self._engine_ids.add(request_id)
            else:
                self._streams.pop(request_id, None)
        return stream, error

    def _fail(self, error: Exception) -> None:
        """(engine thread) The engine failed: log it once with its traceback, fail every request in flight, and
        take the engine out of service (module docstring)."""
        why = (f"the engine failed ({type(error).__name__}: {error}); it takes no more requests "
               f"(GET /health answers 503): restart the server")
        with self._cond:   # one lock hold: a request is either failed here or refused by submit, never lost
            failure = EngineStepError(why)
            failure.__cause__ = error
            self.load_error = failure
            self.state = "failed"
            streams = list(self._streams.values())
            self._streams.clear()
            self._commands.clear()
            self._pending_adds = 0
            self._engine_ids.clear()
            self._stats = {**self._stats, "waiting": 0, "running": 0}   # every request in flight has ended
        log.error("the engine failed; failing %d request(s) in flight, taking no more (GET /health → 503)",
                  len(streams), exc_info=error)
        self._release_held()   # what earlier steps produced goes out first
        # one exception object per stream and method: each is raised in its own task
        self._deliver([(s, m, EngineStepError(why)) for s in streams for m in ("_accept", "_put")])


def _batch_size(engine) -> int:
    """How many requests ``engine`` runs at once: its ``max_batch``, or its scheduler's (the real engine)."""
    size = getattr(engine, "max_batch", None)
    if size is None:
        size = getattr(getattr(engine, "scheduler", None), "max_batch", 0)
    return int(size or 0)


def _run_batch(batch: list) -> None:
    """On the event loop: apply one engine hand-off (``_accept`` / ``_put`` of each stream, in order)."""
    for stream, method, arg in batch:
        getattr(stream, method)(arg)
