"""``--api-key``: the API answers only requests that carry the key, as OpenAI's does.

A pure ASGI middleware, so streamed answers pass through untouched. The web UI's files
and /health stay open (the UI asks for the key in its settings and sends it itself).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # The scheme is case-insensitive (RFC 9110), as vLLM reads it. compare_digest: the
            # time taken says nothing about how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self._expected):
                error = ApiError(
                    401,
                    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
                await error.response(headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
