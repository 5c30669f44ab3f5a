"""Small all-reduces in one kernel, through PyTorch's symmetric memory: the decode step's
row-parallel outputs.

Why: a decode step makes two all-reduces a layer (160 on the 70B shape), each of a few KiB
at batch 1. At that size NCCL's ring costs its latency, not its bytes: its steps between
ranks and its proxy thread, however few the bytes (``scripts/bench_all_reduce.py`` times
the paths by size, eager and in a CUDA graph). PyTorch's symmetric memory
(``torch.distributed._symmetric_memory``) maps every rank's buffer into every other rank's
address space over CUDA peer-to-peer, so one kernel can sum: no proxy thread, no ring of
steps, the same bits on every rank, and capturable in a CUDA graph. Larger tensors (prompt
steps, big batches) keep NCCL, whose ring moves 2(W-1)/W of the bytes where one shot moves
W-1 times them.

Which kernel is the backend's (``LayerOps.one_kernel_all_reduce``): PyTorch's
``one_shot_all_reduce_copy`` (``torch_one_shot``, the PyTorch backend's) copies the local
input into this rank's buffer, meets the peers at a barrier of signal pads, then reads and
sums the ranks' copies in rank order: two trips over NVLink and a launch of its own, which
cannot overlap the kernels around it. The Triton backend's
(``engine/backends/triton/push_all_reduce.py``) stores into the peers' buffers and needs no
barrier.

Only peer-to-peer loads and stores: NVLink multicast stays off
(``TORCH_SYMM_MEM_DISABLE_MULTICAST``, set by ``workers.NO_MULTICAST``), as the GPU machines
require.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.distributed.parallel import OneKernelAllReduce, TensorParallel

logger = logging.getLogger(__name__)

# Each rank's buffer, and the largest all-reduce it takes: a decode step's at up to 32 rows
# of an 8192-wide model (64 of a 4096-wide one). ``scripts/bench_all_reduce.py
# --tensor-parallel-size 2`` (and 4) times one shot against NCCL's ring by size, past this
# threshold too: one shot leads well beyond it, its lead narrowing as it reads every peer's
# whole buffer. A larger threshold waits for offline runs (``scripts/bench_offline.py
# --tensor-parallel-size N``) to show that the larger sizes pay.
ONE_SHOT_MAX_BYTES = 512 * 1024

# The dtypes PyTorch's one-shot kernel sums (float16 models' all-reduces stay NCCL's).
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)

# How many buffers this process has mapped. PyTorch numbers the store exchanges of its
# rendezvous with a counter private to each process, never reset, so ranks meet only if they
# have mapped alike: a second tensor-parallel engine in one process (the offline API's, a
# test's) has rank 0 counting on from the first engine's exchanges while its fresh workers
# count from zero, and every rank would wait at the store until its timeout. Such an engine's
# ranks agree to use NCCL alone instead.
mappings_in_this_process = 0


@dataclasses.dataclass(frozen=True)
class SymmetricBuffer:
    """This rank's buffer in symmetric memory and every rank's, as this rank addresses them."""

    local: torch.Tensor  # flat, this rank's
    # int64 [ranks] on the device: each rank's buffer's address in this process's mapping
    # (this rank's own among them), for kernels that store into the peers' buffers.
    addresses: torch.Tensor
    group_name: str


# What builds a rank's one-kernel all-reduce: (tp, device, dtype, max_bytes) -> one, or None
# where it does not sum ``dtype``. PyTorch's one-shot kernel (``torch_one_shot``) by default;
# a backend may offer its own (``LayerOps.one_kernel_all_reduce``).
OneKernelAllReduceMaker = Callable[
    [TensorParallel, torch.device, torch.dtype, int], OneKernelAllReduce | None
]


def map_symmetric_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> SymmetricBuffer:
    """A buffer of ``numel`` elements in every rank's symmetric memory, mapped into every
    other rank's address space over CUDA peer-to-peer (collective: every rank calls it alike).
    Raises RuntimeError (or ImportError) where the GPUs cannot share memory."""
    import torch.distributed._symmetric_memory as symmetric_memory

    group_name = dist.group.WORLD.group_name
    if symmetric_memory.get_backend(device) is None:
        symmetric_memory.set_backend("CUDA")  # peer-to-peer mappings, not NVSHMEM's heap
    local = symmetric_memory.empty(numel, dtype=dtype, device=device)
    handle = symmetric_memory.rendezvous(local, group_name)
    addresses = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    return SymmetricBuffer(local, addresses, group_name)


class SymmetricAllReduce:
    """PyTorch's one-shot all-reduce over this rank's symmetric buffer."""

    adds_stream = False  # the residual stream is the next norm's to add
    fuses_into_one_row = False  # a kernel of PyTorch's own

    def __init__(self, buffer: SymmetricBuffer) -> None:
        self.buffer = buffer.local
        self.group_name = buffer.group_name

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through one shot: the buffer's dtype, small enough, dense, in
        whole 16-byte vectors (the kernel's loads). Every rank decides alike, since every
        rank reduces tensors of the same shape."""
        return (
            x.dtype == self.buffer.dtype
            and x.numel() <= self.buffer.numel()
            and x.numel() % (16 // x.element_size()) == 0
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of every rank's ``x``, as a new tensor."""
        assert stream is None, "PyTorch's one shot adds no stream"
        summed = torch.ops.symm_mem.one_shot_all_reduce_copy(
            self.buffer[: x.numel()], x.view(-1), "sum", self.group_name
        )
        return summed.view(x.shape)


def torch_one_shot(
    tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_bytes: int
) -> SymmetricAllReduce | None:
    """PyTorch's one-shot all-reduce for ``dtype``, or None where its kernel cannot sum it."""
    if dtype not in ONE_SHOT_DTYPES:
        return None
    return SymmetricAllReduce(map_symmetric_buffer(max_bytes // dtype.itemsize, dtype, device))


def with_symmetric_all_reduce(
    tp: TensorParallel,
    device: torch.device,
    dtype: torch.dtype,
    max_bytes: int = ONE_SHOT_MAX_BYTES,
    make: OneKernelAllReduceMaker = torch_one_shot,
) -> TensorParallel:
    """``tp`` whose all-reduces of ``dtype`` up to ``max_bytes`` go through one kernel over
    symmetric memory (``make``'s), where every rank could map its buffer (CUDA, several
    ranks, a dtype ``make`` sums); else ``tp`` unchanged (NCCL or gloo for every all-reduce).
    Collective: every rank calls it, and all of them take the same path."""
    global mappings_in_this_process
    if tp.size == 1 or device.type != "cuda":
        return tp
    if not _same_on_every_rank(mappings_in_this_process, device):
        logger.warning(
            "a tensor-parallel engine ran in this process before: every all-reduce through "
            "NCCL (one engine a process keeps the one-kernel all-reduce)"
        )
        return tp
    mappings_in_this_process += 1
    reducer = None
    try:
        reducer = make(tp, device, dtype, max_bytes)
    except (RuntimeError, ImportError, AttributeError) as error:
        logger.warning("symmetric memory unavailable (%s): every all-reduce through NCCL", error)
    # One rank without it would wait at NCCL while the others wait at the signal pads.
    agreed = _same_on_every_rank(reducer is not None, device)
    if reducer is None or not agreed:
        return tp
    logger.info(
        "all-reduces up to %d KiB in one kernel (%s)", max_bytes // 1024, type(reducer).__name__
    )
    return dataclasses.replace(tp, symmetric_all_reduce=reducer)


def _same_on_every_rank(value: int, device: torch.device) -> bool:
    """Whether every rank holds the same ``value`` (collective)."""
    extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the largest, and minus the least
    return bool(extremes[0] == -extremes[1])
