"""The served path as users feel it: streamed requests through the HTTP servers.

    tandem bench serving --model M [--device cuda] --servers 1 4 [--engine-args "..."]
    tandem bench serving --url http://127.0.0.1:8000 [--url ...]
        [--workload random|chat] [--rates 4 16 64 inf | --concurrency 1 16 64]
        [--num-requests 256] [--runs 1] [--client-processes 8]
        [--slo-ttft-ms 500] [--slo-tpot-ms 50] [--json FILE] [--plot FILE.png] [--profile DIR]

It starts an engine and N servers itself (for each N of --servers, against the same engine)
or takes the URLs of running servers; requests go to the servers in turn.

Workloads:
- random: prompts of random token ids, input and output lengths uniform in [100, 1024]
  (--min-len, --max-len), ignore_eos, over /v1/completions: the offline benchmark's.
- chat: multi-turn conversations over /v1/chat/completions: one system prompt all share
  (--system-words), then --turns user turns of --user-words random words each, every turn
  sent with the whole history (the assistant's answers as returned), --chat-output-len
  tokens a turn: the prefix cache finds the system prompt and the earlier turns.
  --num-requests counts turns.

Modes: Poisson arrivals at each of --rates (requests, or conversations, a second; inf: all
at once), or --concurrency C: C requests (conversations) in flight at all times.

Each level reports TTFT, TPOT (a request's time after its first token over its other
tokens), ITL (the gaps between streamed chunks) and end-to-end latency at p50/p90/p99,
output tokens per second, and goodput: the requests meeting the SLO (TTFT and TPOT) a
second, and their output tokens a second.

--runs N runs each level N times: the same lengths and arrival times, prompts of each run's
own (every level and every run draws from a seed of its own, so that no run finds an earlier
one's prompts in the prefix cache). Each run prints its row; with N > 1 a "median of N" row
follows (each column's median over the runs) and a "range of N" row (the least and greatest
output tokens per second), as tandem/bench/offline.py prints them.

Requests are sent by --client-processes processes (default 8) with aiohttp, so that the
client is not what is measured. Each row reports the client's own cost: its CPU per
streamed chunk ("client us/chunk") and its busiest process's CPU over its wall time
("client busy"); near 100%, the client, not the servers, sets the figures: add processes.
aiohttp parses HTTP in C: a chunk costs a client process a fraction of what it cost with
httpx, which this script used before (its HTTP/1.1 stack and the event loop), and with which
the client, not the servers, capped a small model's throughput at a few servers; the two
columns above measure it on any machine.

The servers' own cost, where this script starts them: their CPU per streamed chunk ("server
us/chunk") and per output token ("us/tok"; fewer chunks than tokens where a busy server merged
a request's waiting outputs into one chunk), and the busiest one's CPU over the level's time.
--profile DIR records them with py-spy during each run (DIR/SERVERS-servers-LEVEL-RUN-server-I.txt,
raw stacks for a flame graph) and prints the functions their CPU went to.

--json writes every run's figures ("levels") and each level's medians over its runs
("medians": each figure's median, errors summed over the runs, and output_tok_s_median,
output_tok_s_min, output_tok_s_max); --plot draws the medians' TTFT and TPOT against output
tokens per second, one line per server count (with matplotlib, when it is installed: the
script says when it is not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from tandem.bench.py_spy import Recording, print_top_functions
from tandem.testing.processes import free_port, spawn, stop, tail, wait_healthy


@dataclass
class Turn:
    """One request: a completion prompt of token ids, or a chat user message."""

    max_tokens: int
    prompt: list[int] | None = None
    user_text: str | None = None


@dataclass
class Session:
    """Requests sent one after the other (a conversation), or a single one."""

    turns: list[Turn]
    system_text: str | None = None


@dataclass
class Result:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    finished_at: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


def random_workload(
    args: argparse.Namespace, lengths: random.Random, ids: random.Random
) -> list[Session]:
    """Requests of input and output lengths drawn from ``lengths``, prompts from ``ids``."""
    sessions = []
    for _ in range(args.num_requests):
        input_len = lengths.randint(args.min_len, args.max_len)
        output_len = lengths.randint(args.min_len, args.max_len)
        prompt = [ids.randrange(args.min_token_id, args.max_token_id) for _ in range(input_len)]
        sessions.append(Session([Turn(output_len, prompt=prompt)]))
    return sessions


def chat_workload(
    args: argparse.Namespace, lengths: random.Random, ids: random.Random
) -> list[Session]:
    """Conversations of the lengths the flags give (``lengths`` is unused), words from ``ids``."""

    def words(count: int) -> str:
        return " ".join(
            f"w{ids.randrange(args.min_token_id, args.max_token_id)}" for _ in range(count)
        )

    system = words(args.system_words)
    conversations = math.ceil(args.num_requests / args.turns)
    return [
        Session(
            [
                Turn(args.chat_output_len, user_text=words(args.user_words))
                for _ in range(args.turns)
            ],
            system_text=system,
        )
        for _ in range(conversations)
    ]


async def _stream(
    client: aiohttp.ClientSession, url: str, body: dict, history: list[dict] | None
) -> Result:
    """Send one streamed request; time its chunks. A chat answer joins ``history``."""
    path = "/v1/completions" if history is None else "/v1/chat/completions"
    result = Result()
    text: list[str] = []
    sent = time.perf_counter()
    last = None
    try:
        async with client.post(url + path, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time, with its newline
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                piece = choice.get("text") if history is None else choice["delta"].get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - sent
                else:
                    result.itls_s.append(now - last)
                last = now
                text.append(piece)
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a line over 128 KiB
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - sent
    result.finished_at = time.time()
    if history is not None:
        history.append({"role": "assistant", "content": "".join(text)})
    return result


async def _run_session(
    client: aiohttp.ClientSession, url: str, model: str, session: Session
) -> list[Result]:
    results = []
    history = None
    if session.system_text is not None:
        history = [{"role": "system", "content": session.system_text}]
    for turn in session.turns:
        body: dict = {
            "model": model,
            "max_tokens": turn.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0,
        }
        if history is None:
            body["prompt"] = turn.prompt
        else:
            history.append({"role": "user", "content": turn.user_text})
            body["messages"] = list(history)
        results.append(await _stream(client, url, body, history))
        if results[-1].error:
            break
    return results


@dataclass
class ClientShare:
    """What one client process got, and what it cost: its CPU seconds over its wall seconds
    from the level's start to its last answer."""

    results: list[Result]
    cpu_s: float
    wall_s: float


