"""The engine's all-reduce (``TensorParallel.all_reduce``: one kernel over symmetric memory up to
``ONE_SHOT_MAX_BYTES``, NCCL's ring past it) against NCCL's own, for every size class and the
model dtypes, with each backend's kernel (PyTorch's one shot, which leaves float16 to NCCL; the
Triton backend's, which stores into the peers' buffers), eager and replayed in a CUDA graph with
new values: the same bits on every rank, equal to NCCL's on two ranks (both add the same two
numbers, rounded once) and within the dtype's rounding of the partial sums on four; the sum
joining a residual stream too (``TensorParallel.all_reduce_into_stream``). Then a graph of
several all-reduces of changing sizes, as a decode step makes, replayed many times
between eager calls; and the one-row product that all-reduces its own output (a row-parallel
layer's at batch 1), bf16 and fp8 weights, against the product then NCCL's sum. One process
per GPU, as the engine's ranks."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.backends import create_backend
from engine.distributed.parallel import TensorParallel
from engine.distributed.symmetric_all_reduce import (
    ONE_SHOT_DTYPES,
    ONE_SHOT_MAX_BYTES,
    torch_one_shot,
    with_symmetric_all_reduce,
)
from engine.tensor_parallel.workers import NO_MULTICAST

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# [rows, hidden]: one row, a few, the largest one shot takes at 4096 wide, and past it (NCCL).
SHAPES = ((1, 4096), (3, 8192), (8, 4096), (64, 4096), (32, 8192), (256, 4096))


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def tolerance(size: int, dtype: torch.dtype) -> float:
    """How far a sum may be from NCCL's: not at all on two ranks (both add the same two
    numbers, rounded once), within the dtype's rounding of the partial sums on more."""
    return 0 if size == 2 else 4 * torch.finfo(dtype).eps


def disagreement(summed: torch.Tensor, reference: torch.Tensor, size: int) -> float | None:
    """``summed``'s relative error from NCCL's ``reference`` where it is wrong: other bits
    than rank 0's (collective: every rank calls it) or past ``tolerance``; None where right."""
    first = summed.clone()
    dist.broadcast(first, 0)
    error = relative_error(summed, reference)
    if not torch.equal(first, summed) or error > tolerance(size, summed.dtype):
        return error
    return None


def rank_main(rank: int, size: int, port: int, failures: mp.Queue) -> None:
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size)
    device = torch.device("cuda", rank)
    wrong = []
    push = create_backend("triton", device).ops.one_kernel_all_reduce
    for make, dtype in [(m, d) for m in (torch_one_shot, push) for d in DTYPES]:
        tp = with_symmetric_all_reduce(TensorParallel(rank, size), device, dtype, make=make)
        summed_here = make is push or dtype in ONE_SHOT_DTYPES
        assert (tp.symmetric_all_reduce is not None) == summed_here, "symmetric memory unavailable"
        generator = torch.Generator(device).manual_seed(rank)
        for rows, hidden in SHAPES:
            x = torch.randn(rows, hidden, device=device, generator=generator).to(dtype)
            wrong += [(make.__name__, *w) for w in check_shape(tp, size, x)]
        wrong += decode_like_graph(tp, size, dtype, device, make.__name__)
        if make is push and dtype == torch.bfloat16:
            wrong += one_row_products(tp, size, device)
    failures.put((rank, wrong))
    # Every CUDA graph freed first (each lived in a helper): with one alive the group's
    # teardown did not return.
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


