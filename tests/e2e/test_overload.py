"""Overload and hostile clients, with real processes: connections that send nothing, or a
byte at a time, are cut within their timeouts while the server keeps answering; past the
cap on connections, past the engine's queue, and past its grammars compiling, requests are
refused at once (503, 429) while those admitted finish; priorities and users' turns order the
queue; /health answers from the engine's heartbeat; a drain that runs out of time tells its
clients; a client that goes away is one INFO line; a server or a peer that stops reading the
engine's outputs is dropped past a bound in bytes. The timeouts are set small here; their
defaults are ``python -m server --help``'s."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from protocol import PROTOCOL_VERSION, GenerateRequest, HandshakeRequest, SamplingParams
from tandem.testing.processes import (
    SMALL_KV_CACHE,
    engine_stats,
    free_port,
    start_engine,
    start_server,
    stop,
    tail,
    wait_for_cache_free,
)
from tandem.testing.random_checkpoint import save_tiny_word_model

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
KEEP_ALIVE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 50
MAX_REQUEST_BYTES = 20_000
MAX_GENERATED_TOKENS = 64
# The engine runs two requests at once and lets two more wait.
MAX_NUM_SEQS = 2
MAX_QUEUED = 2
# Tries at seeing the engine's queue full (a window of a fraction of a second).
QUEUE_FULL_ATTEMPTS = 3
# The prioritized engine's bound on prompt tokens left to compute.
MAX_QUEUED_PROMPT_TOKENS = 64
SEND_TIMEOUT_S = 2.0
# The engine with a bound on its grammars compiling lets two compile at once.
MAX_COMPILING_GRAMMARS = 2
# Strings in each of a burst's distinct choice lists: a compile of about two seconds on the
# tiny model's vocabulary, where the engine reads the whole burst in a fraction of one.
LARGE_CHOICE = 20_000
# How much later than its timeout a cut may come on two shared CPU cores, a CI run's other
# engines and servers on them too (a header slowloris's cut once came 3.03 s after its start,
# the completion it waits for included). A drip that is never cut lasts longer still: 12 s of
# headers, 90 s of body.
SLACK_S = 4.0
# The engine with a bound on output unread drops a server past 200 KB: a few of its frames of
# prompt log-probabilities, or hundreds of a token's 20 likeliest alternatives.
MAX_UNREAD_OUTPUT_BYTES = 200_000


@dataclass
class Served:
    engine: subprocess.Popen
    server: subprocess.Popen
    address: str
    url: str
    port: int
    server_log: Path
    engine_log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def _serve(workdir: Path, engine_args: list[str], server_args: list[str]) -> Iterator[Served]:
    save_tiny_word_model(workdir / "model")
    address = f"ipc://{workdir}/engine.sock"
    engine = start_engine(
        address, workdir / "engine.log", "--model", str(workdir / "model"), *SMALL_KV_CACHE,
        "--max-num-seqs", str(MAX_NUM_SEQS), *engine_args,
    )  # fmt: skip
    port = free_port()
    server = None
    try:
        server = start_server(address, port, workdir / "server.log", *server_args)
        url = f"http://127.0.0.1:{port}"
        yield Served(
            engine, server, address, url, port, workdir / "server.log", workdir / "engine.log"
        )
    finally:
        for process in (server, engine):
            if process is not None:
                stop(process)
        print(tail(workdir / "server.log"))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A first-come-first-served engine with a short queue, behind a server with small
    connection limits."""
    yield from _serve(
        tmp_path_factory.mktemp("guarded"),
        ["--max-queued-requests", str(MAX_QUEUED)],
        [
            "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
            "--min-body-rate", "200", "--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT_S),
            "--max-connections", str(MAX_CONNECTIONS),
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--max-generated-tokens", str(MAX_GENERATED_TOKENS),
        ],
    )  # fmt: skip