async def _client(
    jobs: list[tuple[float, str, Session]], model: str, start_at: float, concurrency: int | None
) -> ClientShare:
    """Run this process's sessions: each at its arrival time, or ``concurrency`` at a time."""
    # No cap on connections (limit=0) and no timeout: every session runs at its arrival.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        if concurrency is None:

            async def arrive(offset: float, url: str, session: Session) -> list[Result]:
                await asyncio.sleep(max(0.0, start_at + offset - time.time()))
                return await _run_session(client, url, model, session)

            done = await asyncio.gather(*(arrive(*job) for job in jobs))
        else:
            queue = list(reversed(jobs))

            async def worker() -> list[list[Result]]:
                mine = []
                while queue:
                    _, url, session = queue.pop()
                    mine.append(await _run_session(client, url, model, session))
                return mine

            done = [
                s for w in await asyncio.gather(*(worker() for _ in range(concurrency))) for s in w
            ]
        cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    return ClientShare([r for session in done for r in session], cpu_s, wall_s)


def _client_process(args: tuple) -> ClientShare:
    return asyncio.run(_client(*args))


def run_level(
    urls: list[str],
    model: str,
    sessions: list[Session],
    rate: float | None,
    concurrency: int | None,
    processes: int,
    seed: int,
) -> tuple[list[ClientShare], float]:
    """Every session, by Poisson arrivals at ``rate`` or ``concurrency`` at a time; each
    client process's share and the seconds from the first arrival to the last answer."""
    rng = random.Random(seed)
    offset = 0.0
    jobs = []
    for i, session in enumerate(sessions):
        jobs.append((offset, urls[i % len(urls)], session))
        if rate is not None and math.isfinite(rate):
            offset += rng.expovariate(rate)
    processes = min(processes, len(jobs), concurrency or len(jobs))
    start_at = time.time() + 1.0  # every client process is up by then
    shares = [
        (
            jobs[p::processes],
            model,
            start_at,
            None if concurrency is None else max(1, concurrency // processes),
        )
        for p in range(processes)
    ]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        clients = pool.map(_client_process, shares)
    finished = [r.finished_at for c in clients for r in c.results if r.error is None]
    return clients, (max(finished) if finished else time.time()) - start_at


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p90": at(0.9), "p99": at(0.99)}


def summarize(
    clients: list[ClientShare], seconds: float, slo_ttft_s: float, slo_tpot_s: float
) -> dict:
    results = [r for c in clients for r in c.results]
    good = [r for r in results if r.error is None]
    chunks = sum(len(r.itls_s) + 1 for r in good)
    meeting = [r for r in good if r.ttft_s <= slo_ttft_s and r.tpot_s <= slo_tpot_s]
    output_tokens = sum(r.output_tokens for r in good)
    return {
        "requests": len(results),
        "errors": len(results) - len(good),
        "first_error": next((r.error for r in results if r.error), None),
        "seconds": seconds,
        "prompt_tokens": sum(r.prompt_tokens for r in good),
        "output_tokens": output_tokens,
        "chunks": chunks,
        "output_tok_s": output_tokens / seconds,
        "request_s": len(good) / seconds,
        "goodput_request_s": len(meeting) / seconds,
        "goodput_tok_s": sum(r.output_tokens for r in meeting) / seconds,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft_s for r in good]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles([r.tpot_s for r in good]).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([g for r in good for g in r.itls_s]).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.e2e_s for r in good]).items()},
        # The client's own cost: when its busiest process nears 100%, the client, not the
        # servers, sets the figures (add --client-processes).
        "client_us_per_chunk": sum(c.cpu_s for c in clients) / max(chunks, 1) * 1e6,
        "client_busy": max((c.cpu_s / c.wall_s for c in clients if c.wall_s > 0), default=0.0),
    }


