"""GET /health and /metrics: whether the engine replicas answer, and their state for monitoring."""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine_pool import EnginePool
from server.errors import ApiError
from server.metrics import CONTENT_TYPE

# Both wait this long for the engines' stats before calling one unavailable.
_STATS_TIMEOUT_S = 2.0


class Health:
    def __init__(self, client: EnginePool) -> None:
        self._client = client

    async def health(self, request: Request) -> Response:
        """200 while any replica answers ("degraded" if some do not), else 503. ``engine`` is
        the first answering replica's stats; ``replicas`` has each one's."""
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        replicas: list[dict[str, Any]] = [
            {
                "replica": replica.index,
                "address": replica.client.address,
                "status": "unavailable" if replica_stats is None else "ok",
                "requests_in_flight": replica.in_flight,
                "engine": None if replica_stats is None else dataclasses.asdict(replica_stats),
            }
            for replica, replica_stats in zip(self._client.replicas, stats, strict=True)
        ]
        answering = [replica for replica in replicas if replica["engine"] is not None]
        if not answering:
            error = ApiError(503, "The engine is not answering.", code="engine_unavailable").body()
            return JSONResponse(
                {"status": "unavailable", **error, "replicas": replicas}, status_code=503
            )
        status = "ok" if len(answering) == len(replicas) else "degraded"
        return JSONResponse(
            {"status": status, "engine": answering[0]["engine"], "replicas": replicas}
        )

    async def metrics(self, request: Request) -> Response:
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        return Response(self._client.metrics.render(stats), media_type=CONTENT_TYPE)
