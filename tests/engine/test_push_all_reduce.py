"""The Triton backend's all-reduce that stores into the peers' buffers
(``engine/backends/triton/push_all_reduce.py``), on the CPU: the ranks are processes running
the kernel at once in Triton's interpreter, each rank's buffer shared memory that every process
maps at its own address, as CUDA peer-to-peer maps a peer's buffer on the GPUs. Calls of
changing sizes (a smaller one after a larger must not read the larger's stale values), inputs
with -0.0 (the empty mark's bits), every dtype it sums, every other call adding a residual
stream: each result must be the same bits on every rank and the sum in rank order, rounded
once, plus the stream in the dtype (bfloat16's within a unit of its last place or two: the
interpreter truncates a float32 to bfloat16 where the GPU rounds it).
``tests/gpu/test_all_reduce.py`` checks it on GPUs, in CUDA graphs, against NCCL."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch
import torch.multiprocessing as mp

from engine.distributed.symmetric_all_reduce import SymmetricBuffer

if TYPE_CHECKING:  # for the annotation: the ranks import it where they run, as rank_main does
    from engine.backends.triton.push_all_reduce import PushAllReduce

PART = 4096  # elements of a rank's part of a slot
SIZES = (4096, 100, 3000, 1, 4096, 2048, 7, 1500)  # a call's elements, in order
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank ``rank``'s input to each call; some values -0.0."""
    generator = torch.Generator().manual_seed(rank)
    calls = []
    for numel in SIZES:
        x = torch.randn(numel, generator=generator).to(dtype)
        x[::5] = -0.0
        calls.append(x)
    return calls


def rank_main(
    rank: int, buffers: dict[torch.dtype, list[torch.Tensor]], start: object, failures: mp.Queue
) -> None:
    from engine.backends.triton.push_all_reduce import PushAllReduce

    ranks = len(next(iter(buffers.values())))
    wrong, results = [], []
    for dtype, every_rank in buffers.items():
        addresses = torch.tensor([b.data_ptr() for b in every_rank], dtype=torch.int64)
        reducer = PushAllReduce(SymmetricBuffer(every_rank[rank], addresses, ""), rank, ranks, PART)
        start.wait()  # every rank's buffer marked empty before any stores into it
        every_input = [inputs(r, dtype) for r in range(ranks)]
        for call, x in enumerate(every_input[rank]):
            assert reducer.accepts(x)
            stream = None
            if call % 2:  # the same on every rank, as the ranks' residual streams are
                stream = torch.randn(x.numel(), generator=torch.Generator().manual_seed(call))
                stream = stream.to(dtype)
            summed = reducer(x, stream)
            results.append(hashlib.sha256(summed.view(torch.uint8).numpy()).hexdigest())
            exact = sum(inputs_[call].float() for inputs_ in every_input)
            expected = exact.to(dtype) if stream is None else exact.to(dtype) + stream
            ulp = 0
            if dtype == torch.bfloat16:
                ulp = (exact.abs() + (0 if stream is None else stream.float().abs())) * 2**-6
            if not ((summed.float() - expected.float()).abs() <= ulp).all():
                wrong.append((str(dtype), call))
    failures.put((rank, (wrong, results)))


@pytest.mark.parametrize("ranks", [2, 3])
def test_push_all_reduce_sums_every_rank(ranks: int) -> None:
    buffers = {
        dtype: [torch.empty(3 * ranks * PART, dtype=dtype).share_memory_() for _ in range(ranks)]
        for dtype in DTYPES
    }
    assert_ranks_agree(rank_main, buffers, ranks)