def cpu_seconds(pids: list[int]) -> list[float]:
    """Each process's user and system CPU seconds so far (Linux: /proc/PID/stat)."""
    seconds = []
    for pid in pids:
        # Fields after the parenthesized command name: utime and stime are the 12th and 13th.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds.append((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return seconds


def server_cost(
    before: list[float], after: list[float], seconds: float, chunks: int, tokens: int
) -> dict:
    """The servers' CPU per streamed chunk and per output token (a chunk carries several
    tokens where a server fell behind and merged them: server/output_mailbox.py), and the
    busiest one's CPU over the level's time (near 100%: the servers set the figures). NaN for
    servers this script did not start."""
    if not before:
        return {
            "server_us_per_chunk": math.nan,
            "server_us_per_token": math.nan,
            "server_busy": math.nan,
        }
    used = [b - a for a, b in zip(before, after, strict=True)]
    return {
        "server_us_per_chunk": sum(used) / max(chunks, 1) * 1e6,
        "server_us_per_token": sum(used) / max(tokens, 1) * 1e6,
        "server_busy": max(used) / seconds,
    }


@contextlib.contextmanager
def profiled(folder: Path | None, name: str, pids: list[int]) -> Iterator[list[Path]]:
    """With ``folder``, py-spy records each process of ``pids`` for the block's time, into
    ``folder``/``name``-server-I.txt: the files' paths, written once the block is left."""
    if folder is None:
        yield []
        return
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}-server-{i}.txt" for i in range(len(pids))]
    with contextlib.ExitStack() as recordings:
        for pid, path in zip(pids, paths, strict=True):
            recordings.enter_context(Recording(pid, path))
        yield paths


def engine_prompt_tokens(url: str) -> tuple[int, int]:
    """The engine's prompt tokens so far: those computed, and those its prefix cache held."""
    # /stats asks the engine now (/health has its last heartbeat's, up to a second old).
    stats = httpx.get(f"{url}/stats", timeout=10).json()
    return stats["num_prompt_tokens"], stats["num_cached_prompt_tokens"]


def print_level(servers: int, level: str, s: dict) -> None:
    def trio(name: str) -> str:
        p = s[name]
        return f"{p['p50']:8.1f} {p['p90']:8.1f} {p['p99']:8.1f}"

    errors = f"  {s['errors']} errors, e.g. {s['first_error']}" if s["errors"] else ""
    print(
        f"{servers:7d} {level:>11} {s['output_tok_s']:9.0f} {s['goodput_tok_s']:9.0f} "
        f"{s['goodput_request_s']:7.2f} {trio('ttft_ms')} {trio('tpot_ms')} {trio('itl_ms')} "
        f"{trio('e2e_ms')} {s['prefix_cache_hit']:7.0%} {s['client_busy']:7.0%} "
        f"{s['client_us_per_chunk']:7.1f} {s['server_busy']:7.0%} "
        f"{s['server_us_per_chunk']:7.1f} {s['server_us_per_token']:7.1f}{errors}"
    )


