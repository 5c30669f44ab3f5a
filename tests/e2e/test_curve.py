"""CURVE on the engine socket, with real processes: only servers whose keys the engine
authorizes can generate, nobody on the path can read the traffic, and the engine logs
every refused peer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from protocol import (
    PROTOCOL_VERSION,
    GenerateRequest,
    HandshakeRequest,
    SamplingParams,
    StatsRequest,
)
from protocol.curve import load_public_key, make_curve_client
from tandem.testing.processes import (
    REPO_ROOT,
    SMALL_KV_CACHE,
    engine_stats,
    free_port,
    spawn,
    start_engine,
    start_server,
    stop,
    tail,
    wait_healthy,
)
from tandem.testing.random_checkpoint import save_tiny_word_model


def make_keys(directory: Path, *servers: str) -> None:
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts/make_curve_keys.py"), str(directory),
         "--servers", *servers],
        check=True,
        capture_output=True,
    )  # fmt: skip


class Relay:
    """A man in the middle: forwards TCP connections to ``port`` and keeps every byte."""

    def __init__(self, port: int) -> None:
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._port = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(("127.0.0.1", self._port))
            except OSError:  # the engine is not listening yet: the peer will try again
                near.close()
                continue
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    self.captured += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def relay_cleanup() -> Iterator[list[Relay]]:
    relays: list[Relay] = []
    yield relays
    for relay in relays:
        relay.close()


def test_only_authorized_servers_reach_the_engine_and_nobody_reads_the_wire(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen], relay_cleanup: list[Relay]
) -> None:
    save_tiny_word_model(tmp_path / "model")
    keys, intruder_keys = tmp_path / "keys", tmp_path / "intruder"
    make_keys(keys, "good")
    make_keys(intruder_keys, "intruder")  # a valid pair, and another engine key
    engine_port = free_port()
    engine_log = tmp_path / "engine.log"
    engine = start_engine(
        f"tcp://127.0.0.1:{engine_port}",
        engine_log,
        "--model", str(tmp_path / "model"),
        "--curve-secret-key", str(keys / "engine.key_secret"),
        "--curve-authorized-keys", str(keys / "authorized"),
        *SMALL_KV_CACHE,
    )  # fmt: skip
    subprocess_cleanup.append(engine)
    relay = Relay(engine_port)  # the authorized server's traffic passes through it
    relay_cleanup.append(relay)
    http_port = free_port()
    server = start_server(
        f"tcp://127.0.0.1:{relay.port}",
        http_port,
        tmp_path / "server.log",
        "--engine-public-key", str(keys / "engine.key"),
        "--curve-secret-key", str(keys / "good.key_secret"),
    )  # fmt: skip
    subprocess_cleanup.append(server)

    url = f"http://127.0.0.1:{http_port}"
    body = {"prompt": "w5 w6 w7", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    # The handshake carried the tokenizer and the template; none of it is readable.
    with relay._lock:
        wire = bytes(relay.captured)
    # The handshake reply went through the relay, and the words of its tokenizer.
    assert len(wire) > (tmp_path / "model/tokenizer.json").stat().st_size
    for plaintext in (b"tokenizer_json", b"<|im_start|>", b"handshake_reply", b"prompt_token_ids"):
        assert plaintext not in wire

    def plain(sock: zmq.Socket) -> None:
        pass

    def unknown_key(sock: zmq.Socket) -> None:
        make_curve_client(sock, intruder_keys / "intruder.key_secret", keys / "engine.key")

    def wrong_engine_key(sock: zmq.Socket) -> None:
        make_curve_client(sock, keys / "good.key_secret", intruder_keys / "engine.key")

    for configure in (plain, unknown_key, wrong_engine_key):
        assert not _answered(f"tcp://127.0.0.1:{engine_port}", configure), configure.__name__

    intruder_public = load_public_key(intruder_keys / "intruder.key_secret").decode()
    # Either side may see the failed handshake first: the engine then learns why, or only
    # that the peer hung up.
    expected = [
        ("the peer does not use CURVE", "the peer may not use CURVE"),
        (f"DENIED (CURVE) domain=* client_key=b'{intruder_public}'",),
        ("the peer has a different engine public key", "the peer may not use CURVE"),
    ]
    deadline = time.monotonic() + 10
    while not all(any(line in engine_log.read_text() for line in lines) for lines in expected):
        assert time.monotonic() < deadline, tail(engine_log)
        time.sleep(0.2)
    # Nothing the intruders sent ran: the engine finished our one request.
    assert engine_stats(url)["num_finished"] == 1
    stop(server)
    stop(engine)
    assert engine.returncode == 0, tail(engine_log)


def _answered(address: str, configure: Callable[[zmq.Socket], None]) -> bool:
    """Whether the engine answers a peer set up by ``configure`` within 3 s."""
    context = zmq.Context()
    try:
        peer = context.socket(zmq.DEALER)
        peer.linger = 0
        # A refused handshake can drop the connection's queue between two sends; a send
        # with no connection to queue on would then wait forever (CI hung here once).
        peer.sndtimeo = 3000
        configure(peer)
        peer.connect(address)
        peer.send(HandshakeRequest(PROTOCOL_VERSION, "intruder").encode())
        peer.send(StatsRequest().encode())
        peer.send(GenerateRequest("x", [5, 6, 7], SamplingParams(max_tokens=4)).encode())
        return bool(peer.poll(3000))
    except zmq.Again:  # nowhere to send: nothing reached the engine, so nothing answered
        return False
    finally:
        context.destroy(linger=0)


def test_engine_refuses_an_open_address_without_keys(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    engine = start_engine(f"tcp://0.0.0.0:{free_port()}", log)
    assert engine.wait(timeout=120) == 2
    assert "refusing to listen on tcp://0.0.0.0" in log.read_text()
    assert "--insecure" in log.read_text()


def test_data_parallel_replicas_share_one_engine_key_pair(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    """``--data-parallel-size 2`` on TCP: both replicas take the one engine key pair and
    allow-list, the server's --engine-public-key applies to both, and both serve."""
    save_tiny_word_model(tmp_path / "model")
    keys = tmp_path / "keys"
    make_keys(keys, "web")
    engine_port, http_port = free_port(2), free_port()
    log = tmp_path / "cluster.log"
    server_keys = (
        f"--engine-public-key {keys / 'engine.key'} --curve-secret-key {keys / 'web.key_secret'}"
    )
    script = spawn(
        [
            "env", f"PYTHON={sys.executable}",
            "bash", str(REPO_ROOT / "scripts/start_distributed.sh"),
            "--model", str(tmp_path / "model"), "--device", "cpu", "--port", str(http_port),
            "--data-parallel-size", "2", "--engine-address", f"tcp://127.0.0.1:{engine_port}",
            "--server-args", server_keys,
            "--", "--curve-secret-key", str(keys / "engine.key_secret"),
            "--curve-authorized-keys", str(keys / "authorized"), *SMALL_KV_CACHE,
        ],
        log,
    )  # fmt: skip
    subprocess_cleanup.append(script)
    url = f"http://127.0.0.1:{http_port}"
    wait_healthy(url, [script], log)
    deadline = time.monotonic() + 120
    while (health := httpx.get(f"{url}/health", timeout=10).json())["status"] != "ok":
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.2)
    addresses = [replica["address"] for replica in health["replicas"]]
    assert addresses == [f"tcp://127.0.0.1:{engine_port + r}" for r in range(2)]
    # Prompts with nothing in common alternate between the replicas: both answer.
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for prompt in ("w5 w6 w7", "w9 w3 w8", "w2 w4 w6", "w7 w7 w1"):
        reply = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert reply.status_code == 200, reply.text
    # /health has each replica's stats of its last heartbeat: a second old at most.
    deadline = time.monotonic() + 10
    while True:
        replicas = httpx.get(f"{url}/health", timeout=10).json()["replicas"]
        if all(replica["engine"]["num_finished"] >= 1 for replica in replicas):
            break
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)
    # Nobody without a key gets an answer from either replica.
    for address in addresses:
        assert not _answered(address, lambda sock: None)
