"""Data parallelism: one server over two real engine replicas (``--engine A,B``).

Requests land on both, a prompt's next turn goes back to the replica that has its prefix
cached, and a replica killed mid-stream fails only its own stream while the other keeps
answering; restarted, it is chosen again. ``tandem serve --data-parallel-size 2``
(tandem/supervisor.py, which scripts/start_distributed.sh runs) starts such a deployment,
each replica on its own GPUs, and restarts a replica that dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.testing.processes import (
    REPO_ROOT,
    free_port,
    spawn,
    start_engine,
    start_server,
    stop,
    tail,
    wait_healthy,
)
from tandem.testing.random_checkpoint import (
    VOCAB,
    random_prompts,
    save_tiny_llama,
    save_word_tokenizer,
)

# Long enough that a stream is still running when the test kills its engine.
MAX_MODEL_LEN = 4096


def replica_stats(url: str) -> list[dict | None]:
    """Each replica's engine stats from /health, by index; None for one not answering."""
    health = httpx.get(f"{url}/health", timeout=10).json()
    return [replica["engine"] for replica in health["replicas"]]


def engine_samples(url: str) -> dict[tuple[str, str], float]:
    """/metrics' engine samples, by name and replica label."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels["replica"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tandem_")
    }


def finished_by_replica(url: str) -> list[int]:
    return [stats["num_finished"] if stats else 0 for stats in replica_stats(url)]


def finished_once_reported(url: str, total: int, timeout_s: float = 10) -> list[int]:
    """Each replica's finished requests once they add up to ``total``: /health has each
    engine's last heartbeat, up to a second old (or the last reading, past the timeout)."""
    deadline = time.monotonic() + timeout_s
    while sum(finished := finished_by_replica(url)) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    return finished


def complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def served_by(url: str, prompt: list[int]) -> int:
    """The replica that answered ``prompt`` (sent alone), by its finished-request count."""
    before = finished_once_reported(url, 0)
    assert complete(url, prompt).status_code == 200
    after = finished_once_reported(url, sum(before) + 1)
    grew = [index for index, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    assert len(grew) == 1, (before, after)
    return grew[0]


def wait_for_all_replicas(url: str, timeout_s: float = 120) -> dict:
    """Poll /health until every replica answers; its last body."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if health["status"] == "ok":
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"not every replica answers after {timeout_s} s: {health}")
        time.sleep(0.2)


def save_model(directory: Path) -> Path:
    """A tiny Llama whose every token decodes to a word, so that each streams a chunk."""
    save_tiny_llama(directory, max_position_embeddings=MAX_MODEL_LEN)
    save_word_tokenizer(directory, VOCAB)
    return directory


class Replicas:
    """Two engines on one tiny checkpoint and a server over both."""

    def __init__(self, workdir: Path, cleanup: list[subprocess.Popen]) -> None:
        self.workdir = workdir
        self.cleanup = cleanup
        self.model = save_model(workdir / "model")
        self.addresses = [f"ipc://{workdir}/engine{index}.sock" for index in range(2)]
        self.engines = [self.start_engine(index) for index in range(2)]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server_log = workdir / "server.log"
        self.server = start_server(",".join(self.addresses), port, self.server_log)
        cleanup.append(self.server)

    def start_engine(self, index: int) -> subprocess.Popen:
        log = self.workdir / f"engine{index}.log"
        engine = start_engine(self.addresses[index], log, "--model", str(self.model))
        self.cleanup.append(engine)
        return engine


@pytest.fixture
def replicas(tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]) -> Iterator[Replicas]:
    yield Replicas(tmp_path, subprocess_cleanup)


def test_requests_spread_and_a_next_turn_finds_its_replica(replicas: Replicas) -> None:
    url = replicas.url
    # Different prompts, sent at once: each replica takes its share.
    prompts = random_prompts(8, seed=1) + random_prompts(8, seed=2)
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda prompt: complete(url, prompt, max_tokens=16), prompts))
    assert all(reply.status_code == 200 for reply in replies)
    finished = finished_once_reported(url, len(prompts))
    assert sum(finished) == len(prompts)
    assert min(finished) >= len(prompts) // 4, finished

    # A conversation: each turn's prompt starts with the one before and its answer. Alone,
    # each request would go to either replica in turn; each turn goes where the first did,
    # and finds its prefix in that replica's cache.
    conversation = random_prompts(5, seed=7)[4]  # 64 tokens: four full blocks
    first = served_by(url, conversation)
    for turn in range(4):
        conversation = conversation + random_prompts(3, seed=turn)[2]  # 17 more tokens
        cached_before = replica_stats(url)[first]["num_cached_prompt_tokens"]
        assert served_by(url, conversation) == first
        cached = replica_stats(url)[first]["num_cached_prompt_tokens"] - cached_before
        assert cached >= 64, cached
    # Prompts with nothing in common still alternate.
    assert {served_by(url, prompt) for prompt in random_prompts(4, seed=99)} == {0, 1}


def test_a_killed_replica_fails_only_its_requests_and_rejoins(replicas: Replicas) -> None:
    url = replicas.url
    body = {"max_tokens": MAX_MODEL_LEN - 100, "ignore_eos": True, "stream": True}
    prompts = random_prompts(2, seed=3)
    with ExitStack() as streams:
        # One stream on each replica: the second goes to the one the first left idle.
        lines = []
        on_replica = []
        for prompt in prompts:
            response = streams.enter_context(
                httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": prompt})
            )
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")
            health = httpx.get(f"{url}/health", timeout=10).json()
            busy = [r["replica"] for r in health["replicas"] if r["requests_in_flight"]]
            on_replica.append(next(index for index in busy if index not in on_replica))
        killed = on_replica[0]
        survivor_lines = lines[1]
        stop(replicas.engines[killed], signal.SIGKILL)

        # The killed replica's stream ends, with an error naming it.
        rest = [line.removeprefix("data: ") for line in lines[0] if line]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "engine_unavailable"
        assert f"replica {killed}" in error["message"]
        # The other stream goes on.
        for _ in range(20):
            chunk = json.loads(next(line for line in survivor_lines if line).removeprefix("data: "))
            assert chunk["choices"][0]["text"], chunk

        # New requests all go to the survivor while the killed one is away.
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["replicas"][killed]["status"] == "unavailable"
        metrics = engine_samples(url)
        survivor = 1 - killed
        assert metrics[("tandem_engine_up", str(killed))] == 0
        assert metrics[("tandem_engine_up", str(survivor))] == 1
        assert ("tandem_kv_cache_blocks", str(killed)) not in metrics
        assert metrics[("tandem_kv_cache_blocks", str(survivor))] > 0
        for prompt in random_prompts(4, seed=11):
            assert complete(url, prompt).status_code == 200

    # Restarted at its address, the replica rejoins and takes requests again.
    replicas.engines[killed] = replicas.start_engine(killed)
    health = wait_for_all_replicas(url)
    assert health["replicas"][killed]["engine"]["engine_pid"] == replicas.engines[killed].pid
    assert {served_by(url, prompt) for prompt in random_prompts(4, seed=12)} == {0, 1}


def test_replicas_of_different_models_are_refused(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    model = tmp_path / "model"
    save_tiny_llama(model, max_position_embeddings=MAX_MODEL_LEN)
    addresses = [f"ipc://{tmp_path}/engine{index}.sock" for index in range(2)]
    for address, max_model_len in zip(addresses, [1024, 2048], strict=True):
        extra = ("--model", str(model), "--max-model-len", str(max_model_len))
        subprocess_cleanup.append(start_engine(address, tmp_path / "engine.log", *extra))
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "server", "--engine", ",".join(addresses)]
    server = spawn([*command, "--port", str(free_port())], log)
    subprocess_cleanup.append(server)
    assert server.wait(timeout=120) == 1  # the engines load in seconds
    assert "do not serve the same model" in log.read_text()
    assert "differ in max_model_len" in log.read_text()


def start_distributed(*args: str) -> list[str]:
    """The command line of scripts/start_distributed.sh with ``args``, on this interpreter."""
    script = str(REPO_ROOT / "scripts/start_distributed.sh")
    return ["env", f"PYTHON={sys.executable}", "bash", script, *args]


def visible_devices(pid: int) -> str | None:
    """The CUDA_VISIBLE_DEVICES that process ``pid`` was started with."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    variables = dict(entry.decode().partition("=")[::2] for entry in environ if entry)
    return variables.get("CUDA_VISIBLE_DEVICES")


def test_start_distributed_starts_replicas_and_restarts_a_dead_one(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    model = save_model(tmp_path / "model")
    port = free_port()
    log = tmp_path / "cluster.log"
    # No --device: each replica sees only its GPU of --gpus. No machine this runs on has GPUs
    # 7 and 6 (a CUDA machine with fewer then sees none), so both replicas run on the CPU.
    script = spawn(
        start_distributed(
            *("--model", str(model), "--port", str(port), "--gpus", "7,6"),
            *("--data-parallel-size", "2", "--engine-address", f"ipc://{tmp_path}/engine"),
        ),
        log,
    )
    subprocess_cleanup.append(script)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, [script], log)
    health = wait_for_all_replicas(url)
    addresses = [replica["address"] for replica in health["replicas"]]
    assert addresses == [f"ipc://{tmp_path}/engine-0", f"ipc://{tmp_path}/engine-1"]
    pids = [replica["engine"]["engine_pid"] for replica in health["replicas"]]
    assert [visible_devices(pid) for pid in pids] == ["7", "6"]
    # A replica lost before the supervisor's own health poll has seen the server is a failed
    # start-up, which stops the deployment: kill it once the supervisor says it started.
    deadline = time.monotonic() + 60
    while "supervisor: started" not in log.read_text():
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.1)

    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while (health := wait_for_all_replicas(url))["replicas"][1]["engine"]["engine_pid"] == pids[1]:
        assert time.monotonic() < deadline, tail(log)
        time.sleep(0.2)
    assert health["replicas"][0]["engine"]["engine_pid"] == pids[0]
    assert visible_devices(health["replicas"][1]["engine"]["engine_pid"]) == "6"  # its GPU kept
    assert script.poll() is None
    assert "engine replica 1 exited with -9; starting it again" in log.read_text()
    assert {served_by(url, prompt) for prompt in random_prompts(4, seed=5)} == {0, 1}


def test_start_distributed_refuses_too_few_gpus_for_the_replicas() -> None:
    done = subprocess.run(
        start_distributed(
            "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--gpus", "0,1,2"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "2 replicas of 2 GPU(s) need 4 GPUs; there are 3 (0,1,2)" in done.stderr
    addresses = ("--engine-address", "tcp://127.0.0.1:5555,tcp://127.0.0.1:5556")
    done = subprocess.run(
        start_distributed("--data-parallel-size", "3", *addresses),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--engine-address lists 2 addresses for 3 replicas" in done.stderr