@pytest.fixture(scope="module")
def prioritized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An engine ordering its queue by priority, whose queue is bounded in prompt tokens
    (far above what the tests of priorities queue)."""
    yield from _serve(
        tmp_path_factory.mktemp("prioritized"),
        [
            "--scheduling-policy", "priority",
            "--max-queued-prompt-tokens", str(MAX_QUEUED_PROMPT_TOKENS),
        ],
        [],
    )  # fmt: skip


def _completion(prompt: str, max_tokens: int, **extra: object) -> dict:
    """A completion body for raw HTTP."""
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def _create_kwargs(
    prompt: str | list[int], max_tokens: int, priority: int = 0, **extra: object
) -> dict:
    """The openai client's arguments for the same (vLLM's fields go in extra_body)."""
    extra_body = {"ignore_eos": True, "priority": priority}
    return {
        "model": "model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "extra_body": extra_body,
        **extra,
    }


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server writes until it closes the connection, and when it closed
    (time.monotonic()); fails if it is still open ``timeout_s`` from now."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection is still open after {timeout_s} s: {received!r}")
    return received, time.monotonic()


def _answers(url: str) -> float:
    """Seconds /health took to answer 200."""
    started = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    return time.monotonic() - started


def _drip(sock: socket.socket, data: bytes, interval_s: float) -> None:
    """Sends ``data`` a byte at a time until the server closes the connection."""
    try:
        for byte in data:
            sock.send(bytes([byte]))
            time.sleep(interval_s)
    except OSError:
        return


def test_silent_connections_are_closed_within_the_header_timeout(guarded: Served) -> None:
    opened = time.monotonic()
    silent = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(40)]
    assert _answers(guarded.url) < 1.0  # the server answers meanwhile
    for sock in silent:
        received, closed = _read_until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
        assert received.startswith(b"HTTP/1.1 408 ")
        assert b'"code": "request_timeout"' in received
        assert closed - opened < HEADER_TIMEOUT_S + SLACK_S
        sock.close()


def test_slowloris_on_headers_and_on_bodies_is_cut(guarded: Served) -> None:
    headers = socket.create_connection(("127.0.0.1", guarded.port))
    body = socket.create_connection(("127.0.0.1", guarded.port))
    body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    started = time.monotonic()
    slow_headers = b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 99
    slow_body = b'{"prompt": "' + b"w5 " * 300
    drips = [
        threading.Thread(target=_drip, args=(headers, slow_headers, 0.1)),
        threading.Thread(target=_drip, args=(body, slow_body, 0.1)),
    ]
    for drip in drips:
        drip.start()
    # Others are served meanwhile.
    reply = guarded.client().completions.create(**_create_kwargs("w5 w6", 4))
    assert reply.choices[0].finish_reason == "length"
    for sock, timeout_s in ((headers, HEADER_TIMEOUT_S), (body, BODY_TIMEOUT_S)):
        received, closed = _read_until_closed(sock, timeout_s + SLACK_S)
        assert received.startswith(b"HTTP/1.1 408 "), received
        assert closed - started < timeout_s + SLACK_S
        sock.close()
    for drip in drips:
        drip.join()


def test_an_idle_keep_alive_connection_is_closed(guarded: Served) -> None:
    sock = socket.create_connection(("127.0.0.1", guarded.port))
    sock.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    response = b""
    while not response.endswith(b"}"):  # the whole JSON answer
        response += sock.recv(65536)
    assert response.startswith(b"HTTP/1.1 200 ")
    idle_from = time.monotonic()
    received, closed = _read_until_closed(sock, KEEP_ALIVE_TIMEOUT_S + SLACK_S)
    assert received == b""  # closed without a word, as uvicorn closes idle connections
    assert closed - idle_from >= KEEP_ALIVE_TIMEOUT_S * 0.9
    sock.close()


def test_connections_past_the_cap_are_refused_at_once(guarded: Served) -> None:
    opened = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(60)]
    time.sleep(HEADER_TIMEOUT_S / 2)  # the refusals are written at once, the 408s later
    answers = []
    for sock in opened:
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # held, until the header timeout
            answers.append(sock.recv(65536))
    assert len(answers) >= 60 - MAX_CONNECTIONS
    for received in answers:
        assert received.startswith(b"HTTP/1.1 503 "), received
        assert b"too_many_connections" in received
    for sock in opened:
        sock.close()
    assert _answers(guarded.url) < 1.0


def test_a_chunked_upload_past_the_limit_gets_413_and_the_connection_closes(
    guarded: Served,
) -> None:
    sock = socket.create_connection(("127.0.0.1", guarded.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"w5 " * 1365
    sent = 0
    received = b""
    sock.settimeout(0.05)
    # The client goes on uploading, as a careless one does, until the server closes.
    while sent < 100 * MAX_REQUEST_BYTES:
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            received += sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset or broken pipe: closed
            break
        if received.startswith(b"HTTP/1.1 413 ") and b"request_too_large" in received:
            rest, _ = _read_until_closed(sock, 5)
            received += rest
            break
    assert received.startswith(b"HTTP/1.1 413 "), received
    assert b"connection: close" in received.lower()
    assert sent < 10 * MAX_REQUEST_BYTES  # it was not read on and on
    sock.close()


def test_a_full_queue_answers_429_at_once_and_the_admitted_finish(guarded: Served) -> None:
    client = guarded.client()

    def one(index: int) -> tuple[str, float, str | None]:
        started = time.monotonic()
        # Long enough that a refusal beats every finish on a loaded machine too: a few
        # tokens of the tiny model finish about as fast as a refusal comes back.
        body = _create_kwargs(f"w{5 + index} w6", 48)
        try:
            if index % 2:
                chunks = list(client.completions.create(stream=True, **body))
                outcome = chunks[-1].choices[0].finish_reason or "?"
            else:
                outcome = client.completions.create(**body).choices[0].finish_reason
            return outcome, time.monotonic() - started, None
        except openai.RateLimitError as exc:
            assert exc.response.json()["error"]["code"] == "rate_limit_exceeded"
            return "429", time.monotonic() - started, exc.response.headers.get("retry-after")

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(10)))
    outcomes = [outcome for outcome, _, _ in results]
    assert set(outcomes) == {"length", "429"}, results  # nothing else: nothing lost
    assert outcomes.count("length") >= MAX_NUM_SEQS + MAX_QUEUED - 1
    refused = [(took, retry) for outcome, took, retry in results if outcome == "429"]
    assert all(retry == "1" for _, retry in refused)
    finished = [took for outcome, took, _ in results if outcome == "length"]
    # Refused without waiting for anyone's tokens.
    assert max(took for took, _ in refused) < min(finished)
    wait_for_cache_free(guarded.url)


def test_embeddings_past_the_queue_bound_get_429_and_those_within_it_are_answered(
    guarded: Served,
) -> None:
    """Embeddings wait in a queue of their own (pooling steps beside the generations'), bound
    as the generations' is. One request of more inputs than an idle engine takes at once is a
    400 naming ``input``, sent nowhere (no retry would get it in). Two that each fit but not
    together, reaching the engine at once (stopped while they arrive): the second's inputs
    past a pooling step's sequences and --max-queued-requests are refused, so that request is
    a 429 (its other inputs aborted), and the first is answered."""
    client = guarded.client()
    bound = MAX_NUM_SEQS + MAX_QUEUED
    many = [f"w{index % 50} w7" for index in range(4 * bound)]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model="model", input=many)
    assert too_many.value.body["param"] == "input" and str(bound) in too_many.value.body["message"]
    os.kill(guarded.engine.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.embeddings.create, model="model", input=many[:bound])
            time.sleep(0.3)  # its inputs reach the engine's socket first
            second = pool.submit(client.embeddings.create, model="model", input=many[:bound])
            time.sleep(0.3)
            os.kill(guarded.engine.pid, signal.SIGCONT)
            assert len(first.result(timeout=60).data) == bound
            with pytest.raises(openai.RateLimitError) as refused:
                second.result(timeout=60)
    finally:
        os.kill(guarded.engine.pid, signal.SIGCONT)
    assert refused.value.response.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.value.response.headers.get("retry-after") == "1"
    wait_for_cache_free(guarded.url)


def _sent_to_engine(url: str) -> float:
    """Requests the server has sent to an engine: its arrival-to-engine histogram's count."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:request_arrival_to_engine_seconds_count"
    )


