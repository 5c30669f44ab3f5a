"""Timeouts and limits on every HTTP connection, as nginx or envoy set them.

uvicorn closes a keep-alive connection idle between two requests (``--keep-alive-timeout``)
and nothing else: a client that opens a connection and sends nothing, or sends its headers
or its body a byte a second (slowloris), holds a file descriptor and a parser for ever.
``GuardedHttpToolsProtocol`` is uvicorn's httptools protocol with the rest:

- ``--header-timeout``: a request's headers must be complete this long after the connection
  opened (or, on a keep-alive connection, after the request's first byte); else the
  connection gets a 408 and is closed (nginx's client_header_timeout, envoy's
  request_headers_timeout);
- ``--body-timeout``: a body still arriving must not pause longer than this between two
  reads (nginx's client_body_timeout) and, from that long after its headers, must have come
  at ``--min-body-rate`` bytes a second at least on average; else a 408 and the connection
  closed (the request's handler sees the client go away);
- ``--max-connections``: past this many open connections, a new one is answered 503 and
  closed at once (nginx's limit_conn), so that no flood of connections takes all the
  process's file descriptors;
- ``--send-timeout``: a response (a stream above all) whose client reads nothing of it for
  this long, its send buffer full, is cut (nginx's send_timeout): the connection is aborted,
  so the handler sees its client go away and the engine drops the request. uvicorn's send
  waits on a full buffer for ever, and while it waits the request's outputs pile up.

A body's time does not run while the server itself has paused reading it (uvicorn's flow
control, when the handler has not yet read what came). The timers are the event loop's,
one per connection; nothing here runs per byte but a counter.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.errors import ApiError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """The options of ``python -m server`` that bound each connection (module docstring)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    min_body_rate: float = 1024.0  # bytes per second
    keep_alive_timeout_s: float = 15.0
    max_connections: int = 2048
    send_timeout_s: float = 60.0


def _raw_response(status: int, reason: str, error: ApiError) -> bytes:
    """A whole HTTP response with ``error``'s OpenAI body, closing the connection: written
    straight to the socket, outside any request (there may be none yet)."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_TIMED_OUT = _raw_response(
    408,
    "Request Timeout",
    ApiError(408, "The request was not sent in time.", code="request_timeout"),
)
_TOO_MANY_CONNECTIONS = _raw_response(
    503,
    "Service Unavailable",
    ApiError(
        503,
        "This server has as many connections open as it takes (--max-connections); "
        "try again, or another server.",
        code="too_many_connections",
    ),
)


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits``' header and body timeouts and its cap on
    connections (``--keep-alive-timeout`` is uvicorn's own ``timeout_keep_alive``)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        # The header deadline, or the body's next check: at most one at a time.
        self._watch: asyncio.TimerHandle | None = None
        self._body_started = 0.0  # loop time the body's headers were complete
        self._body_bytes = 0
        self._last_read = 0.0
        self._send_watch: asyncio.TimerHandle | None = None  # while writing is paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning(
                "refused a connection: %d open (--max-connections)", len(self.connections) - 1
            )
            transport.write(_TOO_MANY_CONNECTIONS)
            transport.close()
            return
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        self._unwatch_send()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The send buffer is full: the client must read some within --send-timeout."""
        super().pause_writing()
        self._unwatch_send()
        self._send_watch = self.loop.call_later(self.limits.send_timeout_s, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch_send()

    def _unwatch_send(self) -> None:
        _cancel(self._send_watch)
        self._send_watch = None

    def _send_stalled(self) -> None:
        self._send_watch = None
        logger.info(
            "closed a connection whose client read nothing of its response for %g s (%s)",
            self.limits.send_timeout_s,
            self.client,
        )
        # Aborted, not closed: a close would keep the unread bytes and wait for the client.
        self.transport.abort()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._watch is None:  # a keep-alive connection's next request
            self._watch_headers()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._unwatch()
        now = self.loop.time()
        self._body_started = self._last_read = now
        self._body_bytes = 0
        self._watch = self.loop.call_later(self._body_check_interval, self._check_body)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_bytes += len(body)
        self._last_read = self.loop.time()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._unwatch()

    @property
    def _body_check_interval(self) -> float:
        return min(1.0, self.limits.body_timeout_s)

    def _watch_headers(self) -> None:
        self._watch = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _unwatch(self) -> None:
        _cancel(self._watch)
        self._watch = None

    def _headers_too_slow(self) -> None:
        self._watch = None
        logger.debug("closed a connection whose headers did not come in time (%s)", self.client)
        self._cut()

    def _check_body(self) -> None:
        now = self.loop.time()
        if self.flow.read_paused:  # the server is not reading: not the client's time
            self._last_read = now
        limits = self.limits
        elapsed = now - self._body_started
        if now - self._last_read > limits.body_timeout_s:
            why = f"nothing for {limits.body_timeout_s:g} s"
        elif (
            elapsed >= limits.body_timeout_s
            and not self.flow.read_paused
            and self._body_bytes < limits.min_body_rate * elapsed
        ):
            why = f"{self._body_bytes / elapsed:.0f} bytes/s"
        else:
            self._watch = self.loop.call_later(self._body_check_interval, self._check_body)
            return
        self._watch = None
        logger.info("closed a connection whose request body came too slowly: %s", why)
        self._cut()

    def _cut(self) -> None:
        """A 408 unless a response has started, then the connection closed; the request's
        handler, if any, sees its client go away."""
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(_TIMED_OUT)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
