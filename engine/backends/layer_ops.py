"""The model's per-token operations (norms, gated activation): the interface. (RoPE and
the per-head Q/K norms before it are the attention backend's, ``engine.backends.attention.Rotary``,
so that they fuse with the cache write.)

Like ``AttentionBackend``, the model calls these and nothing device-specific; each backend
of ``engine.backends`` supplies an implementation: ``TorchLayerOps`` (PyTorch, runs
everywhere, the reference) and ``TritonLayerOps`` (fused kernels). Numerics follow
Hugging Face's Llama.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerOps(Protocol):
    # Whether RMSNorm leaves a norm to the linear layer that reads it next, of one row or of
    # the rows an FP8 layer quantizes (``engine.backends.deferred_norm``): the ops' kernels must
    # include that layer's.
    defers_norms: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rmsnorm(x) * weight, normalized in float32 over the last dimension."""
        ...

    def rms_norm_round_once(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """rmsnorm(x) * weight with the product in float32 too, rounded to x's dtype once at
        the end (OLMo 2's norm; Gemma's, given 1 + its weight); rms_norm rounds before it."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); x: [T, hidden]."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * I], gate half first."""
        ...
