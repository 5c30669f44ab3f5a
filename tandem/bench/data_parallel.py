"""Data-parallel throughput: M engine replicas behind the server's pool against one engine,
or any layouts of replicas and tensor-parallel GPUs against each other.

    tandem bench data-parallel --model DIR [--data-parallel-size 2] [--gpus 0,1]
                               [--layouts 1x1,4x1,1x4]
                               [--num-requests 1024] [--kv-cache-memory-gb G]
                               [--min-len 100] [--max-len 1024] [--clients 4]
                               [-- ENGINE_ARGS...]

A layout RxT is R engine replicas (real `python -m engine` processes) of T GPUs each
(--tensor-parallel-size T); replica r takes GPUs r*T .. r*T+T-1 of --gpus. The default layouts
are 1x1 and Mx1 (M = --data-parallel-size): DP=1, then DP=M. Four GPUs, data against tensor
parallelism: --layouts 1x1,4x1,1x4 --gpus 0,1,2,3. Each layout is fed through
`server/engine_pool.py`'s `EnginePool`, the balancer every HTTP server uses, without the HTTP
and text work, from --clients processes (as from that many servers: one Python process would
bound the tokens per second received). For each it checks first that every replica generates
the same greedy tokens for a few probe prompts, one at a time, and that layouts of one
tensor-parallel size agree; then it times the offline workload of tandem/bench/offline.py
(random token ids, input and output lengths uniform in [--min-len, --max-len], ignore_eos), all
submitted at once, and checks that every request got all its tokens and that each replica took
its share. It prints the time to ready (process start to every handshake), output tokens per
second, and each layout against the first: its speed-up and its scaling efficiency (speed-up
over the ratio of GPUs; the target for data parallelism: at least 90%, 1.8x on two GPUs),
and on CUDA its share of the roofline of its N GPUs (``layout_bound``: each GPU's share of
the least the workload needs, engine/roofline.py's ``workload_bound``).
Layouts of different tensor-parallel sizes may differ in greedy tokens: bf16 sums in another
order can flip near-ties (tensor parallelism's own check is float32, in
tandem/bench/tensor_parallel.py).

The default workload, 4 x --max-num-seqs requests (1,024 at the engine's default of 256 a GPU),
keeps a one-GPU replica's batch full: with fewer requests than one engine's batch holds,
replicas only split the same batch. A tensor-parallel engine's batch grows with its GPUs.

One GPU, as a smoke check: --gpus 0,0 puts both replicas on GPU 0; the KV cache of each
replica is then --kv-cache-memory-gb (default here 16 GiB), since each engine would otherwise
count the other's memory as its own. The ratio is then not the target's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event

import torch

from engine.__main__ import parse_args as parse_engine_args
from engine.config import MAX_NUM_SEQS_PER_GPU, default_max_num_seqs
from engine.execution.model_runner import resolve_kv_cache_dtype
from engine.roofline import DeviceRates, ModelCost, measure_rates, workload_bound
from protocol import HandshakeReply, SamplingParams, Scheduling
from server.engine_pool import EnginePool
from tandem.bench.latency import model_cost
from tandem.bench.offline import workload

PROBE_TOKENS = 32
NUM_PROBES = 4
SHARED_GPU_KV_CACHE_GB = 16.0
READY_TIMEOUT_S = 900.0
TARGET_EFFICIENCY = 0.9  # data parallelism's: 1.8x on two GPUs


@dataclass
class Run:
    replicas: int
    gpus: list[str]  # each replica's CUDA_VISIBLE_DEVICES ("" on the CPU)
    tensor_parallel_size: int = 1
    ready_s: float = 0.0
    output_tokens: int = 0
    seconds: float = 0.0
    requests_per_replica: tuple[int, ...] = ()
    probes: list[list[int]] | None = None  # the probe prompts' greedy tokens
    lengths: list[tuple[int, int]] | None = None  # each request's prompt and output lengths

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def gpu_list(self) -> list[str]:
        return [gpu for group in self.gpus for gpu in group.split(",") if gpu]

    @property
    def devices(self) -> int:
        """The GPUs it takes (counted with repeats), or its replicas on the CPU."""
        return len(self.gpu_list) or self.replicas

    def efficiency(self, baseline: Run) -> float:
        """Its speed-up over ``baseline`` divided by the ratio of their devices."""
        return self.tokens_per_s * baseline.devices / (baseline.tokens_per_s * self.devices)

    @property
    def shares_a_gpu(self) -> bool:
        return len(set(self.gpu_list)) < len(self.gpu_list)

    @property
    def name(self) -> str:
        return f"DP={self.replicas} TP={self.tensor_parallel_size}"


def engine_command(args: argparse.Namespace, address: str, run: Run) -> list[str]:
    command = [sys.executable, "-m", "engine", "--address", address, "--model", args.model]
    command += ["--device", args.device, "--log-level", "warning"]
    command += ["--tensor-parallel-size", str(run.tensor_parallel_size)]
    if args.max_num_seqs is not None:
        command += ["--max-num-seqs", str(args.max_num_seqs)]
    command += ["--max-model-len", str(2 * args.max_len + 16)]  # as tandem/bench/offline.py's
    kv_cache_gb = args.kv_cache_memory_gb
    if kv_cache_gb is None and run.shares_a_gpu:
        kv_cache_gb = SHARED_GPU_KV_CACHE_GB
    if kv_cache_gb is not None:
        command += ["--kv-cache-memory-gb", str(kv_cache_gb)]
    return command + args.engine_args


async def run_replicas(args: argparse.Namespace, run: Run) -> None:
    workdir = tempfile.mkdtemp(prefix="tandem-dp-")
    addresses = [f"ipc://{workdir}/engine{r}.sock" for r in range(run.replicas)]
    processes = []
    started = time.perf_counter()
    for address, gpus in zip(addresses, run.gpus, strict=True):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus) if gpus else None
        command = engine_command(args, address, run)
        processes.append(subprocess.Popen(command, env=env))
    pool = EnginePool(addresses, "bench_data_parallel")
    try:
        handshake = await until_ready(pool, processes)
        run.ready_s = time.perf_counter() - started
        vocab_size = _vocab_size(handshake.tokenizer_json)
        run.probes = await probe_every_replica(pool, vocab_size)
        requests = workload(args.num_requests, vocab_size, args.min_len, args.max_len)
        run.lengths = [(len(prompt), n) for prompt, n in requests]
        before = [stats.num_finished for stats in await _stats(pool)]
        # Blocking this loop meanwhile is fine: its pool sends and receives nothing then.
        counts, run.seconds = generate_in_clients(addresses, requests, args.clients)
        after = [stats.num_finished for stats in await _stats(pool)]
        run.requests_per_replica = tuple(a - b for a, b in zip(after, before, strict=True))
        short = [
            i for i, (count, (_, n)) in enumerate(zip(counts, requests, strict=True)) if count != n
        ]
        if short:
            raise SystemExit(
                f"FAIL: {len(short)} requests got fewer tokens than asked: {short[:8]}"
            )
        run.output_tokens = sum(counts)
    finally:
        await pool.close()
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def until_ready(pool: EnginePool, processes: list[subprocess.Popen]) -> HandshakeReply:
    """Every replica's handshake; fails at once if an engine exits before it answers."""
    connecting = asyncio.create_task(pool.connect(READY_TIMEOUT_S))
    while not connecting.done():
        await asyncio.wait([connecting], timeout=1.0)
        exited = [(r, p.returncode) for r, p in enumerate(processes) if p.poll() is not None]
        if exited and not connecting.done():
            connecting.cancel()
            raise SystemExit(f"FAIL: engine replica {exited[0][0]} exited ({exited[0][1]})")
    return connecting.result()


