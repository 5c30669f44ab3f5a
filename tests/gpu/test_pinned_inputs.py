"""The pinned buffers a step's inputs go through: every copy arrives whole, while the device is
behind (as overlapped steps leave it), and when a step outgrows its buffer."""

from __future__ import annotations

import numpy as np
import torch

from engine.execution.pinned_inputs import PinnedInputs

# Device cycles to keep the stream busy before a copy: about 20-50 ms, long enough that three
# steps are packed on the host while the first copy still waits in the stream.
_BUSY_CYCLES = 50_000_000


def parts_of(step: int, size: int) -> list[np.ndarray]:
    values = np.arange(size, dtype=np.int64) + step * 1_000_000
    return [values[: size // 3], values[size // 3 :]]


def test_copies_arrive_whole_while_the_device_is_behind() -> None:
    """Three steps packed while the first one's copy still waits behind a long kernel: the
    third reuses the first's buffer, and must wait for its copy, not overwrite it."""
    pinned = PinnedInputs(torch.device("cuda"), size=4096)
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY_CYCLES)
    sizes = [3000, 2000, 3500]
    on_device = [pinned.to_device(parts_of(step, size)) for step, size in enumerate(sizes)]
    for step, (size, copied) in enumerate(zip(sizes, on_device, strict=True)):
        assert copied.tolist() == np.concatenate(parts_of(step, size)).tolist(), step


def test_a_larger_step_grows_its_buffer() -> None:
    pinned = PinnedInputs(torch.device("cuda"), size=1024)
    for step, size in enumerate([1000, 5000, 70_000, 1000, 70_001]):
        copied = pinned.to_device(parts_of(step, size))
        assert copied.tolist() == np.concatenate(parts_of(step, size)).tolist(), step