def _until(
    condition: Callable[[], object], failure: Callable[[], object], timeout_s: float = 30.0
) -> None:
    """Poll ``condition`` every 10 ms until it holds; past ``timeout_s``, fail with what
    ``failure`` says then."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, failure()
        time.sleep(0.01)


def _send_blockers_together(
    guarded: Served, pool: ThreadPoolExecutor, url: str
) -> list[Future[httpx.Response]]:
    """As many requests as the engine runs and queues, sent while it is stopped, so that
    they reach it together: sent one by one on a loaded machine, the first finished before
    the last arrived, and the queue was never full."""
    sent = _sent_to_engine(guarded.url)
    os.kill(guarded.engine.pid, signal.SIGSTOP)
    try:
        blockers = [
            pool.submit(httpx.post, url, json=_completion(f"w{5 + i}", 64), timeout=120)
            for i in range(MAX_NUM_SEQS + MAX_QUEUED)
        ]
        _until(
            lambda: _sent_to_engine(guarded.url) >= sent + len(blockers),
            lambda: "the server never sent the blockers on",
            timeout_s=10,
        )
        time.sleep(0.1)  # counted as they are sent: the last one's send done
    finally:
        os.kill(guarded.engine.pid, signal.SIGCONT)
    return blockers


def _queue_full(url: str) -> bool:
    """Whether the server says its engine's queue is full."""
    return bool((httpx.get(f"{url}/health").json()["engine"] or {}).get("queue_full"))


