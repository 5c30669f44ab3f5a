"""The tensor-parallel all-reduce on the GPUs: NCCL's ring against the one-kernel all-reduces
over symmetric memory (``engine/distributed/symmetric_all_reduce.py``: PyTorch's one shot, the
PyTorch backend's; the Triton backend's, which pushes into the peers' buffers), by size, eager
and in a CUDA graph, with their results compared.

    tandem bench all-reduce [--tensor-parallel-size 2] [--hidden 4096 8192]

One process per GPU, NCCL (multicast off). Each size is [rows, hidden] bfloat16, rows the
decode batches 1-256: the row-parallel outputs a decode step reduces twice a layer. Each rank
holds its own random values; each one-kernel result must equal on every rank and match NCCL's
(exactly on two ranks, where both add the same two numbers; within bf16's rounding of the
partial sums on more). Sizes past the engine's threshold (ONE_SHOT_MAX_BYTES, where NCCL
takes over) are measured too, to show where it lies. Times are the median of 5 rounds of 100
calls, in µs a call; the graph columns replay 100 captured calls, as the decode graphs do. A
table ends it (rank 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.backends import create_backend
from engine.backends.pytorch import TorchLayerOps
from engine.distributed.parallel import TensorParallel
from engine.distributed.symmetric_all_reduce import with_symmetric_all_reduce
from engine.tensor_parallel.workers import NO_MULTICAST

ROWS = (1, 8, 32, 64, 128, 256)
CALLS, ROUNDS = 100, 5


def timed(run: Callable[[], object]) -> float:
    """Median µs a call of ``run`` (which makes CALLS calls) over ROUNDS rounds."""
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def rank_main(rank: int, size: int, port: int, hidden: list[int], out: mp.Queue) -> None:
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size)
    device = torch.device("cuda", rank)
    # A buffer for the largest size measured, past the engine's threshold.
    largest = max(ROWS) * max(hidden) * 2
    reducers = []
    for ops in (TorchLayerOps(), create_backend("triton", device).ops):
        tp = TensorParallel(rank, size)
        tp = with_symmetric_all_reduce(
            tp, device, torch.bfloat16, largest, ops.one_kernel_all_reduce
        )
        assert tp.symmetric_all_reduce is not None, "symmetric memory unavailable"
        reducers.append(tp.symmetric_all_reduce)
    generator = torch.Generator(device).manual_seed(rank)
    rows_out = []
    for width in hidden:
        for rows in ROWS:
            x = torch.randn(rows, width, device=device, generator=generator).bfloat16()
            if not all(reducer.accepts(x) for reducer in reducers):
                continue
            reference = nccl(x.clone())
            checks = []
            for reducer in reducers:
                summed = reducer(x)
                first = summed.clone()
                dist.broadcast(first, 0)
                error = (summed.float() - reference.float()).abs().max().item()
                checks.append(
                    (error / reference.float().abs().max().item(), torch.equal(first, summed))
                )
            eager = [
                timed(lambda x=x, r=r: [r(x) for _ in range(CALLS)]) for r in (nccl, *reducers)
            ]
            graph_times = []
            for reduce in (nccl, *reducers):
                graph = torch.cuda.CUDAGraph()
                y = x.clone()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    reduce(y)  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                dist.barrier()
                with torch.cuda.graph(graph):
                    for _ in range(CALLS):
                        reduce(y)
                graph_times.append(timed(graph.replay))
            worst = max(error for error, _ in checks)
            same = all(same for _, same in checks)
            rows_out.append((rows, width, x.numel() * 2, *eager, *graph_times, worst, same))
    if rank == 0:
        out.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args(argv)
    size = args.tensor_parallel_size
    if torch.cuda.device_count() < size:
        raise SystemExit(f"needs {size} GPUs; {torch.cuda.device_count()} visible")
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=rank_main, args=(r, size, args.port, args.hidden, results))
        for r in range(size)
    ]
    for process in ranks:
        process.start()
    rows = results.get(timeout=600)
    for process in ranks:
        process.join(timeout=60)
    failed = [p.exitcode for p in ranks if p.exitcode != 0]
    print(f"\nall-reduce, {size} GPUs ({torch.cuda.get_device_name(0)}), bf16, µs a call")
    print(
        f"{'rows':>5} {'hidden':>6} {'KiB':>6} {'NCCL':>7} {'one shot':>9} {'push':>7} "
        f"{'graphs: NCCL':>13} {'one shot':>9} {'push':>7} {'rel. diff':>10} {'same on ranks':>14}"
    )
    for rows_, width, nbytes, *times, diff, same in rows:
        eager, graphs = times[:3], times[3:]
        print(
            f"{rows_:5d} {width:6d} {nbytes / 1024:6.0f} {eager[0]:7.1f} {eager[1]:9.1f} "
            f"{eager[2]:7.1f} {graphs[0]:13.1f} {graphs[1]:9.1f} {graphs[2]:7.1f} "
            f"{diff:10.1e} {same!s:>14}"
        )
    exact = size == 2
    wrong = [r for r in rows if not r[-1] or (exact and r[-2] > 0)]
    if failed or wrong:
        raise SystemExit(f"FAIL: exit codes {failed}; mismatched sizes {[r[:2] for r in wrong]}")


if __name__ == "__main__":
    main()
