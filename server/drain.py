"""Graceful drain: on SIGTERM a server stops taking work, finishes what it has, and exits.

From the first SIGTERM (or SIGINT) on, ``/health`` answers 503 so that load balancers
move away, and every new request gets a 503 with an OpenAI error body
(``server_draining``) and ``Connection: close``, which a load balancer retries on
another server. Requests already running, streams included, go on until they end or
``--drain-timeout`` passes; then uvicorn shuts down (what still runs is cancelled, which
aborts it in the engine). A second signal stops at once. ``/metrics`` answers throughout.

uvicorn's own handling would stop listening at the first signal and exit with the signal
(it re-raises it): ``DrainingServer`` replaces that handler and exits with status 0.
"""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError

logger = logging.getLogger(__name__)

# Answered while draining, and not counted as work to wait for.
_ALWAYS_OPEN = "/metrics"
_HEALTH = "/health"


class Drain:
    """Whether this server is draining, and how many requests it still serves."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.deadline: float | None = None

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s
        logger.info(
            "draining: refusing new requests, waiting up to %g s for %d in flight",
            self.timeout_s,
            self.in_flight,
        )

    def done(self) -> bool:
        """Draining, and nothing left to wait for (or no more time to wait)."""
        if self.deadline is None:
            return False
        if self.in_flight == 0:
            return True
        if time.monotonic() >= self.deadline:
            logger.warning("drain timeout: %d requests still in flight are cut", self.in_flight)
            return True
        return False


class DrainGate:
    """ASGI middleware: counts the requests in flight, and refuses new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == _ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = ApiError(
                503,
                "This server is shutting down; send the request to another server.",
                code="server_draining",
            )
            body = error.body()
            if path == _HEALTH:
                body = {"status": "draining", **body}
            headers = {"Connection": "close", "Retry-After": "1"}
            await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
            return
        counted = path != _HEALTH
        self.drain.in_flight += counted
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= counted


class DrainingServer(uvicorn.Server):
    """uvicorn, with a stop signal that drains first (``Drain``) instead of stopping."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            logger.warning("second stop signal: stopping now")
            self.should_exit = self.force_exit = True
        else:
            self.drain.begin()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done():
            self.should_exit = True
        return await super().on_tick(counter)
