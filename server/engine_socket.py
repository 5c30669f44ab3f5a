"""The engine's DEALER socket on the event loop, without a future for each frame.

The engine sends a server a frame every step. pyzmq's asyncio sockets make each ``recv`` a
future with its callbacks, ask the socket for its events several times around it (each answer
built into an enum) and schedule one more look a loop iteration later: per frame, more of a
server's CPU than decoding it. Here the socket is a plain one: one reader callback on its file
descriptor receives every frame waiting and hands each to ``on_frame`` at once, in the event
loop's thread. A send goes out at once too; past the high-water mark (the engine stopped
reading) sends wait, in order, until the socket takes them, and nobody awaits them.

ZeroMQ's descriptor is edge-triggered: it becomes readable when the socket's events change,
not while a frame waits, and a send may be what takes that change in. So after a send the
events are looked at again (in a callback of their own), and a callback that stops receiving
before the socket is empty (``_FRAMES_A_CALL``) schedules the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)

# Frames one callback receives at most before letting the event loop run what else is ready:
# an engine that sends faster than this server reads does not starve the HTTP connections.
_FRAMES_A_CALL = 64


class EngineSocket:
    """``socket`` (a plain, non-asyncio ZeroMQ socket) read and written from the running
    event loop between ``start`` and ``stop``: each frame received goes to ``on_frame``."""

    def __init__(self, socket: zmq.Socket, on_frame: Callable[[bytes], None]) -> None:
        self._socket = socket
        self._on_frame = on_frame
        self._unsent: deque[bytes] = deque()  # in order, past the high-water mark
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._scheduled = False  # a look at the socket's events is on the loop's ready list

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = self._socket.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._handle_events)
        self._schedule()  # frames that came before the reader was there

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None

    def send(self, frame: bytes) -> None:
        """Sends ``frame`` now, or once the socket takes it (after those waiting before it)."""
        self._unsent.append(frame)
        self._send_waiting()
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._handle_events)

    def _handle_events(self) -> None:
        self._scheduled = False
        if self._socket.closed:
            return
        for _ in range(_FRAMES_A_CALL):
            events = self._socket.getsockopt(zmq.EVENTS)
            if self._unsent and events & zmq.POLLOUT:
                self._send_waiting()
            if not events & zmq.POLLIN:
                return
            frame = self._socket.recv(zmq.NOBLOCK)
            try:
                self._on_frame(frame)
            except Exception:
                # A bug in handling one frame must not stop the ones after it.
                logger.exception("failed to handle a frame from the engine")
        self._schedule()

    def _send_waiting(self) -> None:
        while self._unsent:
            try:
                self._socket.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.error("failed to send to the engine: %s", exc)
            self._unsent.popleft()
