"""Start the real engine and server processes for end-to-end tests, and stop them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tandem import REPO_ROOT

START_TIMEOUT_S = 600  # the first run downloads the default model
# Engine flags for a small KV cache: quick to allocate for tests that need few tokens.
SMALL_KV_CACHE = ("--kv-cache-memory-gb", "0.05")


def free_port(count: int = 1) -> int:
    """A port P such that P..P+count-1 are free now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count < 65536 and all(_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it until it exits
    return subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        # One intra-op thread unless told otherwise: a test's engine shares the machine's few
        # cores with its servers and the test itself, and torch's threads spin waiting on
        # the cores those need.
        env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # so stop() can signal the whole group
    )


def start_engine(address: str, log_path: Path, *extra: str) -> subprocess.Popen:
    return spawn(
        [sys.executable, "-m", "engine", "--address", address, "--device", "cpu", *extra], log_path
    )


def start_server(address: str, port: int, log_path: Path, *extra: str) -> subprocess.Popen:
    process = spawn(
        [sys.executable, "-m", "server", "--engine", address, "--port", str(port), *extra],
        log_path,
    )
    wait_healthy(f"http://127.0.0.1:{port}", [process], log_path)
    return process


@contextmanager
def engine_and_server(workdir: Path, *engine_args: str) -> Iterator[tuple[str, str, Path]]:
    """An engine (started with ``engine_args``) on a socket in ``workdir`` and one server in
    front of it, logging to ``workdir / "log.txt"``: their address, the server's URL and the
    log. Both stopped on exit, the server first."""
    address = f"ipc://{workdir}/engine.sock"
    log_path = workdir / "log.txt"
    processes: list[subprocess.Popen] = []
    try:
        processes.append(start_engine(address, log_path, *engine_args))
        port = free_port()
        processes.append(start_server(address, port, log_path))
        yield address, f"http://127.0.0.1:{port}", log_path
    finally:
        for process in reversed(processes):
            stop(process)


def wait_healthy(url: str, processes: list[subprocess.Popen], log_path: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"process exited with {process.returncode}:\n{tail(log_path)}")
        try:
            response = httpx.get(f"{url}/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy in {START_TIMEOUT_S} s:\n{tail(log_path)}")


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def engine_stats(url: str) -> dict:
    """The engine's stats now, asked through the server's /stats (/health has those of the
    engine's last heartbeat, up to a second old)."""
    response = httpx.get(f"{url}/stats", timeout=5)
    response.raise_for_status()
    return response.json()


def wait_for_cache_free(url: str, timeout_s: float = 30) -> dict:
    """Poll until no request runs or waits and every block is free; the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(url)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0
        if idle and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"cache not freed in {timeout_s} s: {stats}")
        time.sleep(0.2)


def compiled_in_a_process(code: str, timeout_s: float = 600) -> Any:
    """The JSON that Python ``code`` prints last, run from the repository's root in a process
    of its own without Triton's interpreter (the tests' TRITON_INTERPRET compiles nothing):
    what it found of the kernels it compiled for a GPU, on a machine without one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])
