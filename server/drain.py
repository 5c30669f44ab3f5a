"""Graceful drain: on SIGTERM a server stops taking work, finishes what it has, and exits.

From the first SIGTERM (or SIGINT) on, ``/ready`` answers 503 so that load balancers move
away (``/health``, liveness, says ``draining`` with a 200), and every new request gets a 503
with an OpenAI error body (``server_draining``) and ``Connection: close``, which a load
balancer retries on another server. Requests already running, streams included, go on until
they end or ``--drain-timeout`` passes. Then what still runs is cut the way a client can
read: a stream ends with an error event (``server_draining``) and ``[DONE]``, a request not
yet answered gets a 503 with that error; once they are written (or after a few seconds more)
uvicorn shuts down. A second signal stops at once. ``/metrics`` answers throughout.

uvicorn's own handling would stop listening at the first signal and exit with the signal
(it re-raises it): ``DrainingServer`` replaces that handler and exits with status 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError

logger = logging.getLogger(__name__)

# Answered while draining, and not counted as work to wait for.
_ALWAYS_OPEN = frozenset({"/metrics", "/health", "/ready"})
# Seconds the cut requests get to write their last event before uvicorn closes their
# connections anyway (a client that does not read).
_CUT_GRACE_S = 5.0


class DrainTimedOut(Exception):
    """A request still running when the drain timeout passed: its answer ends with this."""


class Drain:
    """Whether this server is draining, and how many requests it still serves. ``cut``
    ends every request in flight with the error it is given (``EnginePool.fail_requests``)."""

    def __init__(self, timeout_s: float, cut: Callable[[Exception], None]) -> None:
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.deadline: float | None = None
        self._cut = cut
        self._cut_at: float | None = None

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
        now = time.monotonic()
        if now < self.deadline:
            return False
        if self._cut_at is None:
            logger.warning(
                "drain timeout: ending the %d requests still in flight with server_draining",
                self.in_flight,
            )
            self._cut_at = now
            self._cut(
                DrainTimedOut(
                    f"This server shut down before the answer was complete (--drain-timeout "
                    f"{self.timeout_s:g} s); send the request again."
                )
            )
            return False
        if now - self._cut_at < _CUT_GRACE_S:
            return False
        logger.warning("%d requests did not end when cut: closing them", self.in_flight)
        return True


class DrainGate:
    """ASGI middleware: counts the requests in flight, and refuses new ones while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in _ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = ApiError(
                503,
                "This server is shutting down; send the request to another server.",
                code="server_draining",
            )
            headers = {"Connection": "close", "Retry-After": "1"}
            await JSONResponse(error.body(), status_code=503, headers=headers)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


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
