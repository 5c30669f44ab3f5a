"""Two pinned host buffers that steps' packed inputs go through to the device, in turn.

A step packs its inputs in numpy (``engine/execution/batch.py``) and copies them to the device in
one asynchronous copy, which must come from pinned memory. Concatenated into a pageable array
and then pinned, they were copied twice and took a pinned block from PyTorch's host
allocator every step, and a fresh engine's first prompt found no block of its size cached
(an allocation in its time to first token). Here a step concatenates straight into a buffer
pinned at start.

Two buffers, used in turn, because the copy out of one may not have run yet when the next
step packs: steps overlap (the next is packed while the device runs the last), so a step's
copy waits in the stream behind the kernels of the step before it. A buffer is written
again only once its last copy is done (an event recorded after it, long done by then in
practice: two steps back).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# int64 values a buffer holds at first: a step of 8,192 tokens and 256 sequences of up to 64
# blocks. A larger step grows the buffer (to the next power of two), once.
_INITIAL_SIZE = 1 << 17


class PinnedInputs:
    def __init__(self, device: torch.device, size: int = _INITIAL_SIZE) -> None:
        self.device = device
        self._buffers = [_pinned(size), _pinned(size)]
        self._arrays = [buffer.numpy() for buffer in self._buffers]  # the same memory
        # After each buffer's last copy; waiting on one never recorded returns at once.
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def to_device(self, parts: Sequence[np.ndarray]) -> torch.Tensor:
        """``parts`` (int64) concatenated on the device, asynchronously."""
        turn = self._turn
        self._turn ^= 1
        self._copied[turn].synchronize()
        size = sum(part.size for part in parts)
        if size > self._buffers[turn].numel():
            self._buffers[turn] = _pinned(1 << (size - 1).bit_length())
            self._arrays[turn] = self._buffers[turn].numpy()
        np.concatenate(parts, out=self._arrays[turn][:size])
        on_device = self._buffers[turn][:size].to(self.device, non_blocking=True)
        self._copied[turn].record()
        return on_device


def _pinned(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int64, pin_memory=True)
