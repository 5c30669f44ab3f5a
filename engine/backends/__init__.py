"""Backends by name: each gives the model runner its ``Backend``, every device operation that
has more than one implementation: the model's attention (``AttentionBackend``) and layer ops
(``LayerOps``: norms, activation, the linear layers' products), and the step's own ops
(``StepOps``: sampling's argmax and grammar masks, the step inputs' fills).

``BACKENDS`` maps a name (``--backend``) to a factory that builds one for a device. Nothing
else in the engine chooses a kernel: whatever the chosen backend's objects do is all that
runs, so ``--backend torch`` launches no Triton kernel on any device. Only the ``triton``
factory imports ``engine.backends.triton``, when chosen. docs/adding-a-backend.md says what a
backend provides and how to test one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.attention import AttentionBackend
from engine.backends.layer_ops import LayerOps
from engine.backends.pytorch import TorchLayerOps, TorchPagedAttention, TorchStepOps
from engine.backends.step_ops import StepOps


@dataclass(frozen=True)
class Backend:
    """One model runner's implementations (a draft model's runner has its own)."""

    name: str
    attention: AttentionBackend
    ops: LayerOps
    step_ops: StepOps


def _pytorch(device: torch.device) -> Backend:
    return Backend("torch", TorchPagedAttention(), TorchLayerOps(), TorchStepOps())


def _triton(device: torch.device) -> Backend:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton backend runs on the CPU only in Triton's interpreter: "
            "set TRITON_INTERPRET=1 before starting (slow; for tests)"
        )
    # Imported only when chosen: defining the kernels fixes whether they run interpreted.
    from engine.backends.triton.backend import TritonLayerOps, TritonPagedAttention, TritonStepOps

    return Backend("triton", TritonPagedAttention(), TritonLayerOps(), TritonStepOps())


BACKENDS: dict[str, Callable[[torch.device], Backend]] = {"torch": _pytorch, "triton": _triton}


def default_backend(device: torch.device) -> str:
    """The backend used unless one is named: the fused kernels where they run natively."""
    return "triton" if device.type == "cuda" else "torch"


def create_backend(name: str | None, device: torch.device) -> Backend:
    """The backend ``name`` (None: ``default_backend``'s) built for ``device``."""
    name = name or default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}, not one of {', '.join(BACKENDS)}")
    return BACKENDS[name](device)
