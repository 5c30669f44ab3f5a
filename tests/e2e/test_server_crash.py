"""Crashes: a server dies and the engine carries on; the engine dies and the server carries on."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx

from tandem.testing.processes import (
    engine_stats,
    free_port,
    start_engine,
    start_server,
    stop,
    wait_for_cache_free,
    wait_healthy,
)


def test_engine_survives_a_killed_server(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    engine = start_engine(address, tmp_path / "engine.log")
    subprocess_cleanup.append(engine)
    first_port, second_port = free_port(), free_port()
    first = start_server(address, first_port, tmp_path / "server1.log")
    subprocess_cleanup.append(first)
    first_url = f"http://127.0.0.1:{first_port}"
    before = engine_stats(first_url)
    assert before["num_connected_servers"] == 1

    body = {
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{first_url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        lines = response.iter_lines()
        for _ in range(8):
            next(lines)
        assert engine_stats(first_url)["num_running"] == 1
        stop(first, signal.SIGKILL)

    second = start_server(address, second_port, tmp_path / "server2.log")
    subprocess_cleanup.append(second)
    second_url = f"http://127.0.0.1:{second_port}"
    after = wait_for_cache_free(second_url)
    assert engine.poll() is None
    assert after["engine_pid"] == before["engine_pid"] == engine.pid
    assert after["engine_started_at"] == before["engine_started_at"]  # weights not reloaded
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_connected_servers"] == 1  # the killed one is no longer counted

    assert_answers_paris(second_url)
    log = (tmp_path / "engine.log").read_text()
    assert "unreachable" in log


def test_server_survives_an_engine_restart(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    """The engine dies mid-stream: the stream ends with an error, /health says 503, and once
    an engine is back on the same address the same server answers again."""
    address = f"ipc://{tmp_path}/engine.sock"
    engine = start_engine(address, tmp_path / "engine.log")
    subprocess_cleanup.append(engine)
    port = free_port()
    server = start_server(address, port, tmp_path / "server.log")
    subprocess_cleanup.append(server)
    url = f"http://127.0.0.1:{port}"
    first_pid = engine_stats(url)["engine_pid"]

    body = {
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        stop(engine, signal.SIGKILL)
        rest = list(lines)  # the stream must end, not hang
    assert any('"engine_unavailable"' in line for line in rest), rest[-3:]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503

    restarted = start_engine(address, tmp_path / "engine2.log")
    subprocess_cleanup.append(restarted)
    health = wait_healthy(url, [restarted, server], tmp_path / "server.log")
    assert health["engine"]["engine_pid"] == restarted.pid != first_pid
    assert_answers_paris(url)


def assert_answers_paris(url: str) -> None:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 32,
        },
        timeout=120,
    )
    assert reply.status_code == 200
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]
