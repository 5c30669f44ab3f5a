"""The engine's socket on the event loop: every frame received, in order, however many wait at
once; sends past the high-water mark wait and go out in order once the peer reads again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from server.engine_socket import EngineSocket


async def _peer_and_dealer(
    tmp_path: Path, **options: int
) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, zmq.Socket]:
    """A ROUTER (the engine's end) and a plain DEALER connected to it, with ``options`` set on
    both; the ROUTER has seen the DEALER's identity once this returns."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER, socket_class=zmq.Socket)
    for option, value in options.items():
        router.setsockopt(getattr(zmq, option), value)
        dealer.setsockopt(getattr(zmq, option), value)
    address = f"ipc://{tmp_path}/engine.sock"
    router.bind(address)
    dealer.connect(address)
    return context, router, dealer


def test_every_frame_arrives_in_order_when_many_wait_at_once(tmp_path: Path) -> None:
    async def run() -> None:
        context, router, dealer = await _peer_and_dealer(tmp_path)
        received: list[bytes] = []
        engine_socket = EngineSocket(dealer, received.append)
        engine_socket.start()
        engine_socket.send(b"hello")
        identity, hello = await router.recv_multipart()
        assert hello == b"hello"
        # More than one reader callback takes: the rest must not wait for another signal.
        frames = [str(i).encode() for i in range(500)]
        for frame in frames:
            await router.send_multipart([identity, frame])
        async with asyncio.timeout(10):
            while len(received) < len(frames):
                await asyncio.sleep(0.01)
        assert received == frames
        engine_socket.stop()
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()

    asyncio.run(run())


def test_sends_past_the_high_water_mark_wait_and_go_out_in_order(tmp_path: Path) -> None:
    async def run() -> None:
        context, router, dealer = await _peer_and_dealer(tmp_path, SNDHWM=2, RCVHWM=2)
        engine_socket = EngineSocket(dealer, lambda frame: None)
        engine_socket.start()
        frames = [str(i).encode() for i in range(300)]
        for frame in frames:  # the peer reads none yet: most of them must wait
            engine_socket.send(frame)
        assert engine_socket._unsent, "the high-water mark was never reached"
        got = []
        async with asyncio.timeout(10):
            while len(got) < len(frames):
                got.append((await router.recv_multipart())[1])
        assert got == frames
        assert not engine_socket._unsent
        engine_socket.stop()
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()

    asyncio.run(run())
