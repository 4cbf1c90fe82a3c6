"""Request ids: every HTTP request gets one, and every log line written while serving it carries it.

* ``RequestIdMiddleware`` (pure ASGI, wrapped around the app) takes the client's ``x-request-id`` header, or makes
  one, stores it with the request's arrival time in ``scope["state"]`` (``request.state.request_id`` /
  ``.arrival``), returns it in the response's ``x-request-id`` header (errors included), and sets the
  ``REQUEST_ID`` context variable for the request's task, so code that handles the request does not pass it around.
* ``RequestIdFilter`` on the ``pegainfer.server`` logger puts ``[<request id>] `` in front of every message logged
  while that variable is set (``record.request_id`` holds it too, for formats of one's own), so the log formats
  the CLI sets up need no change.

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
