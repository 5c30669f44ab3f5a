"""GET /version: the server's package version, as vLLM answers it."""

from __future__ import annotations

from importlib.metadata import version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def server_version(request: Request) -> Response:
    return JSONResponse({"version": version("tandem")})
