"""X-Request-Id: every response carries one, the client's own or a new one, as vLLM does.

A client's id also starts the id of its answer (``chatcmpl-<id>``, ``cmpl-<id>``,
``resp_<id>-<random>``, a stored response's key being unique), so that its logs and
ours name the same request. A pure ASGI middleware
around the whole application, so that streamed answers pass through untouched and
even the 500s of unexpected errors carry the header. ``client_address`` says who sent it.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HEADER = "x-request-id"
# The longest client id taken (a UUID is 36 characters): it names the request in every
# engine message and output frame and every streamed chunk, so an id of megabytes (a header
# has no body's size limit) would cost that much again each token, and past the engine's
# frame limit take the server's connection down with every request on it.
MAX_REQUEST_ID_CHARS = 128


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(_HEADER.encode())
        # A client's own id as it is, if short and printable; else a new one.
        taken = given is not None and 0 < len(given) <= MAX_REQUEST_ID_CHARS
        if taken and given.isascii() and given.decode("ascii").isprintable():
            request_id = given.decode("ascii")
        else:
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request) -> str:
    """The request's id: its X-Request-Id header's, or the one made for it."""
    return request.state.request_id


def client_address(request: Request) -> str:
    """The address the request came from (the user it counts for when its body names none:
    engine/scheduling/waiting_queue.py); empty if unknown."""
    return request.client.host if request.client is not None else ""
