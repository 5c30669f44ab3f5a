"""Tensor parallelism as a model's layers see it: which rank of how many this process is, what
share of a dimension is its own, and the two collectives the layers call.

The ranks form torch.distributed's default process group (NCCL on CUDA, gloo on the CPU),
which ``engine.tensor_parallel`` starts; with one rank nothing here communicates. The
collectives are torch.distributed's own, which a CUDA graph captures (NCCL), so the decode
graphs keep working across GPUs; on CUDA, small all-reduces take one kernel over symmetric
memory instead (``engine.distributed.symmetric_all_reduce``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); older ones lack it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OneKernelAllReduce(Protocol):
    """An all-reduce of small tensors in one kernel over symmetric memory
    (``engine.distributed.symmetric_all_reduce``: PyTorch's, or the backend's)."""

    # Whether it adds a residual stream to the sum as it stores it (``__call__``'s stream).
    adds_stream: bool
    # Whether the backend's one-row product can make it itself, no kernel of its own
    # (``LayerOps.one_row_matmul``'s ``all_reduce``).
    fuses_into_one_row: bool

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether it can sum ``x`` (its size and dtype)."""
        ...

    def __call__(self, x: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of every rank's ``x``, as a new tensor; with ``stream`` (only where it
        ``adds_stream``: x's shape and dtype, dense), the sum rounded to x's dtype plus it."""
        ...


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    # Small all-reduces' one-kernel path, where the ranks share symmetric memory.
    symmetric_all_reduce: OneKernelAllReduce | None = field(default=None, compare=False)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's equal share of ``total`` (the start and the length); ``what`` names
        it when ``total`` does not divide evenly."""
        if total % self.size:
            raise ValueError(
                f"tensor parallelism over {self.size} ranks needs {what} divisible by "
                f"{self.size}, not {total}"
            )
        share = total // self.size
        return self.rank * share, share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """The first KV head of this rank and how many it holds: an equal share, or, with
        more ranks than KV heads, one head, replicated on ``size / num_kv_heads`` ranks
        (each holds the KV heads its query heads attend with)."""
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor parallelism over {self.size} ranks needs a multiple of the "
                f"{num_kv_heads} KV heads"
            )
        return self.rank // (self.size // num_kv_heads), 1

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The least of every rank's ``value`` (the KV blocks all ranks' memory holds)."""
        if self.size == 1:
            return value
        least = torch.tensor([value], device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        return int(least.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel layer's partial products): a new
        tensor through symmetric memory where it takes ``x``, else ``x`` summed in place."""
        if self.size == 1:
            return x
        one_kernel = self.one_kernel_taking(x)
        if one_kernel is not None:
            return one_kernel(x)
        dist.all_reduce(x)
        return x

    def one_kernel_taking(self, x: torch.Tensor) -> OneKernelAllReduce | None:
        """The one-kernel all-reduce where there is one and it takes ``x``, else None (one
        rank, no symmetric memory, or too large: NCCL's)."""
        one_kernel = self.symmetric_all_reduce
        if self.size > 1 and one_kernel is not None and one_kernel.accepts(x):
            return one_kernel
        return None

    def all_reduce_into_stream(
        self, x: torch.Tensor, stream: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sum of every rank's ``x`` as it joins the residual ``stream``, and what is left
        of the stream for the next norm to add: nothing where the one-kernel all-reduce adds
        it (then the next norm reads one vector, not two), else the stream as it came."""
        one_kernel = self.one_kernel_taking(x)
        if (
            stream is not None
            and one_kernel is not None
            and one_kernel.adds_stream
            and stream.shape == x.shape
            and stream.dtype == x.dtype
            and stream.is_contiguous()
        ):
            return one_kernel(x, stream), None
        return self.all_reduce(x), stream

    def one_row_all_reduce(self, stream: torch.Tensor) -> OneKernelAllReduce | None:
        """The all-reduce that a one-row product joining the residual ``stream`` [1, N] (a
        row-parallel layer's, at batch 1) makes itself, where the one-kernel all-reduce can be
        made so and takes the row: then no kernel of its own runs between the product and the
        next layer. None with one rank, or where it cannot."""
        one_kernel = self.one_kernel_taking(stream)
        return one_kernel if one_kernel is not None and one_kernel.fuses_into_one_row else None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [T, n] side by side in rank order: [T, size * n]."""
        if self.size == 1:
            return x
        gathered = torch.empty(self.size * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        _all_gather(gathered, x.contiguous())
        # The width named: a step of prompt chunks alone gathers no rows, whose -1 is ambiguous.
        gathered = gathered.view(self.size, *x.shape).transpose(0, 1)
        return gathered.reshape(x.shape[0], self.size * x.shape[1])


SINGLE = TensorParallel()  # one process, the whole model
