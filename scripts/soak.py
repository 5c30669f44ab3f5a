"""Soak test: a supervised deployment under many concurrent streams, restarts and crashes.

    python scripts/soak.py [--model M] [--device cpu|cuda] [--servers 4] [--streams 1000]
                           [--restart-streams 200] [--restart-stream-seconds S]
                           [--lengths 16,64,256] [--phases restart,chaos,overload,slowloris]
                           [--client-processes P] [-- ENGINE_ARGS...]

Starts ``scripts/start_distributed.sh`` (the tiny random word model when no --model is
given), computes each prompt's greedy answer at each length one request at a time, then:

1. rolling restart: ``--restart-streams`` steady streams (of the first length, or, with
   ``--restart-stream-seconds``, as many tokens as make a stream last that long at the token
   rate measured first) while every server restarts in turn; none may fail or be cut
   (refusals of a draining server are retried on another, as a load balancer does), and each
   must equal its reference (without one, have all its tokens);
2. chaos: ``--streams`` concurrent streams of mixed lengths, ``--disconnect`` of them
   closed by their client part-way, and one server SIGKILLed once ``--kill-when`` of the
   streams have been answered (the supervisor starts it again);
3. overload, of streams of the first length: their time to first token one at a time
   (unloaded); the capacity, streams the engine finished a second while every place in the
   batch was busy (the engine's --max-num-seqs clients sending one after another for
   ``--capacity-seconds``); then Poisson arrivals at ``--overload-factor`` (2) times that
   rate for ``--overload-seconds``, whatever the answers (an open loop), from
   ``--client-processes`` processes: the admitted streams' TTFT against the unloaded one's
   (p50 and p99), how fast the refusals (429) came, how late the arrivals went out (the
   client keeping up), the first token's hops as the servers' /metrics time them (server
   in, the engine's round trip with its queue and prefill, server out; unloaded and
   overloaded), and /health's answer times meanwhile (the engine needs a small
   ``--max-queued-requests`` for the admitted to keep their latency, e.g.
   ``-- --max-queued-requests 0``);
4. slowloris: ``--silent`` connections to one server that never send a byte, and
   ``--drippers`` that send headers, and as many a body, a byte a second: how long the server
   took to close them, and /health's and a small completion's answer times meanwhile;
5. the end: every KV block is free, and the engine's and the surviving servers' RSS and
   open file descriptors are back to their baseline (taken after a warm-up round).

Pass: no stream lost or duplicated a token (a complete one equals its reference, a cut or
abandoned one is a prefix of it), the rolling restart failed and cut none, the overload
refused with 429 only and lost nothing, the slowloris connections were all closed, blocks all
freed, RSS and fds within tolerance. Prints a table; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.testing.processes import free_port, spawn, stop, tail, wait_for_cache_free, wait_healthy
from tandem.testing.random_checkpoint import save_tiny_word_model
from tandem.testing.streams import Balancer, StreamResult
from tandem.testing.timed_stream import timed_stream

ROOT = Path(__file__).resolve().parent.parent
_RSS_TOLERANCE = 1.10  # within 10% of the baseline, plus:
_RSS_SLACK_BYTES = 32 * 2**20  # allocator noise
_FD_SLACK = 4


@dataclass
class Footprint:
    pid: int
    rss_bytes: int
    fds: int

    @classmethod
    def of(cls, pid: int) -> Footprint:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        rss_kb = int(next(line for line in status if line.startswith("VmRSS")).split()[1])
        return cls(pid, rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd")))

    def within(self, baseline: Footprint) -> bool:
        rss_ok = self.rss_bytes <= baseline.rss_bytes * _RSS_TOLERANCE + _RSS_SLACK_BYTES
        return rss_ok and self.fds <= baseline.fds + _FD_SLACK


class Deployment:
    def __init__(self, args: argparse.Namespace, engine_args: list[str], workdir: Path) -> None:
        self.port = free_port(args.servers)
        self.urls = [f"http://127.0.0.1:{self.port + i}" for i in range(args.servers)]
        self.control = workdir / "supervisor.sock"
        self.log = workdir / "deployment.log"
        argv = [
            "env", f"PYTHON={sys.executable}", "bash", str(ROOT / "scripts/start_distributed.sh"),
            "--servers", str(args.servers), "--port", str(self.port), "--model", args.model,
            "--control", str(self.control), "--drain-timeout", "120",
        ]  # fmt: skip
        if args.device:
            argv += ["--device", args.device]
        self.process = spawn([*argv, "--", *engine_args], self.log)
        for url in self.urls:
            wait_healthy(url, [self.process], self.log)

    def command(self, command: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "tandem.supervisor", f"--{command}",
             "--control", str(self.control)],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        return json.loads(done.stdout)

    def footprints(self) -> dict[str, Footprint]:
        status = self.command("status")
        pids = {"engine": status["engines"][0]["pid"]}
        pids |= {server["name"]: server["pid"] for server in status["servers"]}
        return {name: Footprint.of(pid) for name, pid in pids.items()}


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def check(
    result: StreamResult, reference: str | None, abandoned: bool, max_tokens: int = 0,
    may_be_cut: bool = False,
) -> str | None:  # fmt: skip
    """Why ``result`` lost or duplicated tokens (or failed where it should not), or None.
    Without a ``reference`` (a stream too long to compute one for), a complete stream must
    have all its ``max_tokens`` (its usage chunk's count). ``may_be_cut``: a stream cut by a
    killed server is right if what came is."""
    if result.done and result.error is None:
        if reference is None:
            if result.completion_tokens == max_tokens:
                return None
            return f"complete with {result.completion_tokens} of its {max_tokens} tokens"
        return None if result.text == reference else "complete but not equal to its reference"
    if reference is not None and not reference.startswith(result.text):
        return "not a prefix of its reference"
    if abandoned or (may_be_cut and (result.error or "").startswith("stream cut")):
        return None  # the client left, or its server was killed: what came is right
    return f"failed: {result.error}"


async def rolling_restart(
    deployment: Deployment, balancer: Balancer, prompts: list[list[int]], length: int,
    references: dict[tuple[int, int], str], streams: int,
) -> tuple[int, list[str], list[float]]:  # fmt: skip
    """The streams completed, the failures, and each stream's seconds."""
    failures: list[str] = []
    durations: list[float] = []
    done = asyncio.Event()
    request = {"stream_options": {"include_usage": True}}

    async def worker(index: int) -> None:
        turn = index
        while not done.is_set():
            which = turn % len(prompts)
            started = time.monotonic()
            result = await balancer.stream({**body(prompts[which], length), **request}, turn)
            durations.append(time.monotonic() - started)
            problem = check(result, references.get((which, length)), False, length)
            if problem is not None:
                # Answered 200 and then not complete: cut part-way.
                kind = "cut" if result.answered else "failed"
                failures.append(f"{kind}: prompt {which}: {problem} ({result.error})")
            turn += streams

    workers = [asyncio.create_task(worker(i)) for i in range(streams)]
    # The restart starts once every stream is under way.
    while balancer.answered < streams:
        await asyncio.sleep(0.1)
    reply = await asyncio.to_thread(deployment.command, "rolling-restart")
    if not reply.get("ok"):
        failures.append(f"rolling restart: {reply}")
    done.set()
    await asyncio.gather(*workers)
    return len(durations), failures, durations


async def stream_length_for(
    client: httpx.AsyncClient, deployment: Deployment, prompts: list[list[int]], streams: int,
    seconds: float,
) -> int:  # fmt: skip
    """max_tokens that makes each of ``streams`` concurrent streams last about ``seconds``:
    their token rate measured over a round of 64-token streams, within the model's context."""
    balancer = Balancer(client, deployment.urls)
    probe = 64
    started = time.monotonic()
    await asyncio.gather(
        *(balancer.stream(body(prompts[i % len(prompts)], probe), i) for i in range(streams))
    )
    rate = probe / (time.monotonic() - started)
    model = (await client.get(f"{deployment.urls[0]}/v1/models")).json()["data"][0]
    room = model["max_model_len"] - max(len(prompt) for prompt in prompts)
    return max(probe, min(room, int(rate * seconds)))


async def chaos(
    deployment: Deployment, balancer: Balancer, prompts: list[list[int]], lengths: list[int],
    references: dict[tuple[int, int], str], args: argparse.Namespace,
) -> tuple[Counter[str], list[str]]:  # fmt: skip
    rng = random.Random(0)
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    started = 0

    async def one(index: int) -> None:
        nonlocal started
        which, length = rng.randrange(len(prompts)), rng.choice(lengths)
        abandon = rng.random() < args.disconnect
        disconnect_after = rng.randint(1, max(1, length // 2)) if abandon else None
        started += 1
        result = await balancer.stream(body(prompts[which], length), index, disconnect_after)
        problem = check(result, references[which, length], abandon, may_be_cut=True)
        if problem is not None:
            failures.append(f"stream {index} (prompt {which}, {length} tokens): {problem}")
        outcomes[
            "abandoned by its client" if abandon
            else "cut by the killed server" if result.error
            else "complete"
        ] += 1  # fmt: skip

    tasks = [asyncio.create_task(one(i)) for i in range(args.streams)]
    # The kill comes once most streams are answered: the victim's are then in flight.
    while started < args.streams or balancer.answered < args.kill_when * args.streams:
        await asyncio.sleep(0.05)
    victim = deployment.command("status")["servers"][-1]
    os.kill(victim["pid"], signal.SIGKILL)
    print(f"SIGKILLed {victim['name']} (pid {victim['pid']}) with streams in flight", flush=True)
    await asyncio.gather(*tasks)
    return outcomes, failures


@dataclass
class Latencies:
    """Seconds, as they were measured."""

    values: list[float] = field(default_factory=list)

    def summary(self, unit: str = "ms") -> str:
        if not self.values:
            return "none"
        scale = 1000 if unit == "ms" else 1
        ordered = sorted(self.values)
        return (
            f"p50 {statistics.median(ordered) * scale:.0f} {unit}, "
            f"p99 {self.p(0.99) * scale:.0f} {unit}, max {ordered[-1] * scale:.0f} {unit} "
            f"(n={len(ordered)})"
        )

    def p(self, quantile: float) -> float:
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


async def watch_health(
    client: httpx.AsyncClient, url: str, done: asyncio.Event, times: Latencies
) -> None:
    """/health's answer times, five a second, until ``done``; a non-200 counts as 60 s."""
    while not done.is_set():
        started = time.monotonic()
        try:
            status = (await client.get(f"{url}/health", timeout=60)).status_code
        except httpx.HTTPError:
            status = 0
        times.values.append(time.monotonic() - started if status == 200 else 60.0)
        await asyncio.sleep(0.2)


@dataclass
class LoadShare:
    """What one client process measured (seconds; ``lost`` says why each was)."""

    admitted: list[float] = field(default_factory=list)  # TTFT of the streams served
    refused: list[float] = field(default_factory=list)  # time to the 429
    lost: list[str] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)  # how late each arrival went out


async def _load(
    urls: list[str], prompts: list[list[int]], length: int, references: dict[tuple[int, int], str],
    seconds: float, rate: float | None, clients: int, seed: int,
) -> LoadShare:  # fmt: skip
    """Open loop (``rate``: Poisson arrivals a second, whatever the answers) or closed loop
    (``clients`` sending one stream after another, a refused one again after 0.1 s), for
    ``seconds``; every stream started is waited for."""
    share = LoadShare()
    rng = random.Random(seed)
    started = time.monotonic()

    async def one(turn: int) -> int:
        which = turn % len(prompts)
        stream = await timed_stream(urls[turn % len(urls)], body(prompts[which], length))
        if stream.status == 429:
            share.refused.append(stream.first)
        elif stream.status == 200 and stream.text == references[which, length]:
            share.admitted.append(stream.first)
        else:
            share.lost.append(f"prompt {which}: HTTP {stream.status}")
        return stream.status

    if rate is None:

        async def closed(index: int) -> None:
            turn = index
            while time.monotonic() - started < seconds:
                if await one(turn) == 429:
                    await asyncio.sleep(0.1)
                turn += clients

        await asyncio.gather(*(closed(index) for index in range(clients)))
        return share
    tasks = []
    due = 0.0
    while (due := due + rng.expovariate(rate)) < seconds:
        await asyncio.sleep(max(0.0, started + due - time.monotonic()))
        share.lag.append(time.monotonic() - started - due)
        tasks.append(asyncio.create_task(one(len(tasks))))
    await asyncio.gather(*tasks)
    return share


def _load_in_process(*args: object) -> LoadShare:
    return asyncio.run(_load(*args))  # type: ignore[arg-type]


async def load(
    deployment: Deployment, prompts: list[list[int]], length: int,
    references: dict[tuple[int, int], str], seconds: float, processes: int,
    rate: float | None = None, clients: int = 0,
) -> LoadShare:  # fmt: skip
    """``_load`` spread over ``processes`` client processes (one Python process cannot keep
    up with the streams of a GPU's batch), their measures put together."""
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        shares = await asyncio.gather(*(
            loop.run_in_executor(pool, _load_in_process, deployment.urls, prompts, length,
                                 references, seconds, rate and rate / processes,
                                 clients // processes + (index < clients % processes), index)
            for index in range(processes)
        ))  # fmt: skip
    total = LoadShare()
    for share in shares:
        total.admitted += share.admitted
        total.refused += share.refused
        total.lost += share.lost
        total.lag += share.lag
    return total


async def finish_rate(
    client: httpx.AsyncClient, url: str, places: int, done: asyncio.Event
) -> float:
    """Requests the engine finished a second while its ``places`` were taken (nine in ten or
    more: a client's next request follows its last one's end), from its /stats sampled twice a
    second until ``done`` (0 if they never were): the client processes' start and the first
    wave's ramp are left out."""
    samples: list[tuple[float, int]] = []
    while not done.is_set():
        stats = (await client.get(f"{url}/stats")).json()
        if stats["num_running"] >= 0.9 * places:
            samples.append((time.monotonic(), stats["num_finished"]))
        await asyncio.sleep(0.5)
    if len(samples) < 2:
        return 0.0
    (first_at, first), (last_at, last) = samples[0], samples[-1]
    return (last - first) / (last_at - first_at)


async def engine_use(
    client: httpx.AsyncClient, url: str, seconds: float, done: asyncio.Event
) -> tuple[float, float]:
    """The requests the engine finished a second, and the places busy on average, from its
    /stats sampled five times a second for ``seconds`` from its first running request (the
    client processes' start left out) or until ``done`` (0s if sampled less than twice)."""
    samples: list[tuple[float, int, int]] = []
    while not done.is_set() and (not samples or time.monotonic() - samples[0][0] < seconds):
        stats = (await client.get(f"{url}/stats")).json()
        if samples or stats["num_running"]:
            samples.append((time.monotonic(), stats["num_finished"], stats["num_running"]))
        await asyncio.sleep(0.2)
    if len(samples) < 2:
        return 0.0, 0.0
    (first_at, first, _), (last_at, last, _) = samples[0], samples[-1]
    return (last - first) / (last_at - first_at), statistics.mean(s[2] for s in samples)


# A first token's hops as the servers time them (their /metrics; docs/operations.md), in order:
# (name in the table, histogram). The engine's queue and prefill are parts of its round trip;
# the servers' event loop lag (sampled), what each hop through a server may wait.
HOP_HISTOGRAMS = (
    ("server in", "tandem:request_arrival_to_engine_seconds"),
    ("engine round trip", "tandem:time_to_first_token_seconds"),
    ("of it queue", "tandem:request_queue_time_seconds"),
    ("prefill", "tandem:request_prefill_time_seconds"),
    ("server out", "tandem:first_token_to_client_seconds"),
    ("server loop lag", "tandem:event_loop_lag_seconds"),
)
# The hops that follow one another from a request's arrival at a server to its first text out.
_SERVER_PATH = ("server in", "engine round trip", "server out")


async def hop_buckets(client: httpx.AsyncClient, urls: list[str]) -> dict[str, Counter[float]]:
    """Each hop histogram's cumulative bucket counts (by upper bound), summed over the
    servers."""
    histograms = {histogram: name for name, histogram in HOP_HISTOGRAMS}
    buckets: dict[str, Counter[float]] = {name: Counter() for name, _ in HOP_HISTOGRAMS}
    for url in urls:
        text = (await client.get(f"{url}/metrics")).text
        for family in text_string_to_metric_families(text):
            name = histograms.get(family.name)
            if name is None:
                continue
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[name][float(sample.labels["le"])] += sample.value
    return buckets


def bucket_quantile(before: Counter[float], after: Counter[float], quantile: float) -> float:
    """The quantile of what was observed between two scrapes of a histogram, interpolated
    within its bucket as Prometheus' histogram_quantile does (NaN if nothing was)."""
    bounds = sorted(after)
    counts = [after[bound] - before[bound] for bound in bounds]
    if not counts or not counts[-1]:
        return float("nan")
    rank = quantile * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def hop_summary(
    before: dict[str, Counter[float]], after: dict[str, Counter[float]], client: Latencies
) -> str:
    """The first token's hops between two scrapes, p50 / p99 in ms, and what the client
    measured beyond the servers' path (p50 against p50: its own lag, the connection)."""
    p50 = {name: bucket_quantile(before[name], after[name], 0.5) for name in before}
    p99 = {name: bucket_quantile(before[name], after[name], 0.99) for name in before}
    parts = [f"{name} {p50[name] * 1000:.1f} / {p99[name] * 1000:.1f}" for name in p50]
    if client.values:
        rest = statistics.median(client.values) - sum(p50[name] for name in _SERVER_PATH)
        parts.append(f"client and connection (p50 beyond the servers) {rest * 1000:.1f}")
    return ", ".join(parts) + " ms (p50 / p99)"


async def overload(
    client: httpx.AsyncClient, deployment: Deployment, prompts: list[list[int]], length: int,
    references: dict[tuple[int, int], str], args: argparse.Namespace,
) -> tuple[list[tuple[str, str, str]], list[str]]:  # fmt: skip
    """The overload run's table rows and failures (section 3 of the module docstring)."""
    url = deployment.urls[0]
    failures: list[str] = []
    unloaded = Latencies()
    unloaded_hops = [await hop_buckets(client, deployment.urls)]
    for turn in range(args.unloaded_streams):
        which = turn % len(prompts)
        stream = await timed_stream(url, body(prompts[which], length))
        if stream.status != 200 or stream.text != references[which, length]:
            failures.append(f"unloaded stream {turn}: HTTP {stream.status}")
        unloaded.values.append(stream.first)
    unloaded_hops.append(await hop_buckets(client, deployment.urls))
    places = args.places
    busy = asyncio.Event()
    rate_watch = asyncio.create_task(finish_rate(client, url, places, busy))
    saturated = await load(
        deployment, prompts, length, references, args.capacity_seconds,
        args.client_processes, clients=places,
    )  # fmt: skip
    busy.set()
    capacity = await rate_watch
    if not capacity:
        failures.append("overload: the capacity run never had every place busy")
        return [], failures
    rate = args.overload_factor * capacity
    health = Latencies()
    done = asyncio.Event()
    watcher = asyncio.create_task(watch_health(client, url, done, health))
    use_watch = asyncio.create_task(engine_use(client, url, args.overload_seconds, done))
    overloaded_hops = [await hop_buckets(client, deployment.urls)]
    overloaded = await load(
        deployment, prompts, length, references, args.overload_seconds,
        args.client_processes, rate=rate,
    )  # fmt: skip
    overloaded_hops.append(await hop_buckets(client, deployment.urls))
    done.set()
    await watcher
    finished_rate, busy_places = await use_watch
    lost = saturated.lost + overloaded.lost
    failures += [f"overload stream ({why})" for why in lost]
    if not overloaded.refused:
        failures.append("overload: nothing was refused (is --max-queued-requests small?)")
    admitted, refused, lag = (
        Latencies(overloaded.admitted),
        Latencies(overloaded.refused),
        Latencies(overloaded.lag),
    )

    def times_unloaded(quantile: float) -> str:
        if not admitted.values:
            return "none admitted"
        return f"{admitted.p(quantile) / unloaded.p(quantile):.1f}x"

    within = admitted.values and all(
        admitted.p(quantile) <= 2 * unloaded.p(quantile) for quantile in (0.5, 0.99)
    )
    rows = [
        ("overload: unloaded TTFT", unloaded.summary(), "-"),
        ("overload: capacity", f"{capacity:.1f} streams/s with all {places} places busy "
         f"({len(saturated.admitted)} served in {args.capacity_seconds:g} s, "
         f"{len(saturated.refused)} refused)", "-"),
        (f"overload: admitted TTFT at {args.overload_factor:g}x ({rate:.1f}/s)",
         admitted.summary(),
         f"p50 {times_unloaded(0.5)}, p99 {times_unloaded(0.99)} unloaded"
         + ("" if within else " (ABOVE 2x)")),
        ("overload: first token's hops, unloaded", hop_summary(*unloaded_hops, unloaded), "-"),
        (f"overload: first token's hops at {args.overload_factor:g}x",
         hop_summary(*overloaded_hops, admitted), "-"),
        (f"overload: the engine at {args.overload_factor:g}x",
         f"{finished_rate:.1f} streams finished a second ({finished_rate / capacity:.0%} of "
         f"the capacity), {busy_places:.1f} of {places} places busy on average", "-"),
        ("overload: 429s", refused.summary(),
         "ok" if refused.values and refused.p(0.99) < 0.05 else "SLOW"),
        ("overload: outcomes", f"{len(overloaded.admitted)} served, "
         f"{len(overloaded.refused)} refused (429), {len(lost)} lost",
         "0 lost" if not lost else f"{len(lost)} LOST"),
        ("overload: client lag", lag.summary(),
         "ok" if lag.values and lag.p(0.99) < 0.05 else "CLIENT BEHIND"),
        ("overload: /health", health.summary(),
         "ok" if health.values and health.p(0.99) < 0.05 else "SLOW"),
    ]  # fmt: skip
    return rows, failures


def _hold_open(port: int, count: int, closed_after: list[float], started: float) -> None:
    """``count`` connections that send nothing; each one's close time goes to ``closed_after``."""
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    for sock in sockets:
        sock.settimeout(120)
        try:
            while sock.recv(65536):
                pass
        except OSError:
            pass
        closed_after.append(time.monotonic() - started)
        sock.close()


def _drip(port: int, head: bytes, data: bytes, closed_after: list[float], started: float) -> None:
    """Sends ``head``, then ``data`` a byte a second until the server closes the connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(head)
        for byte in data:
            sock.send(bytes([byte]))
            time.sleep(1.0)
    except OSError:
        pass
    closed_after.append(time.monotonic() - started)
    sock.close()


async def slowloris(
    client: httpx.AsyncClient, deployment: Deployment, prompt: list[int], length: int,
    reference: str, args: argparse.Namespace,
) -> tuple[list[tuple[str, str, str]], list[str]]:  # fmt: skip
    """The slowloris run's rows and failures (section 4 of the module docstring)."""
    url = deployment.urls[0]
    port = int(url.rsplit(":", 1)[1])
    failures: list[str] = []
    fds_before = deployment.footprints()["server 0"].fds
    silent: list[float] = []
    dripped_headers: list[float] = []
    dripped_bodies: list[float] = []
    started = time.monotonic()
    post = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    threads = [threading.Thread(target=_hold_open, args=(port, args.silent, silent, started))]
    for _ in range(args.drippers):
        threads.append(threading.Thread(target=_drip, args=(
            port, b"GET /health HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200, dripped_headers,
            started)))  # fmt: skip
        threads.append(threading.Thread(target=_drip, args=(
            port, post, b'{"prompt": "' + b"w5 " * 200, dripped_bodies, started)))  # fmt: skip
    for thread in threads:
        thread.start()
    health = Latencies()
    served = Latencies()
    done = asyncio.Event()
    watcher = asyncio.create_task(watch_health(client, url, done, health))
    while any(thread.is_alive() for thread in threads):
        stream = await timed_stream(url, body(prompt, length))
        if stream.status != 200 or stream.text != reference:
            failures.append(f"slowloris: a completion failed meanwhile: HTTP {stream.status}")
        served.values.append(stream.took)
        await asyncio.sleep(0.5)
        if time.monotonic() - started > 300:
            failures.append("slowloris: connections still open after 300 s")
            break
    done.set()
    await watcher
    for thread in threads:
        thread.join(timeout=1)
    await asyncio.sleep(1)
    fds_after = deployment.footprints()["server 0"].fds

    def closed(times: list[float], count: int) -> str:
        if len(times) < count:
            failures.append(f"slowloris: {count - len(times)} connections not closed")
        return f"{len(times)} of {count} closed, the last after {max(times, default=0):.1f} s"

    rows = [
        ("slowloris: silent connections", closed(silent, args.silent), "-"),
        ("slowloris: headers at 1 byte/s", closed(dripped_headers, args.drippers), "-"),
        ("slowloris: bodies at 1 byte/s", closed(dripped_bodies, args.drippers), "-"),
        ("slowloris: completions meanwhile", served.summary(), "-"),
        ("slowloris: /health meanwhile", health.summary(),
         "ok" if health.values and health.p(0.99) < 0.05 else "SLOW"),
        ("slowloris: server 0 fds", f"{fds_before} -> {fds_after}",
         "ok" if fds_after <= fds_before + _FD_SLACK else "ABOVE BASELINE"),
    ]  # fmt: skip
    return rows, failures


async def warm_up(
    client: httpx.AsyncClient, deployment: Deployment, prompt: list[int], lengths: list[int]
) -> None:
    """A stream of each length through each server, then nothing running."""
    balancer = Balancer(client, deployment.urls)
    await asyncio.gather(
        *(
            balancer.stream(body(prompt, length), index)
            for index in range(len(deployment.urls))
            for length in lengths
        )
    )
    wait_for_cache_free(deployment.urls[0], timeout_s=120)


async def soak(args: argparse.Namespace, deployment: Deployment) -> bool:
    phases = set(args.phases.split(","))
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randint(4, 48))] for _ in range(8)]
    lengths = [int(n) for n in args.lengths.split(",")]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rows: list[tuple[str, str, str]] = []
    failures: list[str] = []
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        references = {}
        for which, prompt in enumerate(prompts):
            for length in lengths:
                reply = await client.post(
                    f"{deployment.urls[0]}/v1/completions", json=body(prompt, length)
                )
                references[which, length] = reply.json()["choices"][0]["text"]
        await warm_up(client, deployment, prompts[0], lengths)
        engine_baseline = deployment.footprints()["engine"]

        if "restart" in phases:
            length = lengths[0]
            if args.restart_stream_seconds:
                length = await stream_length_for(
                    client, deployment, prompts, args.restart_streams, args.restart_stream_seconds
                )
            started = time.monotonic()
            balancer = Balancer(client, deployment.urls)
            completed, restart_failures, durations = await rolling_restart(
                deployment, balancer, prompts, length, references, args.restart_streams
            )
            failures += restart_failures
            cut = sum(problem.startswith("cut") for problem in restart_failures)
            rows.append((
                "rolling restart",
                f"{args.restart_streams} steady streams of {length} tokens "
                f"({Latencies(durations).summary(unit='s')}), {completed} completed in "
                f"{time.monotonic() - started:.0f} s, {balancer.retries} refusals retried",
                f"{len(restart_failures) - cut} failed, {cut} cut"
                + (" (FAILED)" if restart_failures else ""),
            ))  # fmt: skip
            # The servers are new: their baseline is taken now (the engine's stands).
            await warm_up(client, deployment, prompts[0], lengths)
        baseline = {**deployment.footprints(), "engine": engine_baseline}

        if "overload" in phases:
            phase_rows, phase_failures = await overload(
                client, deployment, prompts, lengths[0], references, args
            )
            rows += phase_rows
            failures += phase_failures
        if "slowloris" in phases:
            phase_rows, phase_failures = await slowloris(
                client, deployment, prompts[0], lengths[0], references[0, lengths[0]], args
            )
            rows += phase_rows
            failures += phase_failures

        if "chaos" in phases:
            started = time.monotonic()
            balancer = Balancer(client, deployment.urls)
            outcomes, chaos_failures = await chaos(
                deployment, balancer, prompts, lengths, references, args
            )
            failures += chaos_failures
            rows.append((
                "chaos",
                f"{args.streams} streams in {time.monotonic() - started:.0f} s: "
                + ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())),
                "0 lost/duplicated" if not chaos_failures else f"{len(chaos_failures)} FAILED",
            ))  # fmt: skip

    # A killed server comes back; then nothing may be left running anywhere.
    deadline = time.monotonic() + 300
    while not all(s["ready"] for s in deployment.command("status")["servers"]):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    stats = wait_for_cache_free(deployment.urls[0], timeout_s=120)
    # Let allocators settle and closed connections finish closing.
    await asyncio.sleep(2)
    after = deployment.footprints()
    # The killed server's successor has no baseline.
    survivors = [name for name in baseline if after[name].pid == baseline[name].pid]
    blocks_freed = stats["num_free_blocks"] == stats["num_total_blocks"]
    rows.append((
        "KV blocks", f"{stats['num_free_blocks']} / {stats['num_total_blocks']} free",
        "ok" if blocks_freed else "LEAK",
    ))  # fmt: skip
    footprint_ok = True
    for name in survivors:
        before, now = baseline[name], after[name]
        ok = now.within(before)
        footprint_ok &= ok
        rows.append((
            f"{name} RSS, fds",
            f"{before.rss_bytes / 2**20:.0f} -> {now.rss_bytes / 2**20:.0f} MiB, "
            f"{before.fds} -> {now.fds} fds",
            "ok" if ok else "ABOVE BASELINE",
        ))  # fmt: skip
    for problem in failures[:10]:
        print("FAILURE:", problem)
    width = max(len(row[0]) for row in rows)
    verdict_width = max(len(row[2]) for row in rows)
    print(f"\n{'check':<{width}}  {'result':<{verdict_width}}  details")
    for name, details, verdict in rows:
        print(f"{name:<{width}}  {verdict:<{verdict_width}}  {details}")
    return not failures and footprint_ok and blocks_freed


