"""An event stream's way out (server/sse.py): its start through the middleware, its events
straight to the server, and its generator closed however the stream ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.sse import EventStreamResponse, server_send

SCOPE: Scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


class Events:
    """A stream's generator: two events, then the engine's next output, which never comes;
    ``closed`` says whether its cleanup (which aborts the engine request) ran."""

    def __init__(self) -> None:
        self.closed = False

    async def generate(self) -> AsyncGenerator[str, None]:
        try:
            yield "data: 1\n\n"
            yield "data: 2\n\n"
            await asyncio.Event().wait()
            yield "data: never\n\n"
        finally:
            self.closed = True


class Client:
    """The server's side of one connection: what was sent, and the client going away
    (uvicorn's receive answers http.disconnect from then on)."""

    def __init__(self, send_blocks_after: int | None = None) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self._send_blocks_after = send_blocks_after  # sends, then a full send buffer

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if self._send_blocks_after is not None and len(self.sent) > self._send_blocks_after:
            await asyncio.Event().wait()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_events_go_straight_to_the_server_past_the_middleware() -> None:
    seen_by_middleware: list[str] = []

    def middleware(app: ASGIApp) -> ASGIApp:
        async def call(scope: Scope, receive: Receive, send: Send) -> None:
            async def wrapped(message: Message) -> None:
                seen_by_middleware.append(message["type"])
                if message["type"] == "http.response.start":
                    message["headers"] = [*message["headers"], (b"x-seen", b"1")]
                await send(message)

            await app(scope, receive, wrapped)

        return call

    async def finite() -> AsyncGenerator[str, None]:
        yield "data: 1\n\n"
        yield "data: é\n\n"

    async def run() -> Client:
        client = Client()
        app = server_send(middleware(EventStreamResponse(finite())))
        await app(dict(SCOPE), client.receive, client.send)
        return client

    client = asyncio.run(run())
    assert seen_by_middleware == ["http.response.start"]
    start = client.sent[0]
    assert (start["type"], start["status"]) == ("http.response.start", 200)
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-cache" and headers[b"x-seen"] == b"1"
    assert client.bodies() == [b"data: 1\n\n", "data: é\n\n".encode(), b""]
    assert [m.get("more_body") for m in client.sent[1:]] == [True, True, False]


@pytest.mark.parametrize("waiting_in", ["the generator", "a send"])
def test_a_client_going_away_closes_the_generator_in_one_line(
    waiting_in: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Gone while the generator waits for the engine, or while a send waits for the
    client to read (the generator then waits at its ``yield``): the stream ends without an
    error and the generator is closed."""
    events = Events()

    async def run() -> Client:
        client = Client(send_blocks_after=2 if waiting_in == "a send" else None)
        # Held, so that no garbage collection closes the generator in the response's place.
        response = EventStreamResponse(events.generate())
        stream = asyncio.create_task(response(dict(SCOPE), client.receive, client.send))
        while len(client.sent) < 3:
            await asyncio.sleep(0)
        client.gone.set()
        await asyncio.wait_for(stream, 5)
        assert events.closed
        assert stream.cancelling() == 0  # its own cancel taken back
        return client

    with caplog.at_level(logging.INFO, logger="server.sse"):
        client = asyncio.run(run())
    assert client.bodies() == [b"data: 1\n\n", b"data: 2\n\n"]
    assert [r.getMessage() for r in caplog.records] == ["a client went away during its stream"]
    assert all(r.exc_info is None for r in caplog.records)


def test_a_cancelled_stream_closes_its_generator_and_stays_cancelled() -> None:
    """Cancelled from outside (the server stopping), the stream is closed and the
    cancellation goes on up."""
    events = Events()

    async def run() -> None:
        client = Client(send_blocks_after=2)
        response = EventStreamResponse(events.generate())
        stream = asyncio.create_task(response(dict(SCOPE), client.receive, client.send))
        while len(client.sent) < 3:
            await asyncio.sleep(0)
        stream.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stream
        assert events.closed

    asyncio.run(run())
