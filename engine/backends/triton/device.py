"""What the kernels' launch rules read of the device: its SM count, which decode attention's
splits and the weight-only GEMM's splits of K aim to fill; and the counters kept on it by
kernels whose last program does the rest of the work."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SMs; 1 off CUDA (the interpreter runs one program at a time: splitting
    gains nothing)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def zeroed_counters(device: torch.device, size: int, kernel: str) -> torch.Tensor:
    """int32 [size], zeros between launches: counters that ``kernel``'s programs count
    themselves done on, its last program (the one that finds the count complete) setting
    them back to zero (split decode's merge, the QKV kernel's per-head norms). One a
    device, size and kernel (its launches run one after another on the step's stream),
    made the first time, eagerly: a CUDA graph's capture runs the forward pass once first
    (``capture_forward``), and a buffer made inside the capture would not be zeroed until
    that graph replayed."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    assert not capturing, "made eagerly, before any capture"
    return torch.zeros(size, dtype=torch.int32, device=device)