def main() -> None:
    argv = sys.argv[1:]
    engine_args: list[str] = []
    if "--" in argv:
        argv, engine_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="default: a tiny random model with a word tokenizer")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--streams", type=int, default=1000, help="chaos phase")
    parser.add_argument("--restart-streams", type=int, default=200, help="rolling restart")
    parser.add_argument("--lengths", default="16,64,256", help="max_tokens of the streams")
    parser.add_argument("--disconnect", type=float, default=0.1, help="share abandoned")
    parser.add_argument(
        "--kill-when", type=float, default=0.75, help="share of streams answered before the kill"
    )
    parser.add_argument(
        "--phases",
        default="restart,chaos,overload,slowloris",
        help="which runs, of restart, overload, slowloris and chaos (in that order)",
    )
    parser.add_argument(
        "--restart-stream-seconds", type=float,
        help="rolling restart: streams this long (max_tokens from their measured token rate) "
        "instead of the first --lengths",
    )  # fmt: skip
    parser.add_argument("--unloaded-streams", type=int, default=20, help="overload: baseline")
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument(
        "--overload-factor", type=float, default=2.0, help="arrivals, in times the capacity"
    )
    parser.add_argument("--overload-seconds", type=float, default=60.0)
    parser.add_argument(
        "--client-processes", type=int, default=1, help="overload: processes sending the streams"
    )
    parser.add_argument("--silent", type=int, default=1000, help="slowloris: silent connections")
    parser.add_argument("--drippers", type=int, default=50, help="slowloris: of each kind")
    args = parser.parse_args(argv)
    # Here, not at the top: the client processes that load() spawns import this module, and
    # engine.config imports torch.
    from engine.config import default_max_num_seqs

    # The places in the engine's batch (its default: 256 a GPU), which the capacity run fills.
    seqs = argparse.ArgumentParser(add_help=False)
    seqs.add_argument("--max-num-seqs", type=int)
    seqs.add_argument("--tensor-parallel-size", type=int, default=1)
    engine_seqs = seqs.parse_known_args(engine_args)[0]
    args.places = engine_seqs.max_num_seqs or default_max_num_seqs(engine_seqs.tensor_parallel_size)
    # A file descriptor per stream, on both sides.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix="tandem-soak-") as tmp:
        workdir = Path(tmp)
        if args.model is None:
            args.model = str(workdir / "model")
            save_tiny_word_model(workdir / "model")
        deployment = Deployment(args, engine_args, workdir)
        try:
            passed = asyncio.run(soak(args, deployment))
        finally:
            stop(deployment.process)
            if deployment.process.returncode != 0:
                print(tail(deployment.log, 60))
    print("PASS" if passed else "FAIL")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