async def probe_every_replica(pool: EnginePool, vocab_size: int) -> list[list[int]]:
    """The probes' greedy tokens, each generated alone on every replica; they must agree."""
    rng = random.Random(1)  # not the workload's seed: no probe is a prefix of its prompts
    prompts = [[rng.randrange(vocab_size) for _ in range(48)] for _ in range(NUM_PROBES)]
    greedy = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True)
    answers = []
    for replica in pool.replicas:
        tokens = []
        for i, prompt in enumerate(prompts):
            outputs = replica.client.generate(
                f"probe-{replica.index}-{i}", prompt, greedy, Scheduling()
            )
            tokens.append([t async for output in outputs for t in output.new_token_ids])
        answers.append(tokens)
    for replica, tokens in enumerate(answers[1:], start=1):
        if tokens != answers[0]:
            raise SystemExit(f"FAIL: replica {replica}'s greedy tokens differ from replica 0's")
    return answers[0]


def generate_in_clients(
    addresses: list[str], requests: list[tuple[list[int], int]], num_clients: int
) -> tuple[list[int], float]:
    """Each request's output token count, and the seconds from the start signal to the last
    token: request i sent by client process i % num_clients through its own EnginePool (as
    if by that many servers), so that no one Python process's handling of the outputs bounds
    the engines' throughput."""
    context = multiprocessing.get_context("spawn")
    ready = context.Barrier(num_clients + 1)
    go = context.Event()
    results = context.Queue()
    clients = [
        context.Process(
            target=run_client,
            args=(addresses, k, requests[k::num_clients], ready, go, results),
            daemon=True,
        )
        for k in range(num_clients)
    ]
    for client in clients:
        client.start()
    try:
        ready.wait(timeout=READY_TIMEOUT_S)  # every client connected
        started = time.monotonic()
        go.set()
        counts = [0] * len(requests)
        finished = started
        for _ in clients:
            while True:
                try:
                    k, share_counts, share_finished = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    if any(client.exitcode not in (None, 0) for client in clients):
                        raise SystemExit(
                            "FAIL: a client process failed (its error is above)"
                        ) from None
            counts[k::num_clients] = share_counts
            finished = max(finished, share_finished)
    finally:
        for client in clients:
            client.join(timeout=30)
            client.kill()
    return counts, finished - started