def assert_ranks_agree(target: Callable[..., None], buffers: object, ranks: int) -> None:
    """Run ``target(rank, buffers, start, failures)`` in a process a rank, at once; each puts
    (rank, (what it found wrong, its results' digests)): nothing wrong, the same digests."""
    context = mp.get_context("spawn")
    start, failures = context.Barrier(ranks), context.Queue()
    processes = [
        context.Process(target=target, args=(rank, buffers, start, failures))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    results = dict(failures.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert [p.exitcode for p in processes] == [0] * ranks
    assert [results[rank][0] for rank in range(ranks)] == [[]] * ranks
    assert all(results[rank][1] == results[0][1] for rank in range(ranks))


# A one-row product that all-reduces its own output (a row-parallel layer's at batch 1):
# (channels, depth of a rank's share, gated, with a stream, with a bias), in order, between
# plain calls. A bias (gpt-oss's o projection's) is rank 0's alone: added once to the sum.
PRODUCTS = (
    (64, 48, False, True, False),
    (24, 32, True, True, False),
    (30, 40, False, True, True),  # the last program's channels partly past the row
    (64, 48, False, False, False),
    (8, 16, True, True, False),
    (64, 48, False, True, True),
)


def stale_values(reducer: PushAllReduce) -> int:
    """How many values of the slot before the last call's are not marked empty: that call
    emptied it all, every rank's part (its next use, two calls on, takes only new values)."""
    last = (int(reducer.state[0]) - 1) % 3  # the turn moved on past the last call's slot
    before = (last - 1) % 3
    size = reducer.ranks * reducer.part
    return int((reducer.local_bits[before * size : (before + 1) * size] != reducer.empty).sum())


def product_rank_main(
    rank: int, every_rank: list[torch.Tensor], start: object, failures: mp.Queue
) -> None:
    import engine.backends.triton.one_row_matmul as one_row_module
    from engine.backends.triton.one_row_matmul import one_row_matmul
    from engine.backends.triton.push_all_reduce import PushAllReduce

    one_row_module.SUM_BLOCK = 16  # the last program sums the row in several tiles
    ranks = len(every_rank)
    addresses = torch.tensor([b.data_ptr() for b in every_rank], dtype=torch.int64)
    reducer = PushAllReduce(SymmetricBuffer(every_rank[rank], addresses, ""), rank, ranks, PART)
    start.wait()
    wrong, results = [], []
    for call, (channels, depth, gated, joins, biased) in enumerate(PRODUCTS):
        shares = []
        for r in range(ranks):
            generator = torch.Generator().manual_seed(1000 * call + r)
            x = torch.randn(1, 2 * depth if gated else depth, generator=generator)
            weight = torch.randn(channels, depth, generator=generator) / depth**0.5
            shares.append((x.to(torch.bfloat16), weight.to(torch.bfloat16)))
        stream = None
        if joins:
            generator = torch.Generator().manual_seed(call)
            stream = torch.randn(1, channels, generator=generator).to(torch.bfloat16)
        bias = None
        if biased:
            generator = torch.Generator().manual_seed(100 + call)
            bias = torch.randn(channels, generator=generator).to(torch.bfloat16)
        x, weight = shares[rank]
        rank_bias = bias if rank == 0 else None
        fused = one_row_matmul(
            x, weight, gated=gated, bias=rank_bias, add=stream, all_reduce=reducer
        )
        stale = stale_values(reducer)
        # The same sum as the product, then the all-reduce's own kernel, make it.
        apart = reducer(one_row_matmul(x, weight, gated=gated, bias=rank_bias), stream)
        stale += stale_values(reducer)
        products = [one_row_matmul(xr, wr, gated=gated).float() for xr, wr in shares]
        exact = (sum(products) + (0 if bias is None else bias.float())).to(torch.bfloat16)
        expected = exact if stream is None else exact + stream
        ulp = (exact.float().abs() + (0 if stream is None else stream.float().abs())) * 2**-6
        if (
            stale
            or not torch.equal(fused, apart)
            or not ((fused.float() - expected.float()).abs() <= ulp).all()
        ):
            wrong.append(call)
        results.append(hashlib.sha256(fused.view(torch.uint8).numpy()).hexdigest())
    failures.put((rank, (wrong, results)))


@pytest.mark.parametrize("ranks", [2, 3])
def test_one_row_product_all_reduces_its_output(ranks: int) -> None:
    """The one-row product's ``all_reduce``: each program pushes its channels, the last sums
    the row and joins the stream, no all-reduce kernel. The same bits on every rank as the
    product followed by the all-reduce's own kernel, which shares its slots and turn (calls of
    both kinds alternate, of changing sizes), and the sum in rank order."""
    every_rank = [
        torch.empty(3 * ranks * PART, dtype=torch.bfloat16).share_memory_() for _ in range(ranks)
    ]
    assert_ranks_agree(product_rank_main, every_rank, ranks)
