"""Run M engine replicas and N HTTP servers, keep them running, restart the servers one by one.

    tandem serve [--model M] [--servers N] [--port P] [--device cpu|cuda]
                 [--host H] [--engine-address ADDR] [--drain-timeout S]
                 [--tensor-parallel-size T] [--data-parallel-size M]
                 [--gpus LIST] [--server-args "ARGS"] [--control PATH]
                 [-- ENGINE_ARGS...]
    tandem serve --rolling-restart [--port P | --control PATH]
    tandem serve --status [--port P | --control PATH]

(``scripts/start_distributed.sh`` runs this too, and ``python -m tandem.supervisor``.) Server
i listens on port P+i; ``--server-args`` go to every ``python -m server``, arguments after
``--`` to every ``python -m engine``.

- Data parallelism: ``--data-parallel-size M`` starts M engine replicas of the model, and every
  server spreads its requests over all of them (server/engine_pool.py). Replica r runs on GPUs
  r*T .. r*T+T-1 of ``--gpus`` (default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi
  lists), T being the tensor-parallel size, through CUDA_VISIBLE_DEVICES in its environment;
  a GPU listed twice is shared (then size each replica's cache: ``-- --kv-cache-memory-gb G``).
  Replica r binds ADDR with r added to its port (tcp://H:PORT) or "-r" appended to its path
  (ipc://PATH); ADDR may also list the M addresses, separated by commas. With CURVE, the
  replicas share one key pair (the engine arguments after ``--`` go to each).

- A process that exits during start-up stops everything (its log says why). Afterwards a
  process that exits is started again, after 1 s, then 2, 4, ... up to 30 s while it keeps
  failing (the delay starts over once it has run a minute), each engine replica on its own;
  the engines keep their weights while servers come and go, and servers reconnect to a
  restarted engine by themselves (with replicas, the others take its share meanwhile).
- A rolling restart (``--rolling-restart`` against a running supervisor, or SIGHUP to it)
  restarts the servers in turn: SIGTERM (the server drains: /ready 503, new requests 503,
  streams finish, up to ``--drain-timeout``, default 600 s), start it again, wait until its
  /ready answers 200 and it carries its share of the requests in flight (half of an even
  share, or there are none; at most ``--share-timeout`` s), then the next: the servers left
  are never the only ones a balancer still sends to. Behind a load balancer that follows
  /ready and retries a 503 or a refused connection on another server, no request fails.
- SIGTERM or SIGINT stops everything: the servers first (they drain), then the engines.

The control socket (default ``$TMPDIR/tandem-supervisor-P.sock``) takes one JSON line,
``{"command": "status"}`` or ``{"command": "rolling-restart"}``, and answers one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.flags import bounded
from tandem import REPO_ROOT

logger = logging.getLogger("supervisor")

_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_STABLE_AFTER_S = 60.0  # a process that ran this long starts its backoff over
_START_TIMEOUT_S = 900.0  # a server waits for the engine's handshake (weights loading)
_STOP_MARGIN_S = 15.0  # past a drain timeout, before SIGKILL
_HEALTH_POLL_S = 0.25
# A restarted server has taken its share once it carries this much of an even share of the
# requests in flight (new requests reach it as those on the others end).
_SHARE = 0.5
_PR_SET_PDEATHSIG = 1  # prctl(2)


@dataclass
class Child:
    """One supervised process: how to start it, and its current incarnation."""

    name: str
    argv: list[str]
    health: tuple[str, int] | None = None  # (host, port) of its /ready; None: the engine
    stop_timeout_s: float = 30.0  # how long it may take to exit on SIGTERM
    address: str | None = None  # an engine's ZeroMQ address
    gpus: str | None = None  # an engine's CUDA_VISIBLE_DEVICES; None: the supervisor's
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    replace: bool = False  # its next exit is a restart we asked for
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def status(self) -> dict[str, Any]:
        running = self.process is not None and self.process.returncode is None
        return {
            "name": self.name,
            "pid": self.process.pid if running and self.process is not None else None,
            "ready": self.ready.is_set(),
            "restarts": self.restarts,
            **({"port": self.health[1]} if self.health else {}),
            **({"address": self.address} if self.address else {}),
            **({"gpus": self.gpus} if self.gpus else {}),
        }


def _die_with_supervisor() -> None:
    """Run in a child before it starts: SIGTERM it when the supervisor dies, even by SIGKILL
    (its own process group keeps it from the supervisor's group signals), so that no engine
    or server outlives the supervisor holding a GPU or a port. Linux's prctl; elsewhere,
    nothing."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(
        self, engines: list[Child], servers: list[Child], share_timeout_s: float = 120.0
    ) -> None:
        self.engines = engines
        self.servers = servers
        self.share_timeout_s = share_timeout_s
        self.stopping = False
        self.started = False  # all ready once: from then on, exits are restarted
        self.startup_failed = asyncio.Event()
        self.rolling = asyncio.Lock()

    @property
    def children(self) -> list[Child]:
        return self.engines + self.servers

    async def run(self) -> int:
        tasks = [asyncio.create_task(self._keep_alive(child)) for child in self.children]
        ready = asyncio.gather(*(server.ready.wait() for server in self.servers))
        failed = asyncio.create_task(self.startup_failed.wait())
        await asyncio.wait([ready, failed], return_when=asyncio.FIRST_COMPLETED)
        if self.startup_failed.is_set():
            ready.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ready
            await self.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            return 1
        failed.cancel()
        self.started = True
        logger.info("started: from now on, a process that exits is started again")
        await asyncio.gather(*tasks)
        return 0

    async def _keep_alive(self, child: Child) -> None:
        backoff = _FIRST_BACKOFF_S
        while not self.stopping:
            process = await self._start(child)
            health = asyncio.create_task(self._watch_health(child, process))
            code = await process.wait()
            health.cancel()
            child.ready.clear()
            if self.stopping:
                return
            if child.replace:  # a rolling restart: straight back
                child.replace = False
                child.restarts += 1
                continue
            if not self.started:
                logger.error("%s exited with %s during start-up; stopping", child.name, code)
                self.startup_failed.set()
                return
            if time.monotonic() - child.started_at > _STABLE_AFTER_S:
                backoff = _FIRST_BACKOFF_S
            logger.error("%s exited with %s; starting it again in %g s", child.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
            child.restarts += 1

    async def _start(self, child: Child) -> asyncio.subprocess.Process:
        # A process group of its own: a Ctrl-C or a SIGTERM to the supervisor's group reaches
        # the supervisor alone, which stops the servers (draining) before the engine.
        env = None if child.gpus is None else {**os.environ, "CUDA_VISIBLE_DEVICES": child.gpus}
        child.process = await asyncio.create_subprocess_exec(
            *child.argv, cwd=REPO_ROOT, process_group=0, env=env, preexec_fn=_die_with_supervisor
        )
        child.started_at = time.monotonic()
        logger.info("%s started (pid %d)", child.name, child.process.pid)
        return child.process

    async def _watch_health(self, child: Child, process: asyncio.subprocess.Process) -> None:
        """Sets ``child.ready`` once this incarnation's /ready answers 200 (the engine: now)."""
        if child.health is None:
            child.ready.set()
            return
        deadline = time.monotonic() + _START_TIMEOUT_S
        while process.returncode is None and time.monotonic() < deadline:
            if await http_status(*child.health, "/ready") == 200:
                if child.process is process:
                    child.ready.set()
                    logger.info("%s ready (pid %d)", child.name, process.pid)
                return
            await asyncio.sleep(_HEALTH_POLL_S)

    async def rolling_restart(self) -> dict[str, Any]:
        """Restarts each server in turn, each once the one before serves again."""
        if self.rolling.locked():
            return {"ok": False, "error": "a rolling restart is already running"}
        async with self.rolling:
            restarted = []
            for child in self.servers:
                if self.stopping:
                    return {"ok": False, "error": "stopping", "restarted": restarted}
                logger.info("rolling restart: %s", child.name)
                old = child.process
                if old is not None and old.returncode is None:
                    child.replace = True
                    await terminate(old, child.stop_timeout_s)
                try:
                    await asyncio.wait_for(self._ready_again(child, old), _START_TIMEOUT_S)
                except TimeoutError:
                    error = f"{child.name} did not come back in {_START_TIMEOUT_S:g} s"
                    logger.error("rolling restart stopped: %s", error)
                    return {"ok": False, "error": error, "restarted": restarted}
                if child is not self.servers[-1]:
                    await self._taken_share(child)
                restarted.append(child.status())
            logger.info("rolling restart done: %d servers", len(restarted))
            return {"ok": True, "restarted": restarted}

    async def _taken_share(self, child: Child) -> None:
        """Returns once ``child`` carries its share of the requests in flight (``_SHARE`` of
        an even share; at once if there are none), or after ``share_timeout_s``."""
        deadline = time.monotonic() + self.share_timeout_s
        while time.monotonic() < deadline:
            loads = await asyncio.gather(
                *(requests_in_flight(*server.health) for server in self.servers if server.health)
            )
            mine = await requests_in_flight(*child.health) if child.health else None
            total = sum(load or 0 for load in loads)
            if mine is not None and mine >= _SHARE * total / len(self.servers):
                logger.info("%s carries %d of %d requests in flight", child.name, mine, total)
                return
            await asyncio.sleep(_HEALTH_POLL_S)
        logger.warning(
            "%s did not take its share of the requests in %g s; going on",
            child.name,
            self.share_timeout_s,
        )

    @staticmethod
    async def _ready_again(child: Child, old: asyncio.subprocess.Process | None) -> None:
        while child.process is old or not child.ready.is_set():
            await asyncio.sleep(_HEALTH_POLL_S)

    async def stop(self) -> None:
        """Servers first (they drain), then the engines."""
        if self.stopping:
            return
        self.stopping = True
        logger.info("stopping: servers first, then the engines")
        for group in (self.servers, self.engines):
            await asyncio.gather(
                *(terminate(c.process, c.stop_timeout_s) for c in group if c.process is not None)
            )

    def status(self) -> dict[str, Any]:
        return {
            "ok": True,
            "engines": [c.status() for c in self.engines],
            "servers": [c.status() for c in self.servers],
            "rolling_restart": self.rolling.locked(),
        }

    async def serve_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            command = json.loads(await reader.readline()).get("command")
            if command == "status":
                reply = self.status()
            elif command == "rolling-restart":
                reply = await self.rolling_restart()
            else:
                reply = {"ok": False, "error": f"unknown command {command!r}"}
        except (ValueError, AttributeError) as exc:
            reply = {"ok": False, "error": f"bad command: {exc}"}
        writer.write(json.dumps(reply).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


async def terminate(process: asyncio.subprocess.Process, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited ``timeout_s`` (plus a margin) later."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout_s + _STOP_MARGIN_S)
    except TimeoutError:
        logger.warning("pid %d did not stop in time: killing it", process.pid)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET ``path``: the status and the body. Raises OSError, TimeoutError or ValueError if
    the server does not answer, or not in HTTP."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), timeout)
        head, _, body = response.partition(b"\r\n\r\n")
        status = head.split(maxsplit=2)[1:2]
        if not status:
            raise ValueError("not an HTTP response")
        return int(status[0]), body
    finally:
        if writer is not None:
            writer.close()


async def http_status(host: str, port: int, path: str) -> int | None:
    """The status of GET ``path``, or None if the server does not answer."""
    try:
        return (await http_get(host, port, path))[0]
    except (OSError, TimeoutError, ValueError):
        return None


async def requests_in_flight(host: str, port: int) -> int | None:
    """The requests a server has in flight (its /ready says), or None if it is not ready."""
    try:
        status, body = await http_get(host, port, "/ready")
        return int(json.loads(body)["requests_in_flight"]) if status == 200 else None
    except (OSError, TimeoutError, ValueError, KeyError, TypeError):
        return None


def control_path(args: argparse.Namespace) -> Path:
    if args.control is not None:
        return Path(args.control)
    return Path(tempfile.gettempdir()) / f"tandem-supervisor-{args.port}.sock"


async def send_command(path: Path, command: str) -> dict[str, Any]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(json.dumps({"command": command}).encode() + b"\n")
    await writer.drain()
    reply = json.loads(await reader.readline())
    writer.close()
    return reply


class UsageError(Exception):
    """Options that do not fit together; the supervisor says why and exits with status 2."""


def engine_addresses(args: argparse.Namespace) -> list[str]:
    """Each replica's address: ``--engine-address`` as a list, or numbered from it (or from a
    default ipc:// path in $TMPDIR)."""
    replicas, given = args.data_parallel_size, args.engine_address
    if given and "," in given:
        addresses = [address for address in given.split(",") if address]
        if len(addresses) != replicas:
            raise UsageError(
                f"--engine-address lists {len(addresses)} addresses for {replicas} replicas"
            )
        return addresses
    if replicas == 1:
        return [given or f"ipc://{tempfile.gettempdir()}/tandem-engine-{os.getpid()}.sock"]
    if not given:
        base = f"ipc://{tempfile.gettempdir()}/tandem-engine-{os.getpid()}"
        return [f"{base}-{r}.sock" for r in range(replicas)]
    host, _, port = given.rpartition(":")
    if given.startswith("tcp://") and port.isdigit():
        return [f"{host}:{int(port) + r}" for r in range(replicas)]
    return [f"{given}-{r}" for r in range(replicas)]


def gpu_sets(args: argparse.Namespace, tensor_parallel_size: int) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES; None where it sees what the supervisor sees (one
    replica and no --gpus, the CPU, or no GPU list to split)."""
    replicas = args.data_parallel_size
    if (replicas == 1 and args.gpus is None) or args.device == "cpu":
        return [None] * replicas
    gpus = args.gpus or os.environ.get("CUDA_VISIBLE_DEVICES") or visible_gpus()
    if not gpus:
        return [None] * replicas
    gpu_list = gpus.split(",")
    needed = replicas * tensor_parallel_size
    if len(gpu_list) < needed:
        raise UsageError(
            f"{replicas} replicas of {tensor_parallel_size} GPU(s) need {needed} GPUs; there "
            f"are {len(gpu_list)} ({gpus}); --gpus may list one twice to share it"
        )
    size = tensor_parallel_size
    return [",".join(gpu_list[r * size : (r + 1) * size]) for r in range(replicas)]


def visible_gpus() -> str:
    """The indices nvidia-smi lists, separated by commas; empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return ""
    listed = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return ",".join(line.strip() for line in listed.stdout.splitlines() if line.strip())


def engine_option(engine_args: list[str], flag: str, kind: type, default: Any) -> Any:
    """An engine flag's value among the arguments after ``--``, else ``default``."""
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument(flag, type=kind, default=default, dest="value")
    return engine.parse_known_args(engine_args)[0].value


def tensor_parallel_size(args: argparse.Namespace, engine_args: list[str]) -> int:
    """The supervisor's --tensor-parallel-size, or the engine's if given after ``--``."""
    if args.tensor_parallel_size:
        return args.tensor_parallel_size
    return engine_option(engine_args, "--tensor-parallel-size", int, 1)


def build_children(args: argparse.Namespace, engine_args: list[str]) -> Supervisor:
    python = sys.executable
    addresses = engine_addresses(args)
    gpus = gpu_sets(args, tensor_parallel_size(args, engine_args))
    engine_argv = [python, "-m", "engine"]
    if args.model:
        engine_argv += ["--model", args.model]
    if args.device:
        engine_argv += ["--device", args.device]
    if args.tensor_parallel_size:
        engine_argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    # An engine given a longer --drain-timeout than the time it may take to exit is let
    # finish its drain: cut at that time, its last requests would end without their answer.
    drain_s = engine_option(engine_args, "--drain-timeout", float, 0.0)
    stop_timeout_s = max(Child.stop_timeout_s, drain_s)
    engines = []
    for replica, (address, replica_gpus) in enumerate(zip(addresses, gpus, strict=True)):
        name = "engine" if len(addresses) == 1 else f"engine replica {replica}"
        argv = [*engine_argv, "--address", address, *engine_args]
        engines.append(
            Child(name, argv, address=address, gpus=replica_gpus, stop_timeout_s=stop_timeout_s)
        )
    connect_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    servers = []
    for index in range(args.servers):
        port = args.port + index
        argv = [
            python, "-m", "server", "--engine", ",".join(addresses), "--host", args.host,
            "--port", str(port), "--drain-timeout", str(args.drain_timeout),
            *shlex.split(args.server_args),
        ]  # fmt: skip
        servers.append(Child(f"server {index}", argv, (connect_host, port), args.drain_timeout))
    return Supervisor(engines, servers, args.share_timeout)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    engine_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, engine_args = argv[:split], argv[split + 1 :]
    title, _usage, details = __doc__.split("\n\n", 2)  # argparse writes its own usage
    parser = argparse.ArgumentParser(
        usage="%(prog)s [OPTIONS] [-- ENGINE_ARGS...]\n"
        "       %(prog)s --rolling-restart | --status [--port P | --control PATH]",
        description=f"{title}\n\n{details}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model")
    parser.add_argument(
        "--servers", type=bounded(int, at_least=1), default=1, help="HTTP servers (default: 1)"
    )
    parser.add_argument(
        "--port",
        type=bounded(int, at_least=1, at_most=65535),
        default=8000,
        help="the first server's port, the next ones after it (default: 8000)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument(
        "--host", default="127.0.0.1", help="the servers' HTTP address (default: 127.0.0.1)"
    )
    parser.add_argument("--engine-address", help="default: an ipc:// socket in $TMPDIR")
    parser.add_argument(
        "--tensor-parallel-size",
        type=bounded(int, at_least=1),
        help="GPUs each engine splits the model over (default: the engine arguments' "
        "--tensor-parallel-size, else 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=bounded(int, at_least=1),
        default=1,
        help="engine replicas of the model, each on its own GPUs (default: 1)",
    )
    parser.add_argument(
        "--gpus",
        help="the GPUs to split over the replicas, e.g. 0,1,2,3 (default: "
        "$CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=bounded(float, at_least=0),
        default=600.0,
        help="seconds a stopped server's requests may take to finish (default: 600)",
    )
    parser.add_argument(
        "--share-timeout",
        type=bounded(float, at_least=0),
        default=120.0,
        help="rolling restart: seconds to wait for a restarted server to take its share of "
        "the requests before the next one drains (default: 120)",
    )
    parser.add_argument("--server-args", default="", help="more arguments for every server")
    parser.add_argument("--control", help="the control socket's path")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--rolling-restart", action="store_true")
    action.add_argument("--status", action="store_true")
    return parser.parse_args(argv), engine_args


async def main_async(args: argparse.Namespace, engine_args: list[str]) -> int:
    control = control_path(args)
    if args.rolling_restart or args.status:
        try:
            reply = await send_command(
                control, "rolling-restart" if args.rolling_restart else "status"
            )
        except OSError as exc:
            print(f"no supervisor answers at {control}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(reply, indent=2))
        return 0 if reply.get("ok") else 1

    try:
        supervisor = build_children(args, engine_args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: asyncio.ensure_future(supervisor.stop()))
    loop.add_signal_handler(
        signal.SIGHUP, lambda: asyncio.ensure_future(supervisor.rolling_restart())
    )
    control.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(supervisor.serve_control, str(control))
    try:
        running = asyncio.create_task(supervisor.run())
        while not running.done() and not supervisor.started:
            await asyncio.sleep(0.1)
        if supervisor.started:
            print_ready(supervisor, args)
        return await running
    finally:
        server.close()
        control.unlink(missing_ok=True)


def print_ready(supervisor: Supervisor, args: argparse.Namespace) -> None:
    for engine in supervisor.engines:
        on_gpus = f" (GPUs {engine.gpus})" if engine.gpus else ""
        print(f"{engine.name}{on_gpus} at {engine.address}")
    for index in range(args.servers):
        url = f"http://{args.host}:{args.port + index}"
        print(f"server {index}: {url}  (OpenAI API at {url}/v1)")
    print(
        f"ready; Ctrl-C stops everything; rolling restart of the servers: kill -HUP "
        f"{os.getpid()}, or tandem serve --rolling-restart --port {args.port}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args, engine_args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(asyncio.run(main_async(args, engine_args)))


if __name__ == "__main__":
    main()
