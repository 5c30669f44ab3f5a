"""How one step's inputs reach the tensor-parallel workers: once, compactly.

Rank 0 packs a step as it does alone (``engine.execution.batch.pack``: one int64 buffer on its
device, the pending tokens filled in there). The buffer's sizes, nine integers (``StepShape``), go
down a pipe to each worker, host to host, so no process waits for its device to learn them;
the buffer itself follows in one ``torch.distributed.broadcast`` from rank 0's device (NCCL
over NVLink; gloo on the CPU). A worker splits it into the same views rank 0 has and runs the
forward pass. Nothing about requests crosses: the workers know none.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import astuple
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.execution.batch import StepInputs, StepShape

_SHAPE = struct.Struct("<9q")  # StepShape's fields, in order
_STOP = b""  # no more steps: the engine is closing


class StepSender:
    """Rank 0's end: a pipe to each worker."""

    def __init__(self, pipes: list[Connection]) -> None:
        self.pipes = pipes

    def send(self, inputs: StepInputs) -> None:
        """Hand every worker the step about to run on rank 0; the broadcast is queued on
        rank 0's device like the step's other work, and the host does not wait for it."""
        shape = _SHAPE.pack(*astuple(inputs.shape))
        for pipe in self.pipes:
            pipe.send_bytes(shape)
        dist.broadcast(inputs.packed, src=0)

    def stop(self) -> None:
        """Tell every worker that is still there to exit."""
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # that worker is gone already
                pipe.send_bytes(_STOP)
            pipe.close()


class StepReceiver:
    """A worker's end: its pipe from rank 0."""

    def __init__(self, pipe: Connection, device: torch.device) -> None:
        self.pipe = pipe
        self.device = device

    def receive(self) -> StepInputs | None:
        """The next step's inputs, on this worker's device; None once the engine stops (or
        is gone: its end of the pipe closed)."""
        try:
            message = self.pipe.recv_bytes()
        except EOFError:
            return None
        if message == _STOP:
            return None
        shape = StepShape(*_SHAPE.unpack(message))
        packed = torch.empty(shape.packed_size, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0)
        input_ids, metadata, logits_index = shape.split(packed)
        return StepInputs(input_ids, metadata, logits_index, [], None, shape, packed)
