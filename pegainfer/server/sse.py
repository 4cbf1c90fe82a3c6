"""Server-sent events and client disconnects: the response type that streams an answer, the watch that notices a
client going away, and the pre-serialized chunk template that keeps a streamed token's cost to one ``json.dumps`` of
its text (see ``app.py``'s module docstring for what the streaming path costs)."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from starlette.responses import Response


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


class ClientWatch:
    """Listens for the client's ``http.disconnect`` in one background task, once the request body has been read;
    on a disconnect it calls the registered callbacks (a stream's ``cancel``: the request is aborted and whatever
    waits on its stream wakes up).  ``close()`` when the response is done."""

    def __init__(self, receive):
        self.disconnected = False
        self._callbacks: list[Callable[[], None]] = []
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        for callback in self._callbacks:
            callback()

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def close(self) -> None:
        self._task.cancel()


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of ``data: ...\\n\\n`` strings.  An event that ends with
    ``data: [DONE]`` is the last one: it goes out in the same write as the end of the body.

    The request's ``ClientWatch`` ends the iteration when the client goes away (it cancels the request's stream);
    the iterator is always closed and the watch stopped, and ``on_close`` runs last."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], watch: ClientWatch, headers: Optional[dict] = None,
                 on_close: Optional[Callable[[], None]] = None):
        self.events = events
        self.watch = watch
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            more = True
            async for event in self.events:
                if self.watch.disconnected:
                    break
                more = not event.endswith(SSE_DONE)
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": more})
                if not more:
                    break
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.watch.close()
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
_SLOT = "\x00pegainfer-slot\x00"


class ChunkTemplate:
    """One stream chunk serialized once with a string slot, so each token only JSON-encodes its own text:
    ``template.fill(text) == sse(the chunk with text in the slot)`` (``json.dumps`` writes values independently)."""

    def __init__(self, make_chunk: Callable[[str], dict]):
        head, sep, tail = sse(make_chunk(_SLOT)).partition(json.dumps(_SLOT))
        if not sep:
            raise ValueError("the chunk has no string slot")
        self.head, self.tail = head, tail

    def fill(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail
