"""Server-sent events, written straight to the ASGI server: one write per event.

    event_bytes(obj)          "data: <json>\\n\\n", the JSON by orjson
    ChunkTemplate(obj)        the bytes of a chunk object whose only varying part is one
                              string: rendered once with a placeholder, then each event is
                              prefix + orjson(text) + suffix (most of a stream's chunks: a
                              choice's plain text delta)
    EventStream(events, gen)  a Response that sends each event's bytes as one ASGI body
                              message (no per-event task or memory stream in between); a
                              client that goes away cancels it through `gen`
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response

PLACEHOLDER = "\x00"  # never in generated text's JSON unescaped: orjson writes "\u0000"
_PLACEHOLDER_JSON = orjson.dumps(PLACEHOLDER)


def event_bytes(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def named_event_bytes(kind: str, obj: Any) -> bytes:
    """An event with its type on the `event:` line (the Responses API's)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ChunkTemplate:
    """event_bytes of an object in which PLACEHOLDER stands for one string, for any string."""

    __slots__ = ("head", "tail")

    def __init__(self, obj: Any) -> None:
        head, sep, tail = event_bytes(obj).partition(_PLACEHOLDER_JSON)
        if not sep or _PLACEHOLDER_JSON in tail:
            raise ValueError("the template object must hold the placeholder exactly once")
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + orjson.dumps(text) + self.tail


class Disconnect:
    """Cancels the task that streams a response when its client goes away: the ASGI server
    tells by `http.disconnect` on receive(), which one watcher task per request waits for."""

    def __init__(self, receive, on_disconnect=None) -> None:
        self.consumer = asyncio.current_task()
        self.is_disconnected = False
        self._on_disconnect = on_disconnect
        self.watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.is_disconnected = True
        if self._on_disconnect is not None:
            self._on_disconnect()
        if self.consumer is not None and not self.consumer.done():
            self.consumer.cancel()

    def close(self) -> None:
        self.watcher.cancel()


class EventStream(Response):
    """A text/event-stream response of byte events (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], disconnect: Disconnect) -> None:
        # no Response.__init__: its headers would say content-length 0
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]
        self.events = events
        self.disconnect = disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except asyncio.CancelledError:
            if not self.disconnect.is_disconnected:
                raise
            return  # the client left: nobody to finish the response for
        finally:
            self.disconnect.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
