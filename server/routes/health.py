"""GET /health, /ready and /metrics: whether this server and its engine replicas are alive,
whether it takes requests, and their state for monitoring.

/health and /ready answer from this server's own state, never by asking the engine (an
answer would wait behind the engine's current step, which under load takes a while): each
replica is alive while its connection is handshaken and its heartbeat (the stats it sends
every second) keeps coming (server/engine_client.py). /metrics asks each replica fresh.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.drain import Drain
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.metrics import CONTENT_TYPE

# /metrics waits this long for the engines' stats before calling one unavailable.
_STATS_TIMEOUT_S = 2.0
_NOT_ANSWERING = ApiError(503, "The engine is not answering.", code="engine_unavailable")


class Health:
    def __init__(self, client: EnginePool, drain: Drain | None = None) -> None:
        self._client = client
        self._drain = drain

    def _replicas(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        replicas = []
        for replica in self._client.replicas:
            client = replica.client
            stats = client.last_stats
            replicas.append(
                {
                    "replica": replica.index,
                    "address": client.address,
                    "status": "ok" if client.alive else "unavailable",
                    "requests_in_flight": replica.in_flight,
                    "last_heard_s": round(now - client.last_heard, 3) if client.ready else None,
                    "engine": dataclasses.asdict(stats) if stats and client.alive else None,
                }
            )
        return replicas

    @property
    def _draining(self) -> bool:
        return self._drain is not None and self._drain.draining

    @property
    def _in_flight(self) -> int | None:
        """This server's requests in flight (None without a drain to count them)."""
        return self._drain.in_flight if self._drain is not None else None

    async def health(self, request: Request) -> Response:
        """Liveness: 200 while any replica is alive ("degraded" if some are not; "draining"
        while this server drains, which it survives), else 503. ``engine`` is the first
        alive replica's last stats; ``replicas`` has each one's state."""
        replicas = self._replicas()
        alive = [replica for replica in replicas if replica["status"] == "ok"]
        if not alive:
            error = _NOT_ANSWERING.body()
            return JSONResponse(
                {"status": "unavailable", **error, "replicas": replicas}, status_code=503
            )
        if self._draining:
            status = "draining"
        else:
            status = "ok" if len(alive) == len(replicas) else "degraded"
        return JSONResponse(
            {
                "status": status,
                "requests_in_flight": self._in_flight,
                "engine": alive[0]["engine"],
                "replicas": replicas,
            }
        )

    async def ready(self, request: Request) -> Response:
        """Readiness, for load balancers and the supervisor: 200 while any replica is alive
        and this server is not draining, else 503 with an OpenAI error body."""
        if self._draining:
            error = ApiError(503, "This server is draining.", code="server_draining")
        elif not any(replica.client.alive for replica in self._client.replicas):
            error = _NOT_ANSWERING
        else:
            return JSONResponse({"status": "ready", "requests_in_flight": self._in_flight})
        return JSONResponse({"status": "not_ready", **error.body()}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        return Response(self._client.metrics.render(stats), media_type=CONTENT_TYPE)
