"""The CUDA backend: Triton kernels behind the AttentionBackend and LayerOps interfaces.

Before attending, one kernel applies the Q/K norms and RoPE and writes K and V into the
cache (``rotary_store_kv``); at one row without Q/K norms (a batch-1 decode step of a Llama),
the QKV projection's one-row kernel does that in its epilogue (``one_row_qkv``).
Pure-decode steps (every sequence adds one token, as in a captured CUDA graph) and
speculative verify steps in the uniform layout (every sequence adds 1 + k tokens, padded)
then take the split-K decode kernel; steps with any prefill take
the variable-length prefill kernel, all but the decodes at the batch's front
(``AttentionMetadata.num_leading_decodes``), which take the decode kernel. The
residual add with RMSNorm and SiLU-and-multiply are fused kernels, each one pass over its
tensor.

Nothing to plan per step (``prepare`` is the base class's no-op): each kernel's launch
parameters, the decode split count included, follow from tensor shapes every layer has,
and a decode step runs as a CUDA graph whose launches were fixed at capture.
"""

from __future__ import annotations

import torch

from engine.backends.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    OneRowProjection,
    Rotary,
)
from engine.backends.deferred_norm import LinearInput, takes_one_row_kernel
from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton import (
    add_rms_norm,
    one_row_qkv_rotary_store,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
    silu_and_mul,
)


class TritonPagedAttention(AttentionBackend):
    # Padding rows' negative slots are skipped on the device (rotary_store_kv).
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
        *,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        rotary_store_kv(
            q, k, v, cache.key, cache.value, metadata.slot_mapping, metadata.positions, rotary
        )
        return self._attend(q, cache, metadata, scale, sliding_window)

    def project_and_attend(
        self,
        x: LinearInput,
        qkv_proj: OneRowProjection,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rotary: Rotary,
    ) -> torch.Tensor | None:
        # One row (a batch-1 decode step): the one-row kernel projects, rotates and stores.
        # Per-head Q/K norms need a whole head's sums, which its programs do not share.
        if not takes_one_row_kernel(x) or rotary.q_norm is not None:
            return None
        row, weight, weight_scale = qkv_proj.one_row_operands(x)
        q = one_row_qkv_rotary_store(
            row,
            weight,
            weight_scale,
            qkv_proj.bias,
            cache.key,
            cache.value,
            metadata.slot_mapping,
            metadata.positions,
            rotary.cos,
            rotary.sin,
        )
        return self._attend(q, cache, metadata, scale, sliding_window)

    def _attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attention of q, rotated, to the cache, which holds the new tokens' K and V."""
        if metadata.max_query_len == 1 or metadata.uniform_queries:
            return paged_decode_attention(
                q,
                cache.key,
                cache.value,
                metadata.block_tables,
                metadata.context_lens,
                scale,
                query_len=metadata.max_query_len,
                sliding_window=sliding_window,
            )
        # A mixed step's decodes (at the batch's front) as a decode step: split over their
        # contexts, a program per sequence and KV head. Through the prefill kernel each would
        # be one program over its whole context, for one real query row of its tile.
        decodes = metadata.num_leading_decodes
        out = torch.empty_like(q)
        if decodes:
            paged_decode_attention(
                q[:decodes],
                cache.key,
                cache.value,
                metadata.block_tables[:decodes],
                metadata.context_lens[:decodes],
                scale,
                sliding_window=sliding_window,
                out=out[:decodes],
            )
        # The other sequences' rows stay where query_starts says in the packed q and out.
        return paged_prefill_attention(
            q,
            cache.key,
            cache.value,
            metadata.block_tables[decodes:],
            metadata.context_lens[decodes:],
            metadata.query_lens[decodes:],
            metadata.query_starts[decodes:],
            metadata.max_query_len,
            scale,
            sliding_window=sliding_window,
            out=out,
        )


class TritonLayerOps(TorchLayerOps):
    """The fused kernels; norms of [T, heads, head_dim] views (Gemma's per-head Q/K norms)
    stay in PyTorch. A norm of one row is left to the one-row kernel of the linear layer
    after it, and an FP8 layer's rows' to its quantization kernel
    (``engine.backends.deferred_norm``)."""

    defers_norms = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        return add_rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum overwrites the residual: nothing else reads the old stream.
        return add_rms_norm(x, residual, weight, eps, residual_out=residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
