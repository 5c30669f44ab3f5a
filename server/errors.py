"""OpenAI-style errors: every failure, whatever raised it, answers with the same body.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` is what
OpenAI's clients parse, so 404s from the router and 500s from bugs use it too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

# The status nginx logs for a client that went away before the answer (never sent).
CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """A request that fails with an HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # sent with the error's response (Retry-After)
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.status, headers={**self.headers, **(headers or {})}
        )


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.")


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    # The router's own errors: unknown routes (404) and wrong methods (405).
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    else:
        message = exc.detail or HTTPStatus(exc.status_code).phrase
    error = ApiError(exc.status_code, message, code=HTTPStatus(exc.status_code).name.lower())
    return error.response(headers=exc.headers)


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    # A client that went away while its request was read (or one cut for sending it too
    # slowly: server/connection_limits.py): nothing failed here, and nobody reads an answer.
    assert isinstance(exc, ClientDisconnect)
    client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
    logger.info("%s went away before its request to %s was read", client, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # Starlette re-raises the exception after this response is sent, so uvicorn logs
    # its traceback; this log line adds which request it was.
    logger.error("%s %s failed: %r", request.method, request.url.path, exc)
    return internal_error().response()
