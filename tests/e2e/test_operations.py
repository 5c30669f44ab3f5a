"""Operations with real processes: a supervised deployment (scripts/start_distributed.sh)
restarts its servers in turn under a steady load without failing a request, brings back a
crashed server, drains a server on SIGTERM, refuses oversized bodies; an engine stopped by
SIGTERM ends its requests with a finish reason."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    Message,
    SamplingParams,
    TokenOutputs,
    decode_message,
)
from tandem.testing.processes import (
    REPO_ROOT,
    SMALL_KV_CACHE,
    free_port,
    spawn,
    start_engine,
    start_server,
    stop,
    tail,
    wait_for_cache_free,
    wait_healthy,
)
from tandem.testing.random_checkpoint import (
    VOCAB,
    save_tiny_llama,
    save_tiny_word_model,
    save_word_tokenizer,
)
from tandem.testing.streams import Balancer

# Concurrent streams during the rolling restart: the 200 run in scripts/soak.py;
# CI's two shared cores keep 64 (each step then decodes 64 rows).
CONCURRENT_STREAMS = 64
STREAM_TOKENS = 24
PROMPTS = [f"w{a} w{a + 1} w{a + 7}" for a in range(2, 130, 16)]
CONTEXT_TOKENS = 4096


@dataclass
class Deployment:
    urls: list[str]
    engine_address: str
    control: Path
    log_path: Path
    model: Path

    def command(self, command: str) -> dict:
        script = REPO_ROOT / "scripts/start_distributed.sh"
        done = subprocess.run(
            ["bash", str(script), f"--{command}", "--control", str(self.control)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHON": sys.executable},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The tiny model behind two supervised servers, with a context long enough for a stream
    that outlasts the drain test's checks."""
    workdir = tmp_path_factory.mktemp("deployment")
    save_tiny_word_model(workdir / "model", max_position_embeddings=CONTEXT_TOKENS)
    log_path = workdir / "deployment.log"
    port = free_port(2)
    address = f"ipc://{workdir}/engine.sock"
    control = workdir / "supervisor.sock"
    script = spawn(
        [
            "env", f"PYTHON={sys.executable}",
            "bash", str(REPO_ROOT / "scripts/start_distributed.sh"),
            "--servers", "2", "--port", str(port), "--device", "cpu",
            "--model", str(workdir / "model"), "--engine-address", address,
            "--control", str(control), "--drain-timeout", "30",
            "--", *SMALL_KV_CACHE,
        ],
        log_path,
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    try:
        for url in urls:
            wait_healthy(url, [script], log_path)
        yield Deployment(urls, address, control, log_path, workdir / "model")
    finally:
        stop(script, signal.SIGTERM)
        print(tail(log_path))
    # The supervisor stops its servers and its engine, then exits cleanly, the engine's
    # socket file gone with it.
    assert script.returncode == 0
    assert "engine stopped" in log_path.read_text()
    assert not Path(address.removeprefix("ipc://")).exists()


def _body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}


def _references(url: str) -> dict[str, str]:
    references = {}
    for prompt in PROMPTS:
        reply = httpx.post(f"{url}/v1/completions", json=_body(prompt), timeout=120)
        assert reply.status_code == 200, reply.text
        references[prompt] = reply.json()["choices"][0]["text"]
    return references


async def _rolling_restart_under_load(
    deployment: Deployment, references: dict[str, str]
) -> tuple[list[str], int, int, dict]:
    """Streams through both servers while they restart in turn; the failures, the
    streams completed, the refusals retried, and the restart's reply."""
    failures: list[str] = []
    completed = 0
    stop_load = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        balancer = Balancer(client, deployment.urls)

        async def worker(index: int) -> None:
            nonlocal completed
            turn = index
            while not stop_load.is_set():
                prompt = PROMPTS[turn % len(PROMPTS)]
                result = await balancer.stream(_body(prompt), start=turn)
                turn += CONCURRENT_STREAMS
                if result.error or result.text != references[prompt] or not result.done:
                    failures.append(f"{prompt!r} via {result.server}: {result}")
                completed += 1

        workers = [asyncio.create_task(worker(i)) for i in range(CONCURRENT_STREAMS)]
        while completed < CONCURRENT_STREAMS:  # the load is steady before the restart
            await asyncio.sleep(0.1)
        # It returns once the last server serves again; the load is steady until then.
        restart = await asyncio.to_thread(deployment.command, "rolling-restart")
        stop_load.set()
        await asyncio.gather(*workers)
    return failures, completed, balancer.retries, restart


