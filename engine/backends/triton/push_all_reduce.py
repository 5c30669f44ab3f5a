"""The all-reduce of a decode step's row-parallel outputs in one kernel that stores into the
peers' buffers: no barrier, one trip over NVLink, launched dependent like the kernels around it.

PyTorch's one-shot kernel (``engine.distributed.symmetric_all_reduce``) copies its input into
its own buffer, meets every peer at a barrier (a store over NVLink and a wait for theirs), then
reads the peers' buffers (a second trip): two round trips plus a launch that cannot start
before the kernel ahead of it ends. Here each rank stores its input into every rank's buffer,
its own included, and each reads only its own buffer, waiting until every rank's part has
arrived. A part has arrived when none of its values is the *empty* mark: the bits of -0.0,
which no input stores (an input's -0.0 is stored as +0.0, the same in any sum). That is the
one-shot "Lamport" all-reduce of TensorRT-LLM's and FlashInfer's: a value is its own flag.

A buffer must be empty before a peer stores into it again, and no barrier says when the peers
are done reading: so each rank's buffer has three slots, used in turn, call after call. At a
call in slot s, a rank marks empty the slot of the call before (s - 1), which only it reads and
which it finished reading; the peers store next into slot s + 1, marked empty a call earlier
still. A peer is at most one call ahead (its next call needs this rank's part of this one), so
it never stores into a slot before this rank has marked it empty. The slot in turn lives on
the device (``state``), not in the launch, so CUDA graphs replayed in any order keep the turn:
every rank makes the same all-reduces in the same order (they are collectives), so every rank's
count agrees. The last program of a call to finish moves the turn on.

Sums in float32 in rank order, rounded once: the same bits on every rank, and on two ranks the
same as NCCL's (``tests/gpu/test_all_reduce.py``). ``scripts/bench_all_reduce.py`` times it
against PyTorch's one shot and NCCL.

``TANDEM_ONE_SHOT=torch`` makes this backend use PyTorch's one shot instead, to measure what
this gains (``scripts/profile_step.py --tensor-parallel-size 2`` with it and without).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)
from engine.distributed.parallel import OneKernelAllReduce, TensorParallel
from engine.distributed.symmetric_all_reduce import (
    SymmetricBuffer,
    map_symmetric_buffer,
    torch_one_shot,
)

SLOTS = 3  # the slot in turn, the one before (marked empty now), the next (empty already)
_SLOTS = tl.constexpr(SLOTS)
_BLOCK = 1024  # elements a program
_SUMMED = (torch.bfloat16, torch.float16, torch.float32)
# The device state: the slot in turn, how many programs of the call in it have finished, then
# how many elements each slot's last call stored (its part of a rank, to be marked empty).
_TURN, _FINISHED, _STORED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def turn(state_ptr):
    """The slot in turn (read after waiting for the kernels before: the last call's last
    program moved it on)."""
    return tl.load(state_ptr + _TURN)


@triton.jit
def push(values, offsets, mask, slot, local_ptr, addresses_ptr, RANK, RANKS, PART, EMPTY):
    """Store this rank's ``values`` of the elements ``offsets`` into every rank's buffer
    (its own included) at ``slot``, a -0.0 stored as +0.0 (its bits are the empty mark)."""
    bits_type = local_ptr.dtype.element_ty
    bits = values.to(bits_type, bitcast=True)
    bits = tl.where(bits == EMPTY, 0, bits)
    part = slot * (RANKS * PART) + RANK * PART + offsets
    for rank in tl.static_range(RANKS):
        peer = tl.load(addresses_ptr + rank).to(tl.pointer_type(bits_type))
        tl.store(peer + part, bits, mask=mask)


@triton.jit
def empty_slot_before(local_ptr, state_ptr, slot, first, step, RANKS, PART, EMPTY, BLOCK):
    """Mark empty this program's share of the call before's slot: every rank's part, as long
    as that call's input, from element ``first`` on in strides of ``step`` (the call's
    programs between them cover it)."""
    before = (slot + _SLOTS - 1) % _SLOTS
    stored = tl.load(state_ptr + _STORED + before)
    empty = tl.full([BLOCK], EMPTY, local_ptr.dtype.element_ty)
    for start in range(first, stored, step):
        stale = start + tl.arange(0, BLOCK)
        for rank in tl.static_range(RANKS):
            slot_part = local_ptr + before * (RANKS * PART) + rank * PART
            tl.store(slot_part + stale, empty, mask=stale < stored)


@triton.jit
def arrived_sum(local_ptr, slot, offsets, mask, out_ptr, RANKS, PART, EMPTY):
    """The sum of every rank's part of the elements ``offsets``, each waited for in this
    rank's buffer until it has arrived, in float32 in rank order, rounded to ``out_ptr``'s
    dtype."""
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros(offsets.shape, tl.float32)
    for rank in tl.static_range(RANKS):
        arriving = local_ptr + slot * (RANKS * PART) + rank * PART + offsets
        got = tl.load(arriving, mask=mask, other=0, volatile=True)
        while tl.max((got == EMPTY).to(tl.int32), axis=0) > 0:
            got = tl.load(arriving, mask=mask, other=0, volatile=True)
        total += got.to(dtype, bitcast=True).to(tl.float32)
    return total.to(dtype)


@triton.jit
def joined(summed, stream_ptr, offsets, mask):
    """``summed`` plus the residual stream, the sum rounded as stored first, then added as
    PyTorch's ``sum + stream`` adds."""
    stream = tl.load(stream_ptr + offsets, mask=mask)
    return (summed.to(tl.float32) + stream.to(tl.float32)).to(summed.dtype)