def run_client(
    addresses: list[str],
    client: int,
    requests: list[tuple[list[int], int]],
    ready: Barrier,
    go: Event,
    results: Queue,
) -> None:
    """One client process: its requests' output token counts, and when the last ended."""
    counts, finished = asyncio.run(_client(addresses, client, requests, ready, go))
    results.put((client, counts, finished))


async def _client(
    addresses: list[str],
    client: int,
    requests: list[tuple[list[int], int]],
    ready: Barrier,
    go: Event,
) -> tuple[list[int], float]:
    pool = EnginePool(addresses, f"bench_data_parallel client {client}")
    try:
        await pool.connect(READY_TIMEOUT_S)
        await asyncio.to_thread(ready.wait)
        await asyncio.to_thread(go.wait)
        counts = await asyncio.gather(
            *(
                _generate(pool, f"bench-{client}-{i}", prompt, n)
                for i, (prompt, n) in enumerate(requests)
            )
        )
        return counts, time.monotonic()
    finally:
        await pool.close()


async def _generate(pool: EnginePool, request_id: str, prompt: list[int], max_tokens: int) -> int:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs = pool.generate(request_id, prompt, sampling, Scheduling())
    return sum([len(output.new_token_ids) async for output in outputs])


async def _stats(pool: EnginePool) -> list:
    stats = await pool.stats(timeout=30)
    if any(s is None for s in stats):
        raise SystemExit("FAIL: a replica does not answer")
    return stats


