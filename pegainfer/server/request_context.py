"""What belongs to one request besides its answer: its id, carried by every log line written while serving it, and
its log line and metrics when it ends (``RequestLog``).

* ``RequestIdMiddleware`` (pure ASGI, wrapped around the app) takes the client's ``x-request-id`` header, or makes
  one, stores it with the request's arrival time in ``scope["state"]`` (``request.state.request_id`` /
  ``.arrival``), returns it in the response's ``x-request-id`` header (errors included), and sets the
  ``REQUEST_ID`` context variable for the request's task, so code that handles the request does not pass it around.
* ``RequestIdFilter`` on the ``pegainfer.server`` logger puts ``[<request id>] `` in front of every message logged
  while that variable is set (``record.request_id`` holds it too, for formats of one's own), so the log formats
  the CLI sets up need no change.
* ``RequestLog`` times a request from its arrival and, when it ends, writes its one log line and records it in the
  metrics (``metrics.py``) — once, whichever way it ended.

A client's id is kept when it is 1–128 visible ASCII characters (no spaces, quotes or control characters: it goes
into log lines and headers as is); otherwise the server makes a fresh one, and the response header says which.
"""
from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from typing import Optional

from pegainfer.engine.types import RequestOutput
from pegainfer.server.metrics import ServerMetrics

log = logging.getLogger("pegainfer.server")

REQUEST_ID: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("pegainfer_request_id", default=None)

HEADER = b"x-request-id"
MAX_ID_CHARS = 128
_GOOD_ID = re.compile(r"[!#-&(-~]{1,%d}" % MAX_ID_CHARS)   # visible ASCII without '"' and "'"


def request_id_from(header_value: Optional[str]) -> str:
    """The client's id when it is usable (see the module docstring), else a fresh one (32 hex digits)."""
    if header_value is not None and _GOOD_ID.fullmatch(header_value):
        return header_value
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """ASGI middleware: one request id (and arrival time) per HTTP request; see the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = None
        for name, value in scope["headers"]:
            if name == HEADER:
                sent = value.decode("latin-1")
                break
        request_id = request_id_from(sent)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrival"] = time.perf_counter()
        header = (HEADER, request_id.encode("ascii"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Prefixes a record's message with ``[<request id>] `` when it is logged while a request is served (the
    ``REQUEST_ID`` context variable is set), and stores the id in ``record.request_id`` (None otherwise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        record.request_id = request_id
        if request_id is not None and isinstance(record.msg, str):
            record.msg = f"[{request_id.replace('%', '%%')}] {record.msg}" if record.args else \
                f"[{request_id}] {record.msg}"
        return True


def install_log_filter(logger: logging.Logger) -> None:
    """Attach one ``RequestIdFilter`` to ``logger`` (again and again: still one)."""
    if not any(isinstance(f, RequestIdFilter) for f in logger.filters):
        logger.addFilter(RequestIdFilter())


class RequestLog:
    """Times one request (from its arrival at the server), and when it ends writes its single log line and counts it
    in the metrics — once, however many paths report the end."""

    def __init__(self, request_id: str, route: str, arrival: float, metrics: ServerMetrics, id_note: str = ""):
        self.request_id = request_id
        self.route = route
        self.id_note = id_note   # " id=<engine id>" when it is not <prefix>-<x-request-id> (the log line's prefix)
        self.t0 = arrival
        self.metrics = metrics
        self.t_first: Optional[float] = None
        self.t_scheduled: Optional[float] = None   # when the engine first scheduled it (its finishing output says)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0   # prompt tokens the prefix cache served
        self.finish: Optional[str] = None
        self.written = False

    def saw(self, out: RequestOutput) -> None:
        if self.t_first is None and out.new_token_ids:
            self.t_first = time.perf_counter()
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = getattr(out, "cached_tokens", 0) or self.cached_tokens
        if getattr(out, "scheduled_time", None) is not None:
            self.t_scheduled = out.scheduled_time

    def write(self, finish: Optional[str] = None) -> None:
        if self.written:
            return
        self.written = True
        end = time.perf_counter()
        finish = finish or self.finish or "cancelled"
        ttft = f"{(self.t_first - self.t0) * 1e3:.1f}ms" if self.t_first is not None else "-"
        log.info("%s%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%s total=%.1fms finish=%s",
                 self.route, self.id_note, self.prompt_tokens, self.cached_tokens, self.completion_tokens, ttft,
                 (end - self.t0) * 1e3, finish)
        self.metrics.request_finished(finish, self.prompt_tokens, self.completion_tokens, self.t0, self.t_first, end,
                                      self.t_scheduled)
