"""What the kernels' launch rules read of the device: its SM count, which decode attention's
splits and the weight-only GEMM's splits of K aim to fill."""

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
