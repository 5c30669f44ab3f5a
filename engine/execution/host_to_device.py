"""A step's host arrays moved to the device in one copy, and where its pending tokens are.

Shared by the step's inputs and sampling parameters (``batch.py``), the penalties' seen
tokens (``seen_tokens.py``) and the draft model's inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.scheduling.request import Request


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays on the device, moved in one copy; from pinned memory on CUDA, so that
    the host does not wait for the step in flight (a copy from pageable memory would)."""
    host = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([a.size for a in arrays]))


def pending_rows_and_sources(rows: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    """The rows whose last token is pending, and where it is in the last step's tokens."""
    pending = [(row, r.pending_row) for row, r in enumerate(rows) if r.num_pending_tokens]
    return np.array(pending, np.int64).reshape(-1, 2).T