def print_range(servers: int, runs: list[dict], spread: Callable) -> None:
    """The "range of N" row: the least and greatest output tokens per second of ``runs``."""
    values = [r["output_tok_s"] for r in runs]
    print(f"{servers:7d} {f'range of {len(runs)}':>11} {spread(values, '.0f'):>9}")


def median_row(runs: list[dict], extremes: Callable) -> dict:
    """A level's figures over its ``runs``: each figure's median (of each percentile), the
    errors summed, the first error, and output_tok_s_median, _min and _max."""
    row: dict = {"servers": runs[0]["servers"], "level": runs[0]["level"], "runs": len(runs)}
    for key, value in runs[0].items():
        if key in row or key in ("run", "errors", "first_error"):
            continue
        if isinstance(value, dict):
            row[key] = {p: statistics.median(r[key][p] for r in runs) for p in value}
        else:
            row[key] = statistics.median(r[key] for r in runs)
    row["errors"] = sum(r["errors"] for r in runs)
    row["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), None)
    row["output_tok_s_median"] = row["output_tok_s"]
    return row | extremes("output_tok_s", [r["output_tok_s"] for r in runs])


def print_header() -> None:
    trio = f"{'p50':>8} {'p90':>8} {'p99':>8}"
    print(
        f"\n{'':7} {'':>11} {'output':>9} {'goodput':>9} {'goodput':>7} "
        f"{'TTFT (ms)':^26} {'TPOT (ms)':^26} {'ITL (ms)':^26} {'E2E (ms)':^26} {'prefix':>7} "
        f"{'client':>7} {'client':>7} {'server':>7} {'server':>7} {'server':>7}"
    )
    print(
        f"{'servers':>7} {'level':>11} {'tok/s':>9} {'tok/s':>9} {'req/s':>7} "
        + (trio + " ") * 4
        + f"{'cached':>7} {'busy':>7} {'us/chunk':>7} {'busy':>7} {'us/chunk':>7} {'us/tok':>7}"
    )


def plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib); not writing {path}")
        return
    figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for servers in sorted({row["servers"] for row in rows}):
        mine = sorted((r for r in rows if r["servers"] == servers), key=lambda r: r["output_tok_s"])
        x = [r["output_tok_s"] for r in mine]
        label = f"{servers} server{'s' if servers > 1 else ''}"
        ttft_axis.plot(x, [r["ttft_ms"]["p50"] for r in mine], marker="o", label=f"{label}, p50")
        ttft_axis.plot(
            x, [r["ttft_ms"]["p99"] for r in mine], marker="x", ls="--", label=f"{label}, p99"
        )
        tpot_axis.plot(x, [r["tpot_ms"]["p50"] for r in mine], marker="o", label=f"{label}, p50")
        tpot_axis.plot(
            x, [r["tpot_ms"]["p99"] for r in mine], marker="x", ls="--", label=f"{label}, p99"
        )
    for axis, name in ((ttft_axis, "TTFT (ms)"), (tpot_axis, "TPOT (ms)")):
        axis.set_xlabel("output tokens / s")
        axis.set_ylabel(name)
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("tandem: latency against throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


class Cluster:
    """An engine this script started, and the servers in front of it now."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-serving-"))
        self.address = f"ipc://{self.workdir}/engine.sock"
        self.log = self.workdir / "cluster.log"
        command = [sys.executable, "-m", "engine", "--address", self.address, "--model", args.model]
        command += ["--device", args.device, *shlex.split(args.engine_args)]
        self.engine = spawn(command, self.log)
        self.servers: list = []
        self.urls: list[str] = []

    def start_servers(self, count: int) -> list[str]:
        self.stop_servers()
        port = free_port(count)
        for i in range(count):
            command = [sys.executable, "-m", "server", "--engine", self.address]
            self.servers.append(spawn([*command, "--port", str(port + i)], self.log))
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(count)]
        for url in self.urls:  # the first also waits for the engine to load
            wait_healthy(url, [self.engine, *self.servers], self.log)
        return self.urls

    def stop_servers(self) -> None:
        for server in self.servers:
            stop(server)
        self.servers, self.urls = [], []

    def close(self) -> None:
        self.stop_servers()
        stop(self.engine)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", action="append", default=[], help="a running server (repeat)")
    parser.add_argument("--model", help="start an engine with this model (no --url)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--engine-args", default="", help="more engine flags, one string")
    parser.add_argument("--servers", type=int, nargs="+", default=[1], help="server counts")
    parser.add_argument("--workload", choices=["random", "chat"], default="random")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--min-token-id", type=int, default=10)
    parser.add_argument(
        "--max-token-id", type=int, default=30000, help="random ids below it (the vocabulary's)"
    )
    parser.add_argument("--system-words", type=int, default=1000)
    parser.add_argument("--user-words", type=int, default=100)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--chat-output-len", type=int, default=200)
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("--rates", type=float, nargs="+", help="Poisson arrival rates (inf ok)")
    levels.add_argument("--concurrency", type=int, nargs="+", help="requests in flight")
    parser.add_argument("--slo-ttft-ms", type=float, default=500)
    parser.add_argument("--slo-tpot-ms", type=float, default=50)
    parser.add_argument("--runs", type=int, default=1, help="runs of each level (default 1)")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=8,
        help="processes sending the requests (default 8); the 'client busy' column says "
        "when they are too few",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        type=Path,
        help="record the servers this script starts with py-spy during each run, into this "
        "folder (raw stacks, for flame graphs), and print where their CPU went",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency against throughput")
    args = parser.parse_args(argv)
    if bool(args.url) == bool(args.model):
        parser.error("give --url (running servers) or --model (start them here), not both")
    if args.profile and not args.model:
        parser.error("--profile records the servers this script starts (--model)")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    # Here, not at the top: every client process imports this module, and tandem.bench.offline
    # imports torch and the engine (seconds).
    from tandem.bench.offline import extremes, spread

    rates = args.rates if args.rates or args.concurrency else [math.inf]

    cluster = Cluster(args) if args.model else None
    server_counts = args.servers if cluster else [len(args.url)]
    workload = random_workload if args.workload == "random" else chat_workload
    rows = []  # every run's
    medians = []  # every level's, over its runs
    try:
        print_header()
        for servers in server_counts:
            urls = cluster.start_servers(servers) if cluster else args.url
            server_pids = [server.pid for server in cluster.servers] if cluster else []
            model = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
            for value in args.concurrency or rates:
                concurrency = value if args.concurrency else None
                rate = None if args.concurrency else value
                level = f"conc {value}" if args.concurrency else f"rate {value:g}/s"
                runs = []
                for run in range(args.runs):
                    # A level's lengths, the same in each of its runs, and prompts of each
                    # run's own: an engine that served a run's prompts would find them all in
                    # its prefix cache at the next. The seeds are strings, each level's and
                    # each run's unlike any other's, under any --seed.
                    key = f"seed {args.seed}, level {len(medians)}"
                    lengths = random.Random(key)
                    ids = random.Random(f"{key}, run {run}")
                    sessions = workload(args, lengths, ids)
                    before = engine_prompt_tokens(urls[0])
                    name = (
                        f"{servers}-servers-{level.replace(' ', '-').replace('/s', '')}-{run + 1}"
                    )
                    with profiled(args.profile, name, server_pids) as profiles:
                        servers_cpu = cpu_seconds(server_pids)
                        clients, seconds = run_level(
                            urls,
                            model,
                            sessions,
                            rate,
                            concurrency,
                            args.client_processes,
                            args.seed,
                        )
                        servers_cpu_after = cpu_seconds(server_pids)
                    summary = summarize(
                        clients, seconds, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
                    )
                    summary |= server_cost(
                        servers_cpu,
                        servers_cpu_after,
                        seconds,
                        summary["chunks"],
                        summary["output_tokens"],
                    )
                    after = engine_prompt_tokens(urls[0])
                    computed, cached = (b - a for a, b in zip(before, after, strict=True))
                    looked_up = computed + cached
                    summary["prefix_cache_hit"] = cached / looked_up if looked_up else 0.0
                    print_level(servers, level, summary)
                    if profiles:
                        print_top_functions(profiles)
                    runs.append({"servers": servers, "level": level, "run": run + 1, **summary})
                rows += runs
                medians.append(median_row(runs, extremes))
                if args.runs > 1:
                    print_level(servers, f"median of {args.runs}", medians[-1])
                    print_range(servers, runs, spread)
    except Exception:
        if cluster:
            print(tail(cluster.log))
        raise
    finally:
        if cluster:
            cluster.close()
    print(
        f"\nworkload {args.workload}, {args.num_requests} requests; SLO: TTFT <= "
        f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "levels": rows,
                    "medians": medians,
                },
                indent=1,
            )
        )
    if args.plot:
        plot(args.plot, medians)  # a run's own figures where there is one run


if __name__ == "__main__":
    main()
