"""The engine's socket: a ZeroMQ ROUTER that feeds LLMEngine and routes tokens back.

One thread: drain every waiting message, run one engine step, send each server its
step's outputs, repeat. Sends never block: a server that went away (or stopped
reading) is forgotten and its requests are aborted, so one bad peer cannot stall
the others.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import defaultdict

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.llm_engine import LLMEngine, RequestRejected
from engine.throughput_log import ThroughputLog
from protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AbortRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    HandshakeRequest,
    Message,
    ProtocolError,
    RequestOutput,
    StatsRequest,
    TokenOutputs,
    decode_message,
)

logger = logging.getLogger(__name__)

# Messages queued for one server before it counts as stuck and is dropped. Generous:
# a busy server reads thousands of messages a second.
_SEND_HIGH_WATER_MARK = 100_000
_IDLE_POLL_MS = 100
# While requests wait only for their grammars to compile: how often to look at them.
_COMPILING_POLL_MS = 2


class EngineService:
    def __init__(self, engine: LLMEngine, address: str, stats_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.throughput_log = ThroughputLog(engine, stats_interval_s)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        # Sending to a vanished peer raises EHOSTUNREACH instead of dropping silently:
        # that is how the engine learns a server died.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, _SEND_HIGH_WATER_MARK)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # larger frames drop the peer
        self.socket.setsockopt(zmq.LINGER, 0)
        # The socket's connection events (libzmq's ROUTER does not say which peer left, so the
        # servers are counted, not named): the live panel's "connected servers".
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.num_connections = 0
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.socket.bind(address)
        self.address = address
        self.handshaken: set[bytes] = set()
        self.stop_event = threading.Event()

    def serve_forever(self) -> None:
        logger.info("engine ready at %s", self.address)
        try:
            while not self.stop_event.is_set():
                if not self.engine.has_work:
                    timeout = _IDLE_POLL_MS
                elif self.engine.only_compiling:
                    timeout = _COMPILING_POLL_MS
                else:
                    timeout = 0
                ready = dict(self.poller.poll(timeout))
                if self.monitor in ready:
                    self._count_connections()
                if self.socket in ready:
                    self._drain_inbox()
                if self.engine.has_work:
                    self._send_outputs(self.engine.step())
                    for client, error in self.engine.take_errors():
                        self._send(client, error)
                self.throughput_log.maybe_log()
        finally:
            self.socket.disable_monitor()
            self.monitor.close()
            self.socket.close()
            self.context.term()

    def _count_connections(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.num_connections += 1 if event == zmq.EVENT_ACCEPTED else -1

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
            self._handle(client, message)

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
                logger.info("server %r connected (%s)", name, client.hex())
                self.handshaken.add(client)
                self._send(client, self.engine.handshake_reply())
            case GenerateRequest(request_id=request_id):
                self._generate(client, message)
            case AbortRequest(request_id=request_id):
                output = self.engine.abort(client, request_id)
                if output is not None:
                    self._send(client, TokenOutputs([output]))
            case StatsRequest():
                stats = self.engine.stats()
                self._send(
                    client, dataclasses.replace(stats, num_connected_servers=self.num_connections)
                )
            case _:
                logger.warning("dropped a %s: not a message for the engine", message.TYPE)

    def _generate(self, client: bytes, request: GenerateRequest) -> None:
        if client not in self.handshaken:
            self._send(
                client,
                ErrorReply(request.request_id, ErrorCode.NOT_READY, "handshake first"),
            )
            return
        try:
            self.engine.add_request(
                client, request.request_id, request.prompt_token_ids, request.sampling
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
        try:
            self.socket.send_multipart([client, message.encode()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Again: its queue is full (not reading). EHOSTUNREACH: it disconnected.
            self.handshaken.discard(client)
            aborted = self.engine.abort_client(client)
            logger.warning(
                "server %s unreachable (%s): aborted its %d requests", client.hex(), exc, aborted
            )
