"""Server-Sent Events responses that always release what their generator holds."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# The scope's key for the server's own send (``server_send``).
SERVER_SEND = "tandem.server_send"

# One encoder for every event: json.dumps with arguments of its own builds a new one per
# call, a cost on every streamed chunk.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def to_json(value: Any) -> str:
    """``value`` as every event writes JSON: compact, non-ASCII characters as they are."""
    return _JSON.encode(value)


def event(data: dict[str, Any], name: str | None = None) -> str:
    """One event holding ``data`` as JSON; ``name`` is its ``event:`` field, if it has one."""
    line = f"data: {to_json(data)}\n\n"
    return line if name is None else f"event: {name}\n{line}"


class EventStreamResponse(Response):
    """A text/event-stream response, an ASGI callable of its own: its start goes through
    every middleware, each of its events then goes to the server's send in one message
    (``server_send``), and its generator is closed however streaming ends.

    uvicorn's send does nothing once the client has gone, so a task waits for the
    disconnect and cancels the stream, as Starlette's StreamingResponse does with a task
    group of its own. If the generator was waiting at a ``yield`` then (a send in
    progress), nothing would close it until garbage collection, and the engine would keep
    generating for nobody: closing it here runs its cleanup, which aborts the request.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        self.status_code = 200
        self.background = None
        # No caching, and no buffering in nginx-style proxies: events must flow.
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.current_task()
        assert stream is not None
        gone = False

        async def cancel_when_gone() -> None:
            # Nothing else reads the request once its body is in.
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            stream.cancel()

        watcher = asyncio.create_task(cancel_when_gone())
        send_body = scope.get(SERVER_SEND, send)
        try:
            start = {
                "type": "http.response.start",
                "status": self.status_code,
                "headers": self.raw_headers,
            }
            await send(start)
            async for text in self._events:
                body = {"type": "http.response.body", "body": text.encode(), "more_body": True}
                await send_body(body)
            await send_body({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # The client went away, or the server stops: one line, no trace.
            logger.info("a client went away during its stream")
            # The watcher's cancel ends the stream here; any other goes on up.
            if not gone or stream.uncancel() > 0:
                raise
        finally:
            watcher.cancel()
            await self._events.aclose()


def server_send(app: ASGIApp) -> ASGIApp:
    """``app`` with the server's own send in every HTTP scope (``SERVER_SEND``), which an
    event stream sends its bodies to past the middleware's wrappers of send: a call each
    on every chunk, for wrappers that act on a response's start alone. So no middleware
    inside ``app`` may change a response's body (compression, for one)."""

    async def with_server_send(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return with_server_send