def check_shape(tp: TensorParallel, size: int, x: torch.Tensor) -> list[tuple]:
    """``x``'s all-reduce, eager and replayed in a graph, and added to a residual stream,
    against NCCL's."""
    one_kernel = tp.symmetric_all_reduce
    if one_kernel is not None:
        assert one_kernel.accepts(x) == (x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES)
    graph_input = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tp.all_reduce(graph_input.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    dist.barrier()
    with torch.cuda.graph(graph):
        graph_output = tp.all_reduce(graph_input)
    graph_input.copy_(x)
    graph.replay()
    residual = torch.full_like(x, 0.5)  # the same on every rank, as the residual stream is
    joined, left = tp.all_reduce_into_stream(x.clone(), residual)
    paths = [("eager", tp.all_reduce(x.clone()), None), ("graph", graph_output, None)]
    paths.append(("into stream", joined, left))
    wrong = []
    for path, summed, left in paths:
        reference = x.clone()
        dist.all_reduce(reference)
        if path == "into stream" and left is None:  # the one kernel added it
            reference += residual
        error = disagreement(summed, reference, size)
        if error is not None:
            wrong.append((str(x.dtype), *x.shape, path, error))
    return wrong


def decode_like_graph(
    tp: TensorParallel, size: int, dtype: torch.dtype, device: torch.device, name: str
) -> list[tuple]:
    """A graph of all-reduces of changing sizes, each of new values plus the one before's
    first sum (a step's layers, one after the other), replayed many times with eager calls
    between: each replay's results against NCCL's on the same inputs."""
    generator = torch.Generator(device).manual_seed(100 + tp.rank)
    shapes = ((1, 4096), (4, 4096), (1, 4096), (2, 8192), (1, 8192), (1, 4096))
    inputs = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]

    def step() -> list[torch.Tensor]:
        outputs, carried = [], None
        for x in inputs:
            # NCCL's all-reduce sums in place: the graph's inputs stay as written.
            x = x.clone() if carried is None else x + carried.flatten()[0]
            carried = tp.all_reduce(x)
            outputs.append(carried)
        return outputs

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    wrong = []
    for replay in range(20):
        for x in inputs:
            x.copy_(torch.randn(x.shape, device=device, generator=generator).to(dtype))
        graph.replay()
        tp.all_reduce(inputs[replay % len(inputs)].clone())  # an eager call between replays
        for index, x in enumerate(inputs):
            reference = x.clone()  # the graph's input to this all-reduce
            if index:
                reference += outputs[index - 1].flatten()[0]
            dist.all_reduce(reference)
            error = relative_error(outputs[index], reference)
            if error > tolerance(size, dtype):
                wrong.append((name, str(dtype), "graph of several", replay, index, error))
    return wrong


# Row-parallel one-row products that all-reduce their own output (o and down projections at
# batch 1, TP=2 shards of the 8B and 70B shapes): [channels, depth], gated.
PRODUCTS = (((4096, 2048), False), ((4096, 7168), True), ((8192, 4096), False))


def one_row_products(tp: TensorParallel, size: int, device: torch.device) -> list[tuple]:
    """The one-row product that all-reduces its own output and joins the residual stream
    (``one_row_matmul``'s ``all_reduce``), bf16 and fp8 weights, eager and replayed in a CUDA
    graph with new values, between all-reduces of the kernel's own: the product then NCCL's
    sum then the stream, the same bits on every rank (on two ranks equal: both add the same
    two numbers, rounded once)."""
    from engine.backends.triton.one_row_matmul import one_row_matmul

    push = tp.symmetric_all_reduce
    generator = torch.Generator(device).manual_seed(200 + tp.rank)
    wrong = []
    for (channels, depth), gated in PRODUCTS:
        weight = torch.randn(channels, depth, device=device, generator=generator) / depth**0.5
        scale = weight.abs().amax(dim=1) / 448
        weights = {
            "bf16": (weight.bfloat16(), None),
            "fp8": ((weight / scale[:, None]).to(torch.float8_e4m3fn), scale),
        }
        x = torch.zeros(1, 2 * depth if gated else depth, dtype=torch.bfloat16, device=device)
        stream = torch.zeros(1, channels, dtype=torch.bfloat16, device=device)
        for kind, (codes, codes_scale) in weights.items():
            operands = (x, codes, codes_scale)
            fused = {"gated": gated, "add": stream, "all_reduce": push}
            one_row_matmul(*operands, **fused)  # compiles, outside the capture
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_output = one_row_matmul(*operands, **fused)
            for replay in range(3):
                x.copy_(torch.randn(x.shape, device=device, generator=generator))
                stream.copy_(torch.full_like(stream, 0.25 * replay))  # alike on every rank
                graph.replay()
                tp.all_reduce(x[:, :depth].clone())  # the kernel's own between replays
                eager = one_row_matmul(*operands, **fused)
                for path, summed in (("graph", graph_output), ("eager", eager)):
                    reference = one_row_matmul(x, codes, codes_scale, gated=gated)
                    dist.all_reduce(reference)
                    reference += stream
                    error = disagreement(summed, reference, size)
                    if error is not None:
                        wrong.append(("one-row", kind, channels, depth, path, replay, error))
    return wrong


@pytest.mark.parametrize("size", [2, 4])
def test_all_reduce_equals_nccl(size: int) -> None:
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    failures = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, size, port, failures)) for r in range(size)]
    for process in ranks:
        process.start()
    results = dict(failures.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert [p.exitcode for p in ranks] == [0] * size
    assert results == {r: [] for r in range(size)}