def test_rolling_restart_under_load_fails_no_request(deployment: Deployment) -> None:
    references = _references(deployment.urls[0])
    before = deployment.command("status")
    failures, completed, retried, restart = asyncio.run(
        _rolling_restart_under_load(deployment, references)
    )
    assert restart["ok"], restart
    assert failures == [], f"{len(failures)} of {completed} failed: {failures[:3]}"
    after = deployment.command("status")
    old_pids = {server["pid"] for server in before["servers"]}
    assert not old_pids & {server["pid"] for server in after["servers"]}  # all restarted
    assert after["engines"][0]["pid"] == before["engines"][0]["pid"]  # weights kept
    # The second server drained only once the first, restarted, carried its share.
    assert "server 0 carries" in deployment.log_path.read_text()
    print(f"{completed} streams, {retried} refusals retried on the other server")
    wait_for_cache_free(deployment.urls[0])


def test_a_crashed_server_is_started_again(deployment: Deployment) -> None:
    crashed = deployment.command("status")["servers"][1]
    os.kill(crashed["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        server = deployment.command("status")["servers"][1]
        if server["ready"] and server["pid"] != crashed["pid"]:
            break
        assert time.monotonic() < deadline, tail(deployment.log_path)
        time.sleep(0.5)
    assert server["restarts"] == crashed["restarts"] + 1
    reply = httpx.post(f"{deployment.urls[1]}/v1/completions", json=_body(PROMPTS[0]), timeout=60)
    assert reply.status_code == 200
    assert "exited with -9; starting it again" in deployment.log_path.read_text()


def test_a_draining_server_finishes_its_streams_and_takes_nothing_new(
    deployment: Deployment, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    server = start_server(deployment.engine_address, port, log, "--drain-timeout", "60")
    url = f"http://127.0.0.1:{port}"
    # Long enough to outlast the checks below, which take milliseconds unless the test's
    # process waits for a core: 480 tokens (0.7 s) were not, on CI's two loaded cores (the
    # server had drained and exited before the first check). 3,000 take some 4.5 s.
    body = {**_body(PROMPTS[0]), "max_tokens": 3000, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.send_signal(signal.SIGTERM)
            ready = _ready_once_draining(url)
            assert ready.status_code == 503
            assert ready.json()["error"]["code"] == "server_draining"
            # Liveness: the server is alive, and says it drains.
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "draining"
            refused = httpx.post(f"{url}/v1/completions", json=_body(PROMPTS[0]), timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_draining"
            rest = [line for line in (first, *lines) if line]
        events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert rest[-1] == "data: [DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.wait(timeout=60) == 0, tail(log)
    finally:
        stop(server)


def _ready_once_draining(url: str) -> httpx.Response:
    """/ready once the server answers that it drains (it handles the signal between two
    ticks of its event loop), or its last answer after 5 s."""
    deadline = time.monotonic() + 5
    while True:
        ready = httpx.get(f"{url}/ready", timeout=10)
        if ready.status_code == 503 or time.monotonic() > deadline:
            return ready
        time.sleep(0.01)


def test_an_oversized_body_gets_413_unread(deployment: Deployment) -> None:
    url = f"{deployment.urls[0]}/v1/completions"
    # Over the default: 4 MiB above the context's 4,096 tokens at 32 bytes each.
    body = b'{"prompt": "' + b"w5 " * (5 * 2**20 // 3) + b'"}'
    headers = {"content-type": "application/json"}
    declared = httpx.post(url, content=body, headers=headers, timeout=60)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for start in range(0, len(body), 2**16):
            yield body[start : start + 2**16]

    chunked = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    for reply in (declared, chunked):
        assert reply.status_code == 413
        assert reply.json()["error"]["code"] == "request_too_large"
    assert httpx.post(url, json=_body(PROMPTS[0]), timeout=60).status_code == 200


def test_a_stopped_engine_ends_its_requests_with_a_finish_reason(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    log = tmp_path / "engine.log"
    # A context long enough that the long request cannot finish within the drain, however
    # fast the machine: 6,000 tokens in 3 s would take 0.5 ms a step.
    model = tmp_path / "model"
    save_tiny_llama(model, max_position_embeddings=8192)
    save_word_tokenizer(model, VOCAB)
    engine = start_engine(
        address, log, "--model", str(model), "--drain-timeout", "3", *SMALL_KV_CACHE
    )
    subprocess_cleanup.append(engine)
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.linger = 0
    peer.connect(address)
    try:
        peer.send(HandshakeRequest(PROTOCOL_VERSION, "test").encode())
        assert peer.poll(300_000), tail(log)
        assert isinstance(decode_message(peer.recv()), HandshakeReply)
        for request_id, max_tokens in (("short", 8), ("long", 6000)):
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            peer.send(GenerateRequest(request_id, [5, 6, 7], sampling).encode())
        # Stop only once both have produced a token: the engine may read the second request
        # a step after the first, and a request read after the signal is refused instead.
        running: set[str] = set()
        finished: dict[str, str] = {}
        refused: list[tuple[str, str]] = []

        def record(message: Message) -> None:
            if isinstance(message, ErrorReply):
                refused.append((message.request_id, message.code))
            elif isinstance(message, TokenOutputs):
                for output in message.outputs:
                    running.add(output.request_id)
                    if output.finish_reason is not None:
                        finished[output.request_id] = output.finish_reason

        while running != {"short", "long"}:
            assert peer.poll(60_000), tail(log)
            record(decode_message(peer.recv()))
        engine.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        peer.send(GenerateRequest("late", [5, 6, 7], SamplingParams()).encode())
        while peer.poll(10_000):
            record(decode_message(peer.recv()))
        # The short one finished while draining; the long one was cut at --drain-timeout.
        assert finished == {"short": "length", "long": "abort"}, (refused, tail(log))
        assert refused == [("late", "shutting_down")]
        assert engine.wait(timeout=30) == 0, tail(log)
        assert "aborted 1 requests still running at shutdown" in log.read_text()
    finally:
        context.destroy(linger=0)


def test_metrics_time_each_request_and_count_statuses(deployment: Deployment) -> None:
    url = deployment.urls[0]

    def scrape() -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    before = scrape()
    started = time.monotonic()
    reply = httpx.post(f"{url}/v1/completions", json=_body(PROMPTS[0]), timeout=60)
    took = time.monotonic() - started
    assert reply.status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": 5}, timeout=60).status_code == 400
    after = scrape()

    model = reply.json()["model"]

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": model, **labels}.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("tandem:time_to_first_token_seconds_count") == 1
    assert grew("tandem:inter_token_latency_seconds_count") == STREAM_TOKENS - 1
    assert grew("tandem:e2e_request_latency_seconds_count") == 1
    assert grew("tandem:request_queue_time_seconds_count") == 1
    # The first token's hops, each timed once: this server's two and the engine's prefill,
    # within the engine's round trip (its queue too), all within what the client waited.
    for hop in ("request_arrival_to_engine", "request_prefill_time", "first_token_to_client"):
        assert grew(f"tandem:{hop}_seconds_count") == 1
        assert grew(f"tandem:{hop}_seconds_sum") > 0
    engine_hops = grew("tandem:request_queue_time_seconds_sum") + grew(
        "tandem:request_prefill_time_seconds_sum"
    )
    assert engine_hops <= grew("tandem:time_to_first_token_seconds_sum")
    server_hops = sum(
        grew(f"tandem:{hop}_seconds_sum")
        for hop in ("request_arrival_to_engine", "time_to_first_token", "first_token_to_client")
    )
    assert server_hops <= took
    # The event loop's lag, sampled 20 times a second since the server started.
    assert after[("tandem:event_loop_lag_seconds_count", (("model_name", model),))] >= 1
    assert grew("tandem:request_success_total", finished_reason="length") == 1
    assert grew("tandem:http_requests_total", method="POST", status="200") == 1
    assert grew("tandem:http_requests_total", method="POST", status="400") == 1
    # The engine's series stay, from its fresh stats, labelled with its replica index.
    assert after[("tandem_engine_up", (("replica", "0"),))] == 1
    assert after[("tandem_kv_cache_blocks", (("model", model), ("replica", "0")))] > 0


def test_an_engine_at_a_live_engines_address_refuses_to_start(deployment: Deployment) -> None:
    """At once and in one line, before loading weights: ZeroMQ would take the live engine's
    socket file over, leaving it unreachable to its servers."""
    started = _run(
        sys.executable, "-m", "engine", "--model", str(deployment.model),
        "--device", "cpu", "--address", deployment.engine_address,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr[-2000:]
    assert started.stderr.strip().endswith("another process listens there")
    assert httpx.get(f"{deployment.urls[0]}/ready", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["-m", "engine", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["-m", "server", "--engine", "ipc:///x", "--port", "1", "--max-connections", "-1"],
         "--max-connections"),
        (["-m", "tandem", "serve", "--servers", "0"], "--servers"),
    ],
)  # fmt: skip
def test_an_option_out_of_bounds_is_refused_naming_it(command: list[str], flag: str) -> None:
    """Where the engine would crash in a traceback after loading (or run at 0 requests a
    step) and a server would refuse every connection."""
    refused = _run(sys.executable, *command)
    assert refused.returncode == 2
    assert f"argument {flag}: must be at least 1, got" in refused.stderr.splitlines()[-1]


def test_a_model_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    started = _run(
        sys.executable, "-m", "engine", "--model", str(tmp_path / "none"),
        "--address", f"ipc://{tmp_path}/engine.sock",
    )  # fmt: skip
    assert started.returncode == 2
    assert "Traceback" not in started.stderr
    assert f"cannot serve: cannot load model '{tmp_path / 'none'}'" in started.stderr


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )
