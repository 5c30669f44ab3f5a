"""Backends by name: each gives the model its ``AttentionBackend`` and ``LayerOps``.

``BACKENDS`` maps a name (``--attention-backend``) to a factory that builds the pair for a
device. docs/adding-a-backend.md says what a backend provides and how to test one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from engine.backends.attention import AttentionBackend
from engine.backends.layer_ops import LayerOps
from engine.backends.pytorch import TorchLayerOps, TorchPagedAttention

Backend = tuple[AttentionBackend, LayerOps]


def _pytorch(device: torch.device) -> Backend:
    return TorchPagedAttention(), TorchLayerOps()


def _triton(device: torch.device) -> Backend:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton backend runs on the CPU only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 before starting (slow; for tests)"
        )
    # Imported only when chosen: defining the kernels fixes whether they run interpreted.
    from engine.backends.triton.backend import TritonLayerOps, TritonPagedAttention

    return TritonPagedAttention(), TritonLayerOps()


BACKENDS: dict[str, Callable[[torch.device], Backend]] = {"torch": _pytorch, "triton": _triton}


def default_backend(device: torch.device) -> str:
    """The backend used unless one is named: the fused kernels where they run natively."""
    return "triton" if device.type == "cuda" else "torch"


def create_backend(name: str, device: torch.device) -> Backend:
    """The backend ``name`` built for ``device``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}, not one of {', '.join(BACKENDS)}")
    return BACKENDS[name](device)