@triton.jit
def end_turn(state_ptr, slot, numel):
    """Record the call's size (its slot's to be marked empty a call later) and move the turn
    on: by the call's last program, once every program of this rank has read the turn."""
    tl.store(state_ptr + _STORED + slot, numel)
    tl.store(state_ptr + _TURN, (slot + 1) % _SLOTS)


@triton.jit
def _push_all_reduce_kernel(
    x_ptr,
    out_ptr,
    stream_ptr,  # the residual stream the sum joins, where ADD
    local_ptr,  # this rank's buffer, its values' bits as integers of their width
    addresses_ptr,
    state_ptr,
    numel,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    PART: tl.constexpr,  # elements of one rank's part of a slot
    EMPTY: tl.constexpr,  # -0.0's bits
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    let_next_kernel_start()
    # The input is the kernel before's; the state the last all-reduce's, kernels before.
    wait_for_previous_kernel()
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    slot = turn(state_ptr)
    offsets = program * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    values = tl.load(x_ptr + offsets, mask=mask)
    push(values, offsets, mask, slot, local_ptr, addresses_ptr, RANK, RANKS, PART, EMPTY)
    empty_slot_before(
        local_ptr, state_ptr, slot, program * BLOCK, programs * BLOCK, RANKS, PART, EMPTY, BLOCK
    )
    summed = arrived_sum(local_ptr, slot, offsets, mask, out_ptr, RANKS, PART, EMPTY)
    if ADD:
        summed = joined(summed, stream_ptr, offsets, mask)
    tl.store(out_ptr + offsets, summed, mask=mask)
    # Which program ends last is not known: each counts itself in, the last moves the turn.
    if tl.atomic_add(state_ptr + _FINISHED, 1) == programs - 1:
        tl.store(state_ptr + _FINISHED, 0)
        end_turn(state_ptr, slot, numel)


class PushAllReduce:
    """This rank's side of the all-reduce that stores into the peers' buffers."""

    # It adds the residual stream to the sum as it stores it: the next norm reads the stream
    # alone, as a one-rank step's does after its o and down projections add it.
    adds_stream = True
    # The backend's one-row product makes it itself (``one_row_matmul``'s ``all_reduce``):
    # its programs push their channels, its last program sums, no kernel of its own.
    fuses_into_one_row = True

    def __init__(self, buffer: SymmetricBuffer, rank: int, ranks: int, part: int) -> None:
        self.buffer = buffer
        self.rank = rank
        self.ranks = ranks
        self.part = part
        device = buffer.local.device
        self.state = torch.zeros(2 + SLOTS, dtype=torch.int32, device=device)
        self.launch = launch_options(device)
        bits = {2: torch.int16, 4: torch.int32}[buffer.local.element_size()]
        self.local_bits = buffer.local.view(bits)
        self.empty = torch.iinfo(bits).min  # -0.0's bits
        self.local_bits.fill_(self.empty)  # every slot empty

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through this kernel: the buffer's dtype, not empty (a launch of
        no programs would not move the turn on), small enough, dense. Every rank decides
        alike, since every rank reduces tensors of the same shape."""
        return (
            x.dtype == self.buffer.local.dtype and 0 < x.numel() <= self.part and x.is_contiguous()
        )

    def kernel_operands(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """What a kernel that makes this all-reduce itself takes (the one-row product's
        ``REDUCE``): its buffer, every rank's, the turn, then its constants."""
        pointers = {
            "local_ptr": self.local_bits,
            "addresses_ptr": self.buffer.addresses,
            "state_ptr": self.state,
        }
        constants = {"RANK": self.rank, "RANKS": self.ranks, "PART": self.part, "EMPTY": self.empty}
        return pointers, constants

    def __call__(self, x: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of every rank's ``x``, as a new tensor; plus ``stream`` (x's shape, dense),
        the sum rounded to x's dtype first, where given."""
        out = torch.empty_like(x)
        _push_all_reduce_kernel[(triton.cdiv(x.numel(), _BLOCK),)](
            x,
            out,
            x if stream is None else stream,
            self.local_bits,
            self.buffer.addresses,
            self.state,
            x.numel(),
            RANK=self.rank,
            RANKS=self.ranks,
            PART=self.part,
            EMPTY=self.empty,
            ADD=stream is not None,
            BLOCK=_BLOCK,
            num_warps=4,
            **self.launch,
        )
        return out


def push_all_reduce(
    tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_bytes: int
) -> OneKernelAllReduce | None:
    """This rank's ``PushAllReduce`` for tensors of ``dtype`` up to ``max_bytes`` (collective:
    every rank maps its buffer); PyTorch's one shot where ``TANDEM_ONE_SHOT=torch``."""
    if os.environ.get("TANDEM_ONE_SHOT") == "torch":
        return torch_one_shot(tp, device, dtype, max_bytes)
    if dtype not in _SUMMED:
        return None
    part = max_bytes // dtype.itemsize
    buffer = map_symmetric_buffer(SLOTS * tp.size * part, dtype, device)
    return PushAllReduce(buffer, tp.rank, tp.size, part)
