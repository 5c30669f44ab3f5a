"""What a server tells the engine it has read (ReadReceipt), against a ROUTER standing in for the
engine: the bytes of every frame since the last handshake's reply, at each stats received, and
before it handshakes again once the engine said it dropped it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from protocol import (
    PROTOCOL_VERSION,
    EngineStats,
    ErrorCode,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    ReadReceipt,
    RequestOutput,
    StatsRequest,
    TokenOutputs,
    decode_message,
)
from server.engine_client import EngineClient

REPLY = HandshakeReply(PROTOCOL_VERSION, "m", "{}", None, None, None, [1], 512, 1, 0.0)
STATS = EngineStats(1, 0.0, "m", "cpu", 16, 100, 100, 0, 0, 0)


def test_receipts_count_the_bytes_read_since_the_handshake(tmp_path: Path) -> None:
    async def run() -> None:
        context = zmq.asyncio.Context()
        engine = context.socket(zmq.ROUTER)
        address = f"ipc://{tmp_path}/engine.sock"
        engine.bind(address)
        client = EngineClient(address)
        connecting = asyncio.create_task(client.connect(timeout=10))

        async def receive() -> tuple[bytes, Message]:
            identity, frame = await asyncio.wait_for(engine.recv_multipart(), 10)
            return identity, decode_message(frame)

        identity, handshake = await receive()
        assert isinstance(handshake, HandshakeRequest)

        async def send(*frames: bytes) -> None:
            for frame in frames:
                await engine.send_multipart([identity, frame])

        # A frame before the reply is not counted: the engine counts from each reply on.
        await send(ErrorReply("r0", ErrorCode.INVALID_REQUEST, "before").encode(), REPLY.encode())
        await connecting
        assert isinstance((await receive())[1], StatsRequest)  # asked at once after a handshake
        frames = [
            TokenOutputs([RequestOutput(f"r{i}", [5] * i, None, 3, i)]).encode() for i in range(9)
        ]
        await send(*frames, b"not a message", STATS.encode())
        read = sum(map(len, frames)) + len(b"not a message") + len(STATS.encode())
        assert (await receive())[1] == ReadReceipt(read)
        # Dropped (the engine's word after the rest): what was read, then a handshake again.
        dropped = ErrorReply("", ErrorCode.NOT_READY, "output unread").encode()
        await send(dropped)
        assert (await receive())[1] == ReadReceipt(read + len(dropped))
        assert isinstance((await receive())[1], HandshakeRequest)
        assert not client.ready
        await send(REPLY.encode())
        assert isinstance((await receive())[1], StatsRequest)
        assert client.ready
        await send(STATS.encode())
        assert (await receive())[1] == ReadReceipt(len(STATS.encode()))
        await client.close()
        engine.close(linger=0)
        context.term()

    asyncio.run(run())