def _seen_before(condition: Callable[[], object], ended: Callable[[], bool]) -> bool:
    """Whether ``condition`` held at some poll before ``ended`` did (polled back to back)."""
    deadline = time.monotonic() + 60
    while not ended():
        if condition():
            return True
        assert time.monotonic() < deadline, "the blockers never finished"
    return bool(condition())


def test_a_full_queue_is_refused_by_the_server_before_the_body_and_reopens_at_once(
    guarded: Served,
) -> None:
    url = f"{guarded.url}/v1/completions"
    with ThreadPoolExecutor(MAX_NUM_SEQS + MAX_QUEUED) as pool:
        # The queue is full until the running blockers' 64 tokens are done, a fraction of a
        # second of the tiny model's steps: a poller descheduled that long on a loaded
        # machine misses it (or the engine, stopped once it was seen, had just emptied it),
        # and the blockers are sent again.
        for _ in range(QUEUE_FULL_ATTEMPTS):
            blockers = _send_blockers_together(guarded, pool, url)
            seen = _seen_before(
                lambda: _queue_full(guarded.url),
                lambda blockers=blockers: all(blocker.done() for blocker in blockers),
            )
            if seen:
                # Stopped, the engine sends no stats: full now, it stays so.
                os.kill(guarded.engine.pid, signal.SIGSTOP)
                if _queue_full(guarded.url):
                    break
                os.kill(guarded.engine.pid, signal.SIGCONT)
            assert [blocker.result().status_code for blocker in blockers] == [200] * len(blockers)
        else:
            raise AssertionError("the engine never said its queue was full")
        # Stopped, the engine reads nothing: only the server can answer, and it has not read
        # the body (which is not even JSON) to do it.
        try:
            refused = httpx.post(url, content=b"not json", timeout=5)
        finally:
            os.kill(guarded.engine.pid, signal.SIGCONT)
        # The first blocker's end frees a place for a waiting one and so a place in the
        # queue, and the engine says so at once: a request sent now is taken, not refused
        # until its next heartbeat.
        wait(blockers, return_when=FIRST_COMPLETED)
        taken = httpx.post(url, json=_completion("w5", 2), timeout=60)
        assert [blocker.result().status_code for blocker in blockers] == [200] * len(blockers)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "1"
    assert taken.status_code == 200, taken.text
    wait_for_cache_free(guarded.url)


def test_n_times_max_tokens_is_bounded_and_priority_needs_the_priority_policy(
    guarded: Served,
) -> None:
    client = guarded.client()
    # Within the choices an idle engine takes at once (MAX_NUM_SEQS + MAX_QUEUED), past the
    # tokens a request may generate.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(n=4, **_create_kwargs("w5", 20))
    assert refused.value.body["param"] == "n"
    assert str(MAX_GENERATED_TOKENS) in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**_create_kwargs("w5", 2, priority=1))
    assert "--scheduling-policy priority" in refused.value.body["message"]


def test_health_answers_from_the_heartbeat_while_the_engine_is_busy(guarded: Served) -> None:
    # Stopped, the engine answers nothing, as in a long step: asking it for stats would
    # time out, its heartbeat says it was alive a moment ago.
    os.kill(guarded.engine.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)
        started = time.monotonic()
        health = httpx.get(f"{guarded.url}/health", timeout=10)
        ready = httpx.get(f"{guarded.url}/ready", timeout=10)
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(guarded.engine.pid, signal.SIGCONT)
    assert health.status_code == 200 and ready.status_code == 200, (health.text, ready.text)
    assert health.json()["replicas"][0]["last_heard_s"] >= 2.0
    assert health.json()["engine"]["num_total_blocks"] > 0
    _until(
        lambda: (
            httpx.get(f"{guarded.url}/health", timeout=10).json()["replicas"][0]["last_heard_s"]
            <= 1.5
        ),
        lambda: "the heartbeat was never heard again",
        timeout_s=10,
    )


