"""``--max-request-bytes``: a larger request body is refused with 413, never read whole.

A declared Content-Length over the limit is refused before any of the body is read; a
chunked upload is counted as it arrives and refused at the first byte past the limit. Either
way the 413 says ``Connection: close`` and the connection closes once it is sent, so that the
rest of the upload is never read. A
pure ASGI middleware inside Starlette's, so that the 413 raised from ``receive`` reaches
the OpenAI error handler like any other ApiError.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import ApiError

# Headroom over the largest context: the JSON around it, a long system prompt's escapes,
# tools and schemas.
_HEADROOM_BYTES = 4 * 1024 * 1024
# Bytes of JSON that one token of context can take at most, with margin: a token's text
# is a few characters, each at most six bytes escaped (\uXXXX); as an id, up to 7 bytes.
_BYTES_PER_TOKEN = 32


def default_max_request_bytes(max_model_len: int) -> int:
    """A few MB above the largest context one request can carry (a prompt of
    ``max_model_len`` tokens, as text or ids)."""
    return _HEADROOM_BYTES + _BYTES_PER_TOKEN * max_model_len


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        # Only ``receive`` is wrapped: a wrapper of ``send`` would be one more call on every
        # chunk of every streamed answer.
        await self.app(scope, counted_receive, send)

    def _too_large(self) -> ApiError:
        # Connection: close, so that uvicorn closes the connection once the 413 is sent
        # instead of reading (and throwing away) the rest of the upload to keep it alive.
        return ApiError(
            413,
            f"The request body is larger than this server takes ({self.max_bytes} bytes; "
            "--max-request-bytes).",
            code="request_too_large",
            headers={"Connection": "close"},
        )
