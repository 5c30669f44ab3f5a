"""The model's per-token operations (norms, RoPE, gated activation), behind one interface.

Like ``AttentionBackend``, the model calls these and nothing device-specific: this PyTorch
implementation runs everywhere and is the reference; ``engine.triton_backend`` replaces it
on CUDA with fused Triton kernels. Numerics follow Hugging Face's Llama.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
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

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k rotated (rotate-half) by the float32 [max_positions,
        head_dim] tables' rows at ``positions``; may rotate q and k in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * I], gate half first."""
        ...


class TorchLayerOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32 as Hugging Face does; bf16 variance loses too much.
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rms_norm_round_once(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * weight.float()).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In the compute dtype, as Hugging Face rounds.
        cos = cos[positions].unsqueeze(1).to(q.dtype)
        sin = sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