def test_a_client_going_away_is_one_info_line(guarded: Served) -> None:
    before = guarded.server_log.read_text()
    for _ in range(10):  # half a body, then gone
        sock = socket.create_connection(("127.0.0.1", guarded.port))
        sock.sendall(
            b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"pro'
        )
        time.sleep(0.05)
        sock.close()
    for _ in range(3):  # a stream left after its first event
        with httpx.stream(
            "POST", f"{guarded.url}/v1/completions",
            json=_completion("w5 w6", MAX_GENERATED_TOKENS, stream=True), timeout=60,
        ) as response:  # fmt: skip
            next(line for line in response.iter_lines() if line.startswith("data: {"))
    wait_for_cache_free(guarded.url)
    new = _new_log_lines(guarded.server_log, len(before), lambda new: new.count("went away") >= 13)
    assert new.count("went away before its request") == 10, new
    assert new.count("went away during its stream") == 3, new
    assert "Traceback" not in new and " ERROR " not in new, new


def _new_log_lines(path: Path, start: int, done: Callable[[str], bool]) -> str:
    """The log from ``start`` on, once ``done`` says it holds what it should (or after 10 s)."""
    deadline = time.monotonic() + 10
    while not done(new := path.read_text()[start:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return new


def _finish_order(
    served: Served, requests: list[tuple[str, dict, Callable[[dict], bool] | None]]
) -> list[str]:
    """The names of ``requests`` (name, body, what the engine's stats must show before it is
    sent: None, nothing) in the order their answers ended. Each is sent once the requests
    before it are where the condition says (running, or waiting for a place), whatever the
    machine's speed."""
    order: list[str] = []
    client = served.client()

    def one(name: str, body: dict) -> None:
        client.completions.create(**body)
        order.append(name)

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = []
        for name, body, ready in requests:
            if ready is not None:
                _until(
                    lambda ready=ready: ready(engine_stats(served.url)),
                    lambda: engine_stats(served.url),
                )
            futures.append(pool.submit(one, name, body))
        for future in futures:
            future.result()
    return order


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server with a short send timeout, before an engine of many places."""
    yield from _serve(
        tmp_path_factory.mktemp("impatient"),
        ["--max-num-seqs", "32"],
        ["--send-timeout", str(SEND_TIMEOUT_S), "--max-generated-tokens", "20000"],
    )


def test_a_stream_whose_client_reads_nothing_is_cut(impatient: Served) -> None:
    """A client that stops reading a stream without closing its connection held it, and the
    request's outputs piling up in the server, for ever (uvicorn's send waits on a full
    buffer without end): past --send-timeout the connection is cut, and the server says so."""
    # More than loopback's send buffer takes (it grows to 4 MB) and uvicorn's 64 KiB.
    body = _completion("w5 w6", 480, n=24, stream=True, logprobs=20, model="model")
    body = json.dumps(body).encode()
    with socket.socket() as sock:
        # A small receive window, never read: the server's send buffer fills.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", impatient.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _until(
            lambda: "read nothing of its response" in impatient.server_log.read_text(),
            lambda: tail(impatient.server_log),
            timeout_s=SEND_TIMEOUT_S + 40,
        )
    wait_for_cache_free(impatient.url)


@pytest.fixture(scope="module")
def grammar_bound(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An engine that lets few grammars compile at once, behind a server of default limits
    (a large choice list needs its bound on a body's bytes)."""
    yield from _serve(
        tmp_path_factory.mktemp("grammar-bound"),
        ["--max-compiling-grammars", str(MAX_COMPILING_GRAMMARS)],
        [],
    )


def _constrained(choices: list[str]) -> dict:
    """The openai client's arguments for a completion that is one of ``choices``."""
    return {
        "model": "model",
        "prompt": "w5 w6",
        "max_tokens": 16,
        "extra_body": {"guided_choice": choices},
    }


def test_new_grammars_past_the_bound_get_429_while_compiled_ones_run(
    grammar_bound: Served,
) -> None:
    """A client sending many large distinct constraints queued their compiles without bound,
    and every other user's structured output waited behind them (and timed out) for minutes.
    Past --max-compiling-grammars a request whose constraint would start one more compile is
    refused at once (429 with Retry-After); one whose grammar is compiled already is taken,
    those admitted finish, every block is free after, and a refused request sent again once
    the compiles are done is taken."""
    served = grammar_bound
    client = served.client()
    compiled = ["yes", "no"]
    large = [[f"r{k}c{i}" for i in range(LARGE_CHOICE)] for k in range(MAX_COMPILING_GRAMMARS + 3)]

    def one(choices: list[str]) -> str | openai.RateLimitError:
        """The choice answered (the word tokenizer decodes a space before each character),
        or the refusal."""
        try:
            text = client.completions.create(**_constrained(choices)).choices[0].text
        except openai.RateLimitError as exc:
            return exc
        return text.replace(" ", "")

    assert one(compiled) in compiled
    with ThreadPoolExecutor(len(large) + 1) as pool:
        # Sent while the engine is stopped, the burst reaches it together: no compile is done
        # before the engine has read the last request.
        sent = _sent_to_engine(served.url)
        os.kill(served.engine.pid, signal.SIGSTOP)
        try:
            futures = [pool.submit(one, choices) for choices in [*large, compiled]]
            _until(
                lambda: _sent_to_engine(served.url) >= sent + len(futures),
                lambda: "the server never sent the burst on",
            )
            time.sleep(0.1)  # counted as they are sent: the last one's send done
        finally:
            os.kill(served.engine.pid, signal.SIGCONT)
        *answers, compiled_answer = [future.result() for future in futures]
    assert compiled_answer in compiled
    refused = [answer for answer in answers if isinstance(answer, openai.RateLimitError)]
    taken = [(text, choices) for text, choices in zip(answers, large, strict=True)]
    taken = [(text, choices) for text, choices in taken if isinstance(text, str)]
    assert len(taken) == MAX_COMPILING_GRAMMARS, answers
    assert all(text in choices for text, choices in taken)
    for exc in refused:
        assert exc.status_code == 429
        error = exc.response.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "--max-compiling-grammars" in error["message"], error
        assert exc.response.headers["retry-after"] == "1"
    wait_for_cache_free(served.url)
    again = large[answers.index(refused[0])]
    assert one(again) in again
    wait_for_cache_free(served.url)


def test_a_lower_priority_value_runs_first(prioritized: Served) -> None:
    client, url = prioritized.client(), prioritized.url
    order: list[str] = []

    def one(name: str, body: dict) -> None:
        client.completions.create(**body)
        order.append(name)

    def until_sent(count: float) -> None:
        _until(
            lambda: _sent_to_engine(url) >= count,
            lambda: "the server never sent it on",
            timeout_s=10,
        )

    with ThreadPoolExecutor(4) as pool:
        # Both places taken for a hundred steps and more; the first frees long before the
        # second, so that one waiting request runs first, for forty steps before the other.
        futures = [
            pool.submit(one, "blocker-a", _create_kwargs("w5 w6", 150)),
            pool.submit(one, "blocker-b", _create_kwargs("w7 w8", 400)),
        ]
        _until(lambda: engine_stats(url)["num_running"] >= 2, lambda: engine_stats(url))
        # Stopped, the engine reads nothing: "late" reaches it first and "urgent" after, both
        # before a place frees (sent while it runs, a place could free between the two, and
        # "late", alone in the queue, take it).
        sent = _sent_to_engine(url)
        os.kill(prioritized.engine.pid, signal.SIGSTOP)
        try:
            futures.append(pool.submit(one, "late", _create_kwargs("w9", 40, priority=5)))
            until_sent(sent + 1)
            futures.append(pool.submit(one, "urgent", _create_kwargs("w9", 40, priority=-1)))
            until_sent(sent + 2)
            time.sleep(0.1)  # counted as it is sent: the send done
        finally:
            os.kill(prioritized.engine.pid, signal.SIGCONT)
        for future in futures:
            future.result()
    assert order.index("urgent") < order.index("late"), order
    wait_for_cache_free(url)


def test_one_users_many_choices_do_not_starve_another_user(prioritized: Served) -> None:
    order = _finish_order(
        prioritized,
        [
            ("big", _create_kwargs("w5 w6", 100, n=6, user="big"), None),
            # Sent while four of big's choices wait for the two places.
            ("small", _create_kwargs("w7 w8", 100, user="small"), lambda s: s["num_waiting"] == 4),
        ],
    )
    # First come first served, the small one would start after all six of big's choices.
    assert order == ["small", "big"]
    wait_for_cache_free(prioritized.url)


def test_prompt_tokens_past_the_bound_are_refused_and_those_within_it_taken(
    prioritized: Served,
) -> None:
    client = prioritized.client()
    url = prioritized.url

    def in_flight() -> int:
        return httpx.get(f"{url}/health").json()["requests_in_flight"]

    def until(condition: Callable[[], object]) -> None:
        _until(condition, lambda: engine_stats(url))

    with ThreadPoolExecutor(4) as pool:
        # Both places taken for hundreds of steps, until their clients leave.
        blockers = [
            client.completions.create(stream=True, **_create_kwargs("w5 w6", 400)) for _ in range(2)
        ]
        until(lambda: engine_stats(url)["num_running"] == 2)
        # Stopped, the engine reads nothing: the server forwards these in the order sent, and
        # the engine, resumed, judges them in one read of its socket, the places still taken.
        os.kill(prioritized.engine.pid, signal.SIGSTOP)
        try:
            judged = {}
            for length in (40, 30, 20, 4):
                sent = in_flight()
                body = _create_kwargs([7] * length, 4)
                judged[length] = pool.submit(client.completions.create, **body)
                until(lambda sent=sent: in_flight() > sent)
                time.sleep(0.2)  # its prompt tokenized and sent on
        finally:
            os.kill(prioritized.engine.pid, signal.SIGCONT)
        # 40 waits; 40 + 30 is past the bound, though 1 request waits of the default 1,024;
        # 40 + 20 is within it, and 60 + 4 reaches it: from then on the server refuses by
        # itself, before reading a body (this one is not even JSON).
        until(lambda: _queue_full(url))
        at_the_door = httpx.post(f"{url}/v1/completions", content=b"not json")
        assert engine_stats(url)["num_running"] == 2  # judged while the blockers ran
        for stream in blockers:
            stream.close()
        with pytest.raises(openai.RateLimitError) as refused:
            judged.pop(30).result()
        results = [future.result() for future in judged.values()]
    error = refused.value.response.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert "--max-queued-prompt-tokens" in error["message"], error
    assert refused.value.response.headers["retry-after"] == "1"
    assert at_the_door.status_code == 429, at_the_door.text
    assert [r.choices[0].finish_reason for r in results] == ["length"] * 3
    wait_for_cache_free(url)


def test_a_drain_that_runs_out_of_time_tells_its_clients(
    prioritized: Served, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    server = start_server(prioritized.address, port, log, "--drain-timeout", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(
                httpx.post, f"{url}/v1/completions", json=_completion("w5", 400), timeout=60
            )
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=_completion("w6", 400, stream=True),
                timeout=60,
            ) as stream:  # fmt: skip
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                # Stopped, the engine makes no token more, so the drain runs out however fast
                # the machine (a fast one streams all 400 tokens within the second).
                os.kill(prioritized.engine.pid, signal.SIGSTOP)
                try:
                    server.send_signal(signal.SIGTERM)
                    rest = [line for line in (first, *lines) if line]
                    whole_reply = whole.result()
                finally:
                    os.kill(prioritized.engine.pid, signal.SIGCONT)
        assert rest[-1] == "data: [DONE]"
        assert '"code":"server_draining"' in rest[-2], rest[-3:]
        assert whole_reply.status_code == 503
        assert whole_reply.json()["error"]["code"] == "server_draining"
        assert server.wait(timeout=30) == 0, tail(log)
    finally:
        stop(server)
    wait_for_cache_free(prioritized.url)


@pytest.fixture(scope="module")
def output_bound(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An engine of eight places that drops a server past MAX_UNREAD_OUTPUT_BYTES of output
    unread."""
    yield from _serve(
        tmp_path_factory.mktemp("output-bound"),
        ["--max-unread-output-bytes", str(MAX_UNREAD_OUTPUT_BYTES), "--max-num-seqs", "8"],
        [],
    )


def _drops(served: Served) -> list[tuple[int, int]]:
    """The engine's drops for output unread so far: the bytes unread each would have reached,
    and the requests it aborted."""
    pattern = (
        r"dropped \(its output unread would reach (\d+) bytes, past --max-unread-output-bytes "
        rf"{MAX_UNREAD_OUTPUT_BYTES}\): aborted its (\d+) requests"
    )
    return [
        (int(unread), int(aborted))
        for unread, aborted in re.findall(pattern, served.engine_log.read_text())
    ]


def test_a_peer_that_reads_nothing_is_dropped_past_the_bound_on_output_unread(
    output_bound: Served,
) -> None:
    """A peer that handshakes, asks for large outputs and reads none of them had up to 100,000
    frames queued in the engine (ZeroMQ counts frames, not bytes), each up to 64 MiB: past
    --max-unread-output-bytes of output sent and not said read, its requests are aborted and it
    is dropped, within a second or so; every block is free after, and the server on the same
    engine answers on."""
    served = output_bound
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.connect(served.address)
    # Each token with its 20 likeliest alternatives: about 230 bytes a request and step, so
    # the bound is reached after some two hundred frames, in the middle of 400 tokens each.
    sampling = SamplingParams(max_tokens=400, ignore_eos=True, logprobs=20)
    requests = 4
    drops = len(_drops(served))
    try:
        rogue.send(HandshakeRequest(PROTOCOL_VERSION, "rogue").encode())
        started = time.monotonic()
        for index in range(requests):
            rogue.send(GenerateRequest(f"r{index}", [5 + index, 6, 7], sampling).encode())
        _until(
            lambda: len(_drops(served)) > drops,
            lambda: tail(served.engine_log),
            timeout_s=10 + SLACK_S,
        )
        took = time.monotonic() - started
        [(unread, aborted)] = _drops(served)[drops:]
        assert aborted == requests  # none had finished
        # The frame that would have passed the bound is one step's: the peer's 4 outputs.
        assert MAX_UNREAD_OUTPUT_BYTES < unread < MAX_UNREAD_OUTPUT_BYTES + 4_000, unread
        wait_for_cache_free(served.url)
        reply = served.client().completions.create(**_create_kwargs("w5 w6", 8))
        assert reply.choices[0].finish_reason == "length"
        assert len(_drops(served)) == drops + 1, tail(served.engine_log)
        print(f"the peer was dropped {took:.2f} s after its requests")
    finally:
        context.destroy(linger=0)


def test_a_server_that_stops_reading_is_dropped_and_serves_again_once_it_reads(
    output_bound: Served,
) -> None:
    """A server that reads what it is sent is never dropped, however much that is in all (its
    receipts say it read it). Stopped, it is dropped past the bound; resumed, it reads the
    engine's word that it was dropped after the rest, fails its requests (503) and handshakes
    again at once, the engine having heard it read everything (else the handshake's reply
    would drop it again)."""
    served = output_bound
    client = served.client()
    drops = len(_drops(served))
    # Prompt log-probabilities of 300 tokens: a frame of some 70 KB each, twice the bound in
    # all; /stats in between (an EngineStats) has the server send its receipt at once.
    for index in range(6):
        prompt = [5 + index] + [7] * 299
        reply = client.completions.create(
            model="model", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 20}
        )
        assert len(reply.choices[0].prompt_logprobs) == 300
        engine_stats(served.url)
    assert len(_drops(served)) == drops
    url = f"{served.url}/v1/completions"
    with ThreadPoolExecutor(4) as pool:
        # Sent while the engine is stopped, the requests are all in the engine before the
        # server stops; their outputs, more than the bound, all come while it is stopped.
        sent = _sent_to_engine(served.url)
        os.kill(served.engine.pid, signal.SIGSTOP)
        try:
            stuck = [
                pool.submit(
                    httpx.post,
                    url,
                    json=_completion([5 + index] + [7] * 299, 50, prompt_logprobs=20),
                    timeout=60,
                )
                for index in range(4)
            ]
            _until(
                lambda: _sent_to_engine(served.url) >= sent + len(stuck),
                lambda: "the server never sent them on",
                timeout_s=10,
            )
            time.sleep(0.1)  # counted as they are sent: the last one's send done
            os.kill(served.server.pid, signal.SIGSTOP)
        finally:
            os.kill(served.engine.pid, signal.SIGCONT)
        try:
            _until(
                lambda: len(_drops(served)) > drops,
                lambda: tail(served.engine_log),
                timeout_s=10 + SLACK_S,
            )
        finally:
            os.kill(served.server.pid, signal.SIGCONT)
        answers = [future.result() for future in stuck]
    [(_, aborted)] = _drops(served)[drops:]
    assert aborted >= 1
    failed = [answer for answer in answers if answer.status_code != 200]
    assert len(failed) == aborted, [answer.text for answer in answers]
    for answer in failed:
        assert answer.status_code == 503, answer.text
        assert "--max-unread-output-bytes" in answer.json()["error"]["message"]
    reply = client.completions.create(**_create_kwargs("w5 w6", 8))
    assert reply.choices[0].finish_reason == "length"
    wait_for_cache_free(served.url)
