"""Shared fixtures: one real cluster (engine + two servers) for the end-to-end tests."""

from __future__ import annotations

import os

import torch

# Triton picks its CPU interpreter when a function is decorated, including its own
# library functions at `import triton`; transformers imports triton, so the flag must be
# set before any test module loads. Nothing in engine/ sets it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tandem.testing.processes import (
    REPO_ROOT,
    free_port,
    spawn,
    start_server,
    stop,
    tail,
    wait_healthy,
)

# Under pytest-xdist (`pytest -n N`, the README's command) N workers share the machine's cores:
# each takes its share of torch's intra-op threads, or their threads spin against one another.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))


@dataclass
class Cluster:
    engine_address: str
    urls: list[str]
    model: str
    log_path: Path

    def client(self, index: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[index]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The default model behind two servers, started by scripts/start_distributed.sh."""
    workdir = tmp_path_factory.mktemp("cluster")
    log_path = workdir / "cluster.log"
    address = f"ipc://{workdir}/engine.sock"
    port = free_port(2)
    script = spawn(
        [
            "bash",
            str(REPO_ROOT / "scripts/start_distributed.sh"),
            "--servers",
            "2",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--engine-address",
            address,
        ],
        log_path,
    )
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    try:
        for url in urls:
            wait_healthy(url, [script], log_path)
        model = cluster_model(urls[0])
        yield Cluster(address, urls, model, log_path)
    finally:
        stop(script, signal.SIGTERM)
        assert script.returncode is not None
    print(tail(log_path))


@pytest.fixture(scope="module")
def tools_server_url(cluster: Cluster) -> Iterator[str]:
    """A server on the cluster's engine whose chat template lists tools (the default model's
    has none), for the tool-calling and agent-library tests: its base URL. One a module, gone
    at its end: other modules count the cluster's servers."""
    port = free_port()
    server = start_server(
        cluster.engine_address, port, cluster.log_path, "--chat-template", "chatml_tools"
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server, signal.SIGTERM)


def cluster_model(url: str) -> str:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id


@pytest.fixture
def subprocess_cleanup() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts itself; killed at the end whatever happens."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        stop(process, signal.SIGKILL)
