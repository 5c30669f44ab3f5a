"""Soak test: a supervised deployment under many concurrent streams, restarts and crashes.

    python scripts/soak.py [--model M] [--device cpu|cuda] [--servers 4] [--streams 1000]
                           [--restart-streams 200] [--lengths 16,64,256]
                           [--phases restart,chaos,overload,slowloris] [-- ENGINE_ARGS...]

Starts ``scripts/start_distributed.sh`` (the tiny random word model when no --model is
given), computes each prompt's greedy answer at each length one request at a time, then:

1. rolling restart: ``--restart-streams`` steady streams while every server restarts in
   turn; every stream must equal its reference (refusals of a draining server are retried
   on another, as a load balancer does);
2. chaos: ``--streams`` concurrent streams of mixed lengths, ``--disconnect`` of them
   closed by their client part-way, and one server SIGKILLed once ``--kill-when`` of the
   streams have been answered (the supervisor starts it again);
3. overload: the time to first token of one stream at a time (unloaded), then
   ``--overload-clients`` clients (by default twice the engine's --max-num-seqs) each sending
   streams one after another for ``--overload-seconds``, a refused one (429) again after
   ``--retry-pause``: the admitted streams' TTFT against the unloaded one's, how fast the
   refusals came, and /health's answer times meanwhile (the engine needs
   ``--max-queued-requests``, e.g. ``-- --max-queued-requests 0``);
4. slowloris: ``--silent`` connections to one server that never send a byte, and
   ``--drippers`` that send headers, and as many a body, a byte a second: how long the server
   took to close them, and /health's and a small completion's answer times meanwhile;
5. the end: every KV block is free, and the engine's and the surviving servers' RSS and
   open file descriptors are back to their baseline (taken after a warm-up round).

Pass: no stream lost or duplicated a token (a complete one equals its reference, a cut or
abandoned one is a prefix of it), the rolling restart failed none, the overload refused with
429 only and lost nothing, the slowloris connections were all closed, blocks all freed, RSS
and fds within tolerance. Prints a table; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.testing.processes import free_port, spawn, stop, tail, wait_for_cache_free, wait_healthy
from tandem.testing.random_checkpoint import save_tiny_word_model
from tandem.testing.streams import Balancer, StreamResult

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


def check(result: StreamResult, reference: str, abandoned: bool) -> str | None:
    """Why ``result`` lost or duplicated tokens (or failed where it should not), or None."""
    if result.done and result.error is None:
        return None if result.text == reference else "complete but not equal to its reference"
    if not reference.startswith(result.text):
        return "not a prefix of its reference"
    if abandoned or (result.error or "").startswith("stream cut"):
        return None  # the client left, or its server was killed: what came is right
    return f"failed: {result.error}"


async def rolling_restart(
    deployment: Deployment, balancer: Balancer, prompts: list[list[int]], length: int,
    references: dict[tuple[int, int], str], streams: int,
) -> tuple[int, list[str]]:  # fmt: skip
    failures: list[str] = []
    completed = 0
    done = asyncio.Event()

    async def worker(index: int) -> None:
        nonlocal completed
        turn = index
        while not done.is_set():
            which = turn % len(prompts)
            result = await balancer.stream(body(prompts[which], length), start=turn)
            problem = check(result, references[which, length], abandoned=False)
            if problem is not None:
                failures.append(f"prompt {which}: {problem} ({result.error})")
            completed += 1
            turn += streams

    workers = [asyncio.create_task(worker(i)) for i in range(streams)]
    while completed < streams:
        await asyncio.sleep(0.1)
    reply = await asyncio.to_thread(deployment.command, "rolling-restart")
    if not reply.get("ok"):
        failures.append(f"rolling restart: {reply}")
    done.set()
    await asyncio.gather(*workers)
    return completed, failures


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
        problem = check(result, references[which, length], abandon)
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

    def summary(self) -> str:
        if not self.values:
            return "none"
        ordered = sorted(self.values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return (
            f"p50 {statistics.median(ordered) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
            f"max {ordered[-1] * 1000:.0f} ms (n={len(ordered)})"
        )

    def p(self, quantile: float) -> float:
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


async def timed_stream(
    client: httpx.AsyncClient, url: str, body: dict
) -> tuple[int, float, str, float]:
    """A stream's status, its time to the first text (or to the refusal), its text, and its
    whole time."""
    started = time.monotonic()
    first = 0.0
    text = ""
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            took = time.monotonic() - started
            return r.status_code, took, "", took
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return 599, time.monotonic() - started, text, time.monotonic() - started
            if not first:
                first = time.monotonic() - started
            text += chunk["choices"][0]["text"]
    return 200, first, text, time.monotonic() - started


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


async def overload(
    client: httpx.AsyncClient, deployment: Deployment, prompts: list[list[int]], length: int,
    references: dict[tuple[int, int], str], args: argparse.Namespace,
) -> tuple[list[tuple[str, str, str]], list[str]]:  # fmt: skip
    """The overload run's table rows and failures (section 3 of the module docstring)."""
    url = deployment.urls[0]
    failures: list[str] = []
    unloaded = Latencies()
    for turn in range(args.unloaded_streams):
        which = turn % len(prompts)
        status, ttft, text, _ = await timed_stream(client, url, body(prompts[which], length))
        if status != 200 or text != references[which, length]:
            failures.append(f"unloaded stream {turn}: HTTP {status}")
        unloaded.values.append(ttft)
    admitted, refused, health = Latencies(), Latencies(), Latencies()
    outcomes: Counter[str] = Counter()
    done = asyncio.Event()

    async def overloading_client(index: int) -> None:
        turn = index
        while not done.is_set():
            which = turn % len(prompts)
            server = deployment.urls[turn % len(deployment.urls)]
            status, ttft, text, _ = await timed_stream(client, server, body(prompts[which], length))
            turn += args.overload_clients
            if status == 429:
                refused.values.append(ttft)
                outcomes["429"] += 1
                await asyncio.sleep(args.retry_pause)
            elif status == 200 and text == references[which, length]:
                admitted.values.append(ttft)
                outcomes["complete"] += 1
            else:
                outcomes["lost"] += 1
                failures.append(f"overload stream (prompt {which}): HTTP {status}")

    watcher = asyncio.create_task(watch_health(client, url, done, health))
    clients = [asyncio.create_task(overloading_client(i)) for i in range(args.overload_clients)]
    await asyncio.sleep(args.overload_seconds)
    done.set()
    await asyncio.gather(watcher, *clients)
    if not refused.values:
        failures.append("overload: nothing was refused (is --max-queued-requests set?)")
    ratio = (
        statistics.median(admitted.values) / statistics.median(unloaded.values)
        if admitted.values and unloaded.values
        else float("nan")
    )
    rows = [
        ("overload: unloaded TTFT", unloaded.summary(), "-"),
        (f"overload: admitted TTFT ({args.overload_clients} clients)", admitted.summary(),
         f"p50 {ratio:.1f}x unloaded"),
        ("overload: 429s", refused.summary(),
         "ok" if refused.values and refused.p(0.99) < 0.05 else "SLOW"),
        ("overload: outcomes", ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())),
         "0 lost" if not outcomes["lost"] else f"{outcomes['lost']} LOST"),
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
        status, _, text, took = await timed_stream(client, url, body(prompt, length))
        if status != 200 or text != reference:
            failures.append(f"slowloris: a completion failed meanwhile: HTTP {status}")
        served.values.append(took)
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
            started = time.monotonic()
            balancer = Balancer(client, deployment.urls)
            completed, restart_failures = await rolling_restart(
                deployment, balancer, prompts, lengths[0], references, args.restart_streams
            )
            failures += restart_failures
            rows.append((
                "rolling restart",
                f"{args.restart_streams} steady streams, {completed} completed in "
                f"{time.monotonic() - started:.0f} s, {balancer.retries} refusals retried",
                "0 failed" if not restart_failures else f"{len(restart_failures)} FAILED",
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
    parser.add_argument("--unloaded-streams", type=int, default=20, help="overload: baseline")
    parser.add_argument(
        "--overload-clients", type=int, help="overload (default: twice --max-num-seqs)"
    )
    parser.add_argument("--overload-seconds", type=float, default=60.0)
    parser.add_argument(
        "--retry-pause", type=float, default=0.1, help="overload: seconds after a 429"
    )
    parser.add_argument("--silent", type=int, default=1000, help="slowloris: silent connections")
    parser.add_argument("--drippers", type=int, default=50, help="slowloris: of each kind")
    args = parser.parse_args(argv)
    if args.overload_clients is None:
        seqs = argparse.ArgumentParser(add_help=False)
        seqs.add_argument("--max-num-seqs", type=int, default=256)
        args.overload_clients = 2 * seqs.parse_known_args(engine_args)[0].max_num_seqs
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