def _vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).get_vocab_size()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument(
        "--gpus", default="0,1", help="GPUs, taken in order by replicas; repeat one to share it"
    )
    parser.add_argument(
        "--layouts", help="comma-separated RxT: R replicas of T GPUs each (default 1x1,Mx1)"
    )
    parser.add_argument(
        "--num-requests", type=int, help="default: 4 x --max-num-seqs (4 x 256 by default)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, help="each engine's (default: the engine's, 256 a GPU)"
    )
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory-gb", type=float)
    parser.add_argument(
        "--clients", type=int, default=4, help="client processes sending the requests"
    )
    parser.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: engine options")
    args = parser.parse_args(argv)
    # A SIGTERM (a timeout) stops the engines too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.engine_args = [a for a in args.engine_args if a != "--"]
    args.num_requests = args.num_requests or 4 * (args.max_num_seqs or MAX_NUM_SEQS_PER_GPU)
    layouts = args.layouts or f"1x1,{args.data_parallel_size}x1"
    rates, cost = None, None
    if args.device == "cuda":  # measured before the engines take the GPUs' memory
        rates = measure_rates(torch.device("cuda"))
        torch.cuda.empty_cache()
        engine = parse_engine_args(args.engine_args)
        kv_dtype = resolve_kv_cache_dtype(engine.kv_cache_dtype, torch.bfloat16)
        cost = model_cost(args.model, torch.bfloat16, kv_dtype, engine.quantization)
    try:
        runs = [layout_run(layout, args.gpus, args.device) for layout in layouts.split(",")]
    except ValueError as error:
        parser.error(str(error))
    for run in runs:
        print(f"=== {run.name} on GPUs {run.gpus}", flush=True)
        asyncio.run(run_replicas(args, run))
        print(f"ready in {run.ready_s:.1f} s; {run.tokens_per_s:.1f} output tok/s", flush=True)

    check_runs(runs, args.num_requests)
    print(
        f"\n{args.model}: {args.num_requests} requests, lengths uniform in "
        f"[{args.min_len}, {args.max_len}], ignore_eos, max_num_seqs "
        f"{args.max_num_seqs or f'{MAX_NUM_SEQS_PER_GPU} a GPU'}"
        + (f"; measured {rates.describe()}" if rates is not None else "")
    )
    first = runs[0]
    print(
        f"{'':11} {'GPUs':12} {'ready s':>8} {'requests/replica':>18} {'tokens':>9} "
        f"{'seconds':>8} {'tok/s':>9} {'vs first':>9} {'efficiency':>10} {'% of roofline':>14}"
    )
    for run in runs:
        speedup = run.tokens_per_s / first.tokens_per_s
        share = "-"
        if rates is not None and cost is not None:
            share = f"{layout_bound(run, args.max_num_seqs, cost, rates) / run.seconds:.0%}"
        print(
            f"{run.name:11} {'/'.join(run.gpus) if run.gpu_list else 'cpu':12} "
            f"{run.ready_s:8.1f} "
            f"{'/'.join(map(str, run.requests_per_replica)):>18} {run.output_tokens:9d} "
            f"{run.seconds:8.2f} {run.tokens_per_s:9.1f} {speedup:8.2f}x "
            f"{run.efficiency(first):10.0%} {share:>14}"
        )
    for run in runs[1:]:
        if run.shares_a_gpu or args.device == "cpu":
            print(f"{run.name}: smoke (replicas share a device), no target")
        elif run.tensor_parallel_size == first.tensor_parallel_size:
            efficiency = run.efficiency(first)
            verdict = "met" if efficiency >= TARGET_EFFICIENCY else "NOT met"
            print(
                f"{run.name} / {first.name}: {efficiency:.0%} of linear scaling "
                f"(target >= {TARGET_EFFICIENCY:.0%}: {verdict})"
            )


def layout_bound(run: Run, max_num_seqs: int | None, cost: ModelCost, rates: DeviceRates) -> float:
    """The layout's roofline, seconds: its GPUs each reading and computing their share (1/T
    of a replica's work on each of its T GPUs, collectives not counted), the requests split
    evenly over the replicas, each replica's the least its requests need
    (``workload_bound``)."""
    assert run.lengths is not None
    size = run.tensor_parallel_size
    batch = max_num_seqs or default_max_num_seqs(size)
    shares = [run.lengths[r :: run.replicas] for r in range(run.replicas)]
    return max(
        workload_bound([p for p, _ in share], [n for _, n in share], batch, cost, rates) / size
        for share in shares
    )


def layout_run(layout: str, gpus: str, device: str) -> Run:
    """The run of ``layout`` ("RxT": R replicas of T GPUs each) on the GPUs of ``gpus`` in
    order; on the CPU, R replicas without GPUs."""
    replicas, _, size = layout.partition("x")
    if not (replicas.isdigit() and size.isdigit() and int(replicas) > 0 and int(size) > 0):
        raise ValueError(f"layout {layout!r}: expected RxT, e.g. 4x1 or 1x4")
    replicas, size = int(replicas), int(size)
    if device != "cuda":
        return Run(replicas, [""] * replicas, size)
    listed = gpus.split(",")
    if len(listed) < replicas * size:
        raise ValueError(
            f"--gpus lists {len(listed)} GPUs; layout {layout} needs {replicas * size}"
        )
    groups = [",".join(listed[r * size : (r + 1) * size]) for r in range(replicas)]
    return Run(replicas, groups, size)


def check_runs(runs: list[Run], num_requests: int) -> None:
    """Fails unless layouts of one tensor-parallel size generated the same probe tokens and
    every replica took about its share of the requests."""
    for run in runs[1:]:
        same_size = [r for r in runs if r.tensor_parallel_size == run.tensor_parallel_size]
        if run.probes != same_size[0].probes:
            raise SystemExit(
                f"FAIL: {run.name} and {same_size[0].name} generate different greedy tokens"
            )
    for run in runs:
        fair = num_requests / run.replicas
        if any(abs(n - fair) > 0.1 * fair for n in run.requests_per_replica):
            raise SystemExit(f"FAIL: {run.name}'s requests per replica {run.requests_per_replica}")


if __name__ == "__main__":
    main()
