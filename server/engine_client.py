"""The server's one connection to the engine: a ZeroMQ DEALER socket speaking the protocol.

Every frame is received as it comes, in the event loop's thread (server/engine_socket.py),
and each request's outputs go to that request's mailbox, so any number of HTTP requests share
the socket without locks. A background task watches the connection: on every (re)connection
it performs the handshake (a restarted engine knows nothing of this server), and on
disconnection it fails the requests in flight at once instead of letting them wait forever.

The engine sends its stats every second unasked (its heartbeat); the last ones, and when
the engine was last heard from, say whether it is alive without asking it (/health,
/ready), since an answer to a question would wait behind the engine's current step. Each
stats received is answered with the bytes read so far (a ReadReceipt): the engine drops a
server that has more than ``--max-unread-output-bytes`` of its output unread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    Embedding,
    EmbedRequest,
    EngineStats,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    Message,
    ProtocolError,
    ReadReceipt,
    RequestOutput,
    SamplingParams,
    Scheduling,
    StatsRequest,
    TokenOutputs,
    build_codecs,
    decode_message,
)
from protocol.curve import make_curve_client
from server.engine_socket import EngineSocket
from server.output_mailbox import OutputMailbox

logger = logging.getLogger(__name__)

# Milliseconds that close() may spend delivering queued messages (aborts, mostly);
# the engine also drops the requests of a server that went away, so after that we
# give up rather than hang the shutdown.
_LINGER_MS = 500
# ZMTP heartbeats notice an engine host that vanished without closing its connection.
_HEARTBEAT_IVL_MS = 2_000
_HEARTBEAT_TIMEOUT_MS = 10_000
# How often connect() says it is still waiting for the engine to answer.
_WAITING_LOG_INTERVAL_S = 15.0
# An engine not heard from for this long (it sends a heartbeat every second, between two
# steps) counts as not alive: stuck in a step, or its host gone without a word.
ENGINE_SILENCE_S = 30.0


class EngineUnavailable(Exception):
    """The engine is not connected, or the connection was lost during the request."""


class EngineRequestError(Exception):
    """The engine refused a request (an ErrorReply for it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class HandshakeError(Exception):
    """The engine cannot be served: incompatible, or not answering in time."""


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """This server's key pair (a .key_secret file) and the engine's public key (.key)."""

    secret_key_file: str
    engine_public_key_file: str


class EngineClient:
    """Sends requests to the engine and hands each request its outputs."""

    def __init__(
        self, address: str, client_name: str = "tandem-server", curve: CurveKeys | None = None
    ) -> None:
        self.address = address
        self._client_name = client_name
        build_codecs()  # not on the first request's way to its first token
        self._context = zmq.asyncio.Context()
        # A plain socket, read and written by EngineSocket; its monitor, made by the asyncio
        # context, is an asyncio socket (a few events in its whole life).
        self._socket: zmq.Socket = self._context.socket(zmq.DEALER, socket_class=zmq.Socket)
        self._engine_socket = EngineSocket(self._socket, self._on_frame)
        if curve is not None:
            make_curve_client(self._socket, curve.secret_key_file, curve.engine_public_key_file)
        self._socket.setsockopt(zmq.LINGER, _LINGER_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self._mailboxes: dict[str, OutputMailbox] = {}
        self._embeddings: dict[str, asyncio.Future[Embedding]] = {}  # by request id
        self._stats_waiters: list[asyncio.Future[EngineStats | None]] = []
        self._handshake: asyncio.Future[HandshakeReply] | None = None
        self._ready = False  # handshaken with the engine at the other end right now
        self._refused = False  # the engine refused the connection (CURVE), and we said so
        # The engine's last stats (its heartbeat, or an answer), and when it was last heard
        # from (time.monotonic()): any frame counts.
        self.last_stats: EngineStats | None = None
        self.last_heard = 0.0
        # Bytes of the engine's frames read since its last HandshakeReply (not counted), what a
        # ReadReceipt says.
        self._bytes_read = 0
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def ready(self) -> bool:
        """Handshaken with the engine at the other end now: requests can be sent."""
        return self._ready

    @property
    def queue_full(self) -> bool:
        """The engine's last stats said a new request would be refused (it sends them at once
        whenever that changes)."""
        return self.last_stats is not None and self.last_stats.queue_full

    @property
    def alive(self) -> bool:
        """Ready, and the engine was heard from within ``ENGINE_SILENCE_S``."""
        return self._ready and time.monotonic() - self.last_heard < ENGINE_SILENCE_S

    async def connect(self, timeout: float) -> HandshakeReply:
        """Connects and handshakes; waits up to ``timeout`` s for the engine to answer.

        The engine may still be loading its weights, and ZeroMQ keeps retrying the
        connection by itself, so this only waits. Raises ``HandshakeError``.
        """
        self._handshake = asyncio.get_running_loop().create_future()
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._engine_socket.start()
        self._tasks = [
            asyncio.create_task(self._monitor_loop(self._monitor), name="engine-monitor"),
        ]
        self._socket.connect(self.address)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeError(
                    f"the engine at {self.address} did not answer within {timeout:g} s"
                )
            try:
                wait = min(left, _WAITING_LOG_INTERVAL_S)
                return await asyncio.wait_for(asyncio.shield(self._handshake), wait)
            except TimeoutError:
                if time.monotonic() < deadline:
                    logger.info("still waiting for the engine at %s", self.address)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._engine_socket.stop()
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close()
        self._context.term()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        scheduling: Scheduling,
        merge_outputs: bool = False,
        observe: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs until the one with a finish reason; with
        ``merge_outputs``, those that arrived while the caller was busy come as one
        (``server/output_mailbox.py``), and ``observe`` sees each as it arrives.

        Closing the iterator early (a client went away, a stop string was found)
        aborts the request in the engine, so its cache is freed at once. Raises
        ``EngineRequestError`` if the engine refuses it and ``EngineUnavailable``
        if there is no engine.
        """
        if not self._ready:
            raise EngineUnavailable(f"the engine at {self.address} is not connected")
        if request_id in self._mailboxes:
            raise ValueError(f"request id {request_id!r} is already in use")
        mailbox = OutputMailbox(merge_outputs, observe)
        self._mailboxes[request_id] = mailbox
        finished = False
        try:
            self._send(GenerateRequest(request_id, prompt_token_ids, sampling, scheduling))
            while not finished:
                item = await mailbox.get()
                if isinstance(item, Exception):
                    # The engine's errors mean it has dropped the request; one of this
                    # server's (fail_requests) leaves it to abort below.
                    finished = isinstance(item, (EngineRequestError, EngineUnavailable))
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            del self._mailboxes[request_id]
            if not finished:
                # No await here: this runs when the consumer is cancelled too.
                self.abort(request_id)

    def fail_requests(self, error: Exception) -> None:
        """Ends every request in flight with ``error`` (raised where each reads its outputs);
        each then aborts itself in the engine."""
        for mailbox in self._mailboxes.values():
            mailbox.put(error)

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        """The prompt's embedding (an ``EmbedRequest``). Cancelling the wait aborts it in the
        engine. Raises as ``generate`` does."""
        if not self._ready:
            raise EngineUnavailable(f"the engine at {self.address} is not connected")
        if request_id in self._mailboxes or request_id in self._embeddings:
            raise ValueError(f"request id {request_id!r} is already in use")
        answer: asyncio.Future[Embedding] = asyncio.get_running_loop().create_future()
        self._embeddings[request_id] = answer
        try:
            self._send(EmbedRequest(request_id, prompt_token_ids))
            return await answer
        finally:
            del self._embeddings[request_id]
            if answer.cancelled():  # the caller gave up waiting
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the engine to drop the request now (unknown ids are ignored there)."""
        if self._ready:
            self._send(AbortRequest(request_id))

    async def stats(self, timeout: float) -> EngineStats | None:
        """The engine's current stats, or None if it does not answer within ``timeout`` s."""
        if not self._ready:
            return None
        # Replies carry no id, so any reply answers every caller waiting at that
        # moment; each caller sends its own request so a lost one delays nobody else.
        waiter: asyncio.Future[EngineStats | None] = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        try:
            self._send(StatsRequest())
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return None
        finally:
            with contextlib.suppress(ValueError):  # already answered and removed
                self._stats_waiters.remove(waiter)

    def _send(self, message: Message) -> None:
        # Sent at once unless the high-water mark is reached (the engine has stopped
        # reading); then later, in order. Either way nobody waits, which lets abort() run
        # inside a cancelled task.
        self._engine_socket.send(message.encode())

    def _on_frame(self, frame: bytes) -> None:
        self.last_heard = time.monotonic()
        self._bytes_read += len(frame)  # a malformed one too: the engine counts what it sends
        try:
            message = decode_message(frame)
        except ProtocolError as exc:
            logger.error("dropped a malformed frame from the engine: %s", exc)
            return
        try:
            self._dispatch(message)
        except Exception:
            # A bug in handling one message must not stop all future deliveries.
            logger.exception("failed to handle %s from the engine", type(message).__name__)

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, TokenOutputs):
            for output in message.outputs:
                mailbox = self._mailboxes.get(output.request_id)
                # None: the request was aborted here while these tokens were on the way.
                if mailbox is not None:
                    mailbox.put(output)
        elif isinstance(message, Embedding):
            answer = self._embeddings.get(message.request_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, ErrorReply):
            self._on_error(message)
        elif isinstance(message, EngineStats):
            if self._ready:
                self._send(ReadReceipt(self._bytes_read))
            self.last_stats = message
            for waiter in self._stats_waiters:
                if not waiter.done():
                    waiter.set_result(message)
            self._stats_waiters.clear()
        elif isinstance(message, HandshakeReply):
            self._on_handshake_reply(message)
        else:
            logger.error("unexpected %s from the engine", type(message).__name__)

    def _on_error(self, reply: ErrorReply) -> None:
        if reply.code == ErrorCode.NOT_READY and self._ready:
            # The engine has forgotten this server (it drops servers that stop
            # reading), and with it every request of ours: fail them, then handshake
            # again so that new requests work.
            self._lose_engine(f"the engine dropped this server: {reply.message}")
            # What was read first: dropped for its output unread, this server would be dropped
            # again at the handshake's reply until the engine heard it has read it.
            self._send(ReadReceipt(self._bytes_read))
            self._send(HandshakeRequest(PROTOCOL_VERSION, self._client_name))
            return
        mailbox = self._mailboxes.get(reply.request_id)
        if mailbox is not None:
            mailbox.put(EngineRequestError(reply.code, reply.message))
            return
        answer = self._embeddings.get(reply.request_id)
        if answer is not None:
            if not answer.done():
                answer.set_exception(EngineRequestError(reply.code, reply.message))
            return
        if reply.request_id:
            logger.debug("error for finished request %s: %s", reply.request_id, reply.message)
            return
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_exception(
                HandshakeError(f"the engine refused the handshake: {reply.message}")
            )
        else:
            logger.error("the engine refused a message: %s: %s", reply.code, reply.message)

    def _on_handshake_reply(self, reply: HandshakeReply) -> None:
        assert self._handshake is not None  # replies only come after connect()
        self._bytes_read = 0  # the engine counts its bytes sent from each reply on too
        if reply.protocol_version != PROTOCOL_VERSION:
            problem = (
                f"the engine speaks protocol version {reply.protocol_version}, "
                f"this server {PROTOCOL_VERSION}"
            )
            if self._handshake.done():
                logger.error(problem)
            else:
                self._handshake.set_exception(HandshakeError(problem))
            return
        if not self._handshake.done():
            self._handshake.set_result(reply)
        elif model_differences(self._handshake.result(), reply):
            # Everything this server knows (tokenizer, template, limits) came from
            # the first handshake; serving another model with it would be wrong.
            logger.error(
                "the engine was restarted with a different model (%s); "
                "restart this server to serve it",
                reply.model_name,
            )
            return
        logger.info("handshake with the engine (pid %d) done", reply.engine_pid)
        self._ready = True
        self._send(StatsRequest())  # its stats now, not at its next heartbeat

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = await recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = False
                logger.info("connected to the engine at %s", self.address)
                self._send(HandshakeRequest(PROTOCOL_VERSION, self._client_name))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._lose_engine(f"lost the connection to the engine at {self.address}")
            elif not self._refused:  # a failed handshake; ZeroMQ tries again (said once)
                self._refused = True
                logger.error(
                    "the engine at %s refused the connection (%s): check the CURVE keys "
                    "(--curve-secret-key, --engine-public-key) and the engine's authorized keys",
                    self.address,
                    "not authorized"
                    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    else f"protocol error {event['value']:#x}",
                )

    def _lose_engine(self, reason: str) -> None:
        """Fails everything waiting on the engine; new requests wait for a handshake."""
        if self._ready:
            logger.error(reason)
        self._ready = False
        self.last_stats = None  # an engine that comes back sends its own
        for mailbox in self._mailboxes.values():
            mailbox.put(EngineUnavailable(reason))
        for answer in self._embeddings.values():
            if not answer.done():
                answer.set_exception(EngineUnavailable(reason))
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._stats_waiters.clear()


def model_differences(first: HandshakeReply, second: HandshakeReply) -> list[str]:
    """The handshake fields in which two engines' models differ (their process, and what
    each admits at once, aside)."""
    process = {"engine_pid", "engine_started_at", "max_requests_at_once"}
    return [
        field.name
        for field in dataclasses.fields(HandshakeReply)
        if field.name not in process and getattr(first, field.name) != getattr(second, field.name)
    ]
