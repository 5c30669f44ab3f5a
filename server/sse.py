"""Server-Sent Events responses that always release what their generator holds."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"

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


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose generator is closed however streaming ends.

    When the client disconnects, Starlette cancels the streaming task; if that
    happens while the generator waits at a ``yield`` (the send was in progress),
    nothing would close it until garbage collection, and the engine would keep
    generating for nobody. Closing it here runs its cleanup, which aborts the request.
    """

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            # No caching, and no buffering in nginx-style proxies: events must flow.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except asyncio.CancelledError:
            # Starlette cancels the stream when its client disconnects: one line, no trace.
            logger.info("a client went away during its stream")
            raise
        finally:
            await self._events.aclose()
