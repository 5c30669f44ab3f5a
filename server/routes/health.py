"""GET /health and /metrics: whether the engine answers, and its state for monitoring."""

from __future__ import annotations

import dataclasses

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine_client import EngineClient
from server.errors import ApiError
from server.metrics import CONTENT_TYPE

# Both wait this long for the engine's stats before calling it unavailable.
_STATS_TIMEOUT_S = 2.0


class Health:
    def __init__(self, client: EngineClient) -> None:
        self._client = client

    async def health(self, request: Request) -> Response:
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        if stats is None:
            error = ApiError(503, "The engine is not answering.", code="engine_unavailable").body()
            return JSONResponse({"status": "unavailable", **error}, status_code=503)
        return JSONResponse({"status": "ok", "engine": dataclasses.asdict(stats)})

    async def metrics(self, request: Request) -> Response:
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        return Response(self._client.metrics.render(stats), media_type=CONTENT_TYPE)
