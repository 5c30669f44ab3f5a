"""The CUDA backend: Triton kernels behind the AttentionBackend and LayerOps interfaces.

Pure-decode steps (every sequence adds one token, as in a captured CUDA graph) take the
split-K decode kernel; steps with any prefill take the variable-length prefill kernel,
which also serves the decodes in a mixed batch. Norms, RoPE and SiLU-and-multiply are
fused kernels, each one pass over its tensor.

Nothing to plan per step (``prepare`` is the base class's no-op): each kernel's launch
parameters, the decode split count included, follow from tensor shapes every layer has,
and a decode step runs as a CUDA graph whose launches were fixed at capture.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton import (
    add_rms_norm,
    apply_rope_,
    paged_decode_attention,
    paged_prefill_attention,
    silu_and_mul,
    store_kv,
)


class TritonPagedAttention(AttentionBackend):
    # Padding rows' negative slots are skipped on the device (store_kv).
    supports_cuda_graphs = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        store_kv(k, v, cache.key, cache.value, metadata.slot_mapping)
        if metadata.max_query_len == 1:
            return paged_decode_attention(
                q,
                cache.key,
                cache.value,
                metadata.block_tables,
                metadata.context_lens,
                scale,
                sliding_window=sliding_window,
            )
        return paged_prefill_attention(
            q,
            cache.key,
            cache.value,
            metadata.block_tables,
            metadata.context_lens,
            metadata.query_lens,
            metadata.query_starts,
            metadata.max_query_len,
            scale,
            sliding_window=sliding_window,
        )


class TritonLayerOps(TorchLayerOps):
    """The fused kernels; per-head Q/K norms ([T, heads, head_dim] views) stay in PyTorch."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        return add_rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum overwrites the residual: nothing else reads the old stream.
        return add_rms_norm(x, residual, weight, eps, residual_out=residual)

    def rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        apply_rope_(q, k, positions, cos, sin)
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
