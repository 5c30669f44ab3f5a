"""The engine's socket: a ZeroMQ ROUTER that feeds LLMEngine and routes tokens back.

One thread: drain every waiting message, run one engine step, send each server its
step's outputs, repeat. Sends never block: a server that went away (or stopped
reading) is forgotten and its requests are aborted, so one bad peer cannot stall
the others. A server counts as having stopped reading once the output sent to it and not yet
read (it says what it has read at each heartbeat: ``ReadReceipt``) would pass
``--max-unread-output-bytes``: ZeroMQ's own bound on what is queued for a peer counts frames,
and one frame may hold megabytes.

Admission control: past ``--max-queued-requests`` requests waiting for a place in the batch,
or ``--max-queued-prompt-tokens`` prompt tokens left to compute, a new request is refused at
once (``overloaded``; the servers answer HTTP 429), so that the requests admitted keep their
latency; so is one whose structured output would start a grammar compile past
``--max-compiling-grammars`` (engine/service/admission.py). Every second the engine
sends each server its stats unasked, between two steps: its heartbeat, from which the servers'
/health and /ready say whether it is alive without asking (an answer would wait behind the
step); and it sends them at once whenever its queue fills or frees, from which the servers
refuse by themselves while it is full.

Stopping (SIGTERM) drains: new requests are refused (``shutting_down``), those in flight
run on for up to ``--drain-timeout`` seconds, and the rest end with finish reason
``abort`` before the socket closes. A second signal stops at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.config import ServiceConfig
from engine.llm_engine import LLMEngine, RequestRejected
from engine.service.admission import Admission
from engine.service.curve_auth import CurveGuard
from engine.service.throughput_log import ThroughputLog
from protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AbortRequest,
    EmbedRequest,
    EngineStats,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    HandshakeRequest,
    Message,
    ProtocolError,
    ReadReceipt,
    RequestOutput,
    StatsRequest,
    TokenOutputs,
    build_codecs,
    decode_message,
    quoted,
)

logger = logging.getLogger(__name__)

# Messages queued for one server before it counts as stuck and is dropped: a backstop behind
# --max-unread-output-bytes, for a peer whose receipts claim reads it never made, and for
# the error replies to peers that never handshook (no receipts). Generous: a busy server reads
# thousands of messages a second.
_SEND_HIGH_WATER_MARK = 100_000
_IDLE_POLL_MS = 100
# While requests wait only for their grammars to compile: how often to look at them.
_COMPILING_POLL_MS = 2
# Milliseconds that closing the socket may spend delivering the last outputs (the aborts).
_CLOSE_LINGER_MS = 2_000
# Seconds between two heartbeats (EngineStats sent to every server unasked).
HEARTBEAT_INTERVAL_S = 1.0


@dataclasses.dataclass
class _OutputBytes:
    """The bytes of the frames sent to one server, and of those how many it has read, as its
    last ReadReceipt said."""

    sent: int = 0
    read: int = 0
    # ``sent`` once its last HandshakeReply went out: its receipts count the bytes since.
    at_handshake: int = 0


class EngineService:
    def __init__(self, engine: LLMEngine, config: ServiceConfig) -> None:
        self.engine = engine
        build_codecs()  # not on the first request's way to its first token
        self.throughput_log = ThroughputLog(engine, config.stats_interval)
        self.drain_timeout_s = config.drain_timeout
        self.max_unread_output_bytes = config.max_unread_output_bytes
        self.admission = Admission(
            engine,
            config.max_queued_requests,
            config.max_queued_prompt_tokens,
            config.max_compiling_grammars,
        )
        self.next_heartbeat = time.monotonic()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        # Sending to a vanished peer raises EHOSTUNREACH instead of dropping silently:
        # that is how the engine learns a server died.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames drop the peer
        self.socket.setsockopt(zmq.LINGER, 0)
        self.curve: CurveGuard | None = None
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        if config.curve_secret_key is not None and config.curve_authorized_keys is not None:
            self.curve = CurveGuard(
                self.context, self.socket, config.curve_secret_key, config.curve_authorized_keys
            )
            events |= CurveGuard.HANDSHAKE_FAILURES
        # The socket's one monitor (libzmq allows one): connections counted (a ROUTER does not
        # say which peer left, so servers are counted, not named: the live panel's "connected
        # servers"), and refused CURVE handshakes logged.
        self.monitor = self.socket.get_monitor_socket(events)
        self.num_connections = 0
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.socket.bind(config.address)
        self.address = config.address
        self.handshaken: set[bytes] = set()
        # Every server handshaken, until a send finds it gone: kept after it is dropped, so
        # that a handshake again does not start the count of a peer that reads nothing afresh
        # (one dropped and then gone leaves its three integers here).
        self.output_bytes: dict[bytes, _OutputBytes] = {}
        # Set by the first stop signal: new requests are refused from then on.
        self.drain_deadline: float | None = None
        self.stop_now = False  # a second signal: abort what runs and exit

    def request_stop(self) -> None:
        """The first call starts draining, the second stops at once (signal handlers)."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            logger.info(
                "stopping: refusing new requests, draining %d for up to %g s",
                len(self.engine.requests),
                self.drain_timeout_s,
            )
        else:
            self.stop_now = True

    def _drained(self) -> bool:
        if self.drain_deadline is None:
            return False
        return self.stop_now or not self.engine.has_work or time.monotonic() >= self.drain_deadline

    def serve_forever(self) -> None:
        secured = "CURVE" if self.curve is not None else "no CURVE"
        logger.info("engine ready at %s (%s)", self.address, secured)
        try:
            while not self._drained():
                if not self.engine.has_work:
                    timeout = _IDLE_POLL_MS
                elif self.engine.only_compiling:
                    timeout = _COMPILING_POLL_MS
                else:
                    timeout = 0
                ready = dict(self.poller.poll(timeout))
                if self.monitor in ready:
                    self._read_socket_events()
                if self.socket in ready:
                    self._drain_inbox()
                    self._announce_admission()
                if self.engine.has_work:
                    self._send_outputs(self.engine.step())
                    for client, embedding in self.engine.pool():
                        self._send(client, embedding)
                    for client, error in self.engine.take_errors():
                        self._send(client, error)
                    self._announce_admission()
                self._maybe_send_heartbeat()
                self.throughput_log.maybe_log()
            aborted = self.engine.abort_all()
            if aborted:
                logger.warning("aborted %d requests still running at shutdown", len(aborted))
            self._send_outputs(aborted)
            for client, request_id in self.engine.pooler.abort_all():
                self._send(client, ErrorReply(request_id, ErrorCode.SHUTTING_DOWN, "stopped"))
        finally:
            self.socket.disable_monitor()
            self.monitor.close()
            if self.curve is not None:
                self.curve.close()
            self.socket.close(linger=_CLOSE_LINGER_MS)
            self.context.term()

    def _read_socket_events(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.num_connections += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_connections -= 1
            elif self.curve is not None:
                self.curve.log_failed_handshake(event)

    def _drain_inbox(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames (expected 1)", len(frames) - 1)
                continue
            client, payload = frames
            try:
                message = decode_message(payload)
            except ProtocolError as exc:
                logger.warning("dropped a malformed message from %s: %s", client.hex(), exc)
                continue
            try:
                self._handle(client, message)
            except Exception:
                # A message the codec took that still broke its handling: a check missing
                # somewhere, which must cost that message alone, never the engine and every
                # request it holds.
                logger.exception(
                    "dropped a %s from %s: its handling failed", message.TYPE, client.hex()
                )
                request_id = getattr(message, "request_id", None)
                if isinstance(request_id, str):
                    reason = "the engine could not take this request"
                    self._send(client, ErrorReply(request_id, ErrorCode.INVALID_REQUEST, reason))

    def _handle(self, client: bytes, message: Message) -> None:
        match message:
            case HandshakeRequest(protocol_version=version, client_name=name):
                if version != PROTOCOL_VERSION:
                    self._send(
                        client,
                        ErrorReply(
                            "",
                            ErrorCode.PROTOCOL_VERSION,
                            f"engine speaks protocol {PROTOCOL_VERSION}, server {version}",
                        ),
                    )
                    return
                logger.info("server %s connected (%s)", quoted(name), client.hex())
                self.handshaken.add(client)
                output_bytes = self.output_bytes.setdefault(client, _OutputBytes())
                reply = dataclasses.replace(
                    self.engine.handshake_reply(),
                    max_requests_at_once=self.admission.max_requests_at_once,
                )
                self._send(client, reply)
                if client in self.handshaken:  # the reply went out (within the bound)
                    output_bytes.at_handshake = output_bytes.sent
            case ReadReceipt(bytes_read=bytes_read):
                output_bytes = self.output_bytes.get(client)
                if output_bytes is not None:
                    # Never past what was sent: a count beyond it must not buy a peer room.
                    read = output_bytes.at_handshake + bytes_read
                    output_bytes.read = min(read, output_bytes.sent)
            case GenerateRequest() | EmbedRequest():
                self._add(client, message)
            case AbortRequest(request_id=request_id):
                output = self.engine.abort(client, request_id)
                if output is not None:
                    self._send(client, TokenOutputs([output]))
            case StatsRequest():
                self._send(client, self._stats())
            case _:
                logger.warning("dropped a %s: not a message for the engine", message.TYPE)

    def _stats(self) -> EngineStats:
        return dataclasses.replace(
            self.engine.stats(),
            num_connected_servers=self.num_connections,
            queue_full=self.admission.full,
        )

    def _maybe_send_heartbeat(self) -> None:
        now = time.monotonic()
        if now < self.next_heartbeat or not self.handshaken:
            return
        self.next_heartbeat = now + HEARTBEAT_INTERVAL_S
        self._send_stats_to_all()

    def _announce_admission(self) -> None:
        """The stats to every server now if the queue filled or freed since they were told."""
        if self.admission.changed():
            self._send_stats_to_all()

    def _send_stats_to_all(self) -> None:
        stats = self._stats()
        for client in list(self.handshaken):  # a failed send forgets the client
            self._send(client, stats)

    def _add(self, client: bytes, request: GenerateRequest | EmbedRequest) -> None:
        if self.drain_deadline is not None:
            reply = ErrorReply(
                request.request_id, ErrorCode.SHUTTING_DOWN, "the engine is stopping"
            )
            self._send(client, reply)
            return
        if client not in self.handshaken:
            self._send(
                client,
                ErrorReply(request.request_id, ErrorCode.NOT_READY, "handshake first"),
            )
            return
        if isinstance(request, GenerateRequest):
            refusal = self.admission.refusal(
                len(request.prompt_token_ids), request.sampling.structured_output
            )
        else:
            refusal = self.admission.refusal()
        if refusal is not None:
            self._send(client, ErrorReply(request.request_id, ErrorCode.OVERLOADED, refusal))
            return
        try:
            if isinstance(request, EmbedRequest):
                self.engine.add_embed_request(client, request.request_id, request.prompt_token_ids)
            else:
                self.engine.add_request(
                    client,
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling,
                    request.scheduling,
                )
        except RequestRejected as exc:
            self._send(client, ErrorReply(request.request_id, exc.code, exc.message))

    def _send_outputs(self, outputs: list[tuple[bytes, RequestOutput]]) -> None:
        by_client: dict[bytes, list[RequestOutput]] = defaultdict(list)
        for client, output in outputs:
            by_client[client].append(output)
        for client, client_outputs in by_client.items():
            self._send(client, TokenOutputs(client_outputs))

    def _send(self, client: bytes, message: Message) -> None:
        frame = message.encode()
        output_bytes = self.output_bytes.get(client)
        if output_bytes is not None and client in self.handshaken:
            # The frame counts: what is queued for a server stays within the bound, and a frame
            # larger than the bound is never sent (it drops its server).
            unread = output_bytes.sent + len(frame) - output_bytes.read
            if unread > self.max_unread_output_bytes:
                self._drop_unread(client, unread)
                return
        try:
            self.socket.send_multipart([client, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Again: its queue is full (not reading). EHOSTUNREACH: it disconnected.
            if exc.errno == zmq.EHOSTUNREACH:
                self.output_bytes.pop(client, None)
            self._drop(client, str(exc))
            return
        if output_bytes is not None:
            output_bytes.sent += len(frame)

    def _drop_unread(self, client: bytes, unread: int) -> None:
        """Drop a server whose output unread would pass the bound, and tell it so."""
        bound = self.max_unread_output_bytes
        reason = (
            f"its output unread would reach {unread} bytes, past --max-unread-output-bytes {bound}"
        )
        self._drop(client, reason)
        # A few bytes past the bound: a server that reads again comes to this after the rest,
        # and fails its requests and handshakes again at once (it learns otherwise only from
        # a request it sends).
        self._send(client, ErrorReply("", ErrorCode.NOT_READY, reason))

    def _drop(self, client: bytes, reason: str) -> None:
        """Forget a server that stopped reading or went away, and abort its requests."""
        self.handshaken.discard(client)
        aborted = self.engine.abort_client(client)
        logger.warning(
            "server %s dropped (%s): aborted its %d requests", client.hex(), reason, aborted
        )
