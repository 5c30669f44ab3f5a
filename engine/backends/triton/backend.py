"""The CUDA backend: Triton kernels behind the AttentionBackend, LayerOps and StepOps
interfaces.

Before attending, one kernel applies the Q/K norms and RoPE and writes K and V into the
cache (``rotary_store_kv``); at one row (a batch-1 decode step of a Llama or a Qwen3), the
QKV projection's one-row kernel does that in its epilogue (``one_row_qkv``).
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

The layer ops multiply one contiguous CUDA row with the one-row kernel (``takes_one_row``)
and leave it the norm before (``engine.backends.deferred_norm``). The weight-only GEMM, FP8
activations' quantization (a deferred norm's rows too, on any device), the argmax and
sampling's draw, and the pending tokens' fill are kernels on CUDA tensors and the torch
backend's ops on others: on the CPU, in Triton's interpreter (for tests), attention, the
norms, the activation and MXFP4 experts' products are interpreted kernels and the other
products PyTorch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.backends.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    OneRowProjection,
    Rotary,
)
from engine.backends.deferred_norm import DeferredNorm, LinearInput
from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.penalties import Penalties
from engine.backends.pytorch import TorchLayerOps, TorchStepOps
from engine.backends.sampling_draw import Cuts
from engine.backends.triton import (
    add_rms_norm,
    one_row_qkv_rotary_store,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
    silu_and_mul,
)
from engine.backends.triton.activation import gelu_tanh_and_mul
from engine.backends.triton.argmax import argmax_rows
from engine.backends.triton.emitted_tokens import emitted_tokens
from engine.backends.triton.fp8_matmul import fp8_matmul
from engine.backends.triton.fp8_quantize import quantize_rows_fp8
from engine.backends.triton.fused_moe import fused_moe
from engine.backends.triton.graph_inputs import fill_graph_inputs
from engine.backends.triton.moe_route import moe_route
from engine.backends.triton.mxfp4_moe import mxfp4_moe
from engine.backends.triton.norm import rms_norm_round_once
from engine.backends.triton.nucleus import draw_tokens
from engine.backends.triton.one_row_matmul import one_row_matmul
from engine.backends.triton.paged_attention import compile_split_merges
from engine.backends.triton.penalties import apply_penalties
from engine.backends.triton.pending_tokens import fill_pending_tokens
from engine.backends.triton.push_all_reduce import PushAllReduce, push_all_reduce
from engine.backends.triton.quantized_matmul import weight_only_matmul
from engine.distributed.parallel import OneKernelAllReduce, TensorParallel


def takes_one_row(x: LinearInput) -> bool:
    """Whether ``x`` is one row that a linear layer multiplies with the one-row kernel (and so a
    row whose norm can be left to that kernel, ``DeferredNorm``): one contiguous CUDA row,
    or a deferred norm of one (only these ops defer norms, and only such rows')."""
    if isinstance(x, DeferredNorm):
        return x.x.shape[0] == 1
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1


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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rotary_store_kv(
            q, k, v, cache.key, cache.value, metadata.slot_mapping, metadata.positions, rotary
        )
        return self._attend(q, cache, metadata, scale, sliding_window, sinks)

    def compile_eager_variants(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        query_len: int,
        max_batch: int,
        max_context_len: int,
        sinks: torch.Tensor | None = None,
    ) -> None:
        # The split merge's tile follows a step's split count and rows.
        compile_split_merges(q, cache.key, query_len, max_batch, max_context_len, sinks)

    def project_and_attend(
        self,
        x: LinearInput,
        qkv_proj: OneRowProjection,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rotary: Rotary,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        # One row (a batch-1 decode step): the one-row kernel projects, norms each head (its
        # last program, Qwen3's), rotates and stores.
        if not takes_one_row(x):
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
            rotary,
        )
        return self._attend(q, cache, metadata, scale, sliding_window, sinks)

    def _attend(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None,
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
                sinks=sinks,
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
                sinks=sinks,
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
            sinks=sinks,
        )


class TritonLayerOps(TorchLayerOps):
    """The fused kernels; norms of [T, heads, head_dim] views stay in PyTorch, but for the
    round-once norm's (Gemma's per-head Q/K norms). A norm of one row is left to the one-row
    kernel of the linear layer after it, and an FP8 layer's rows' to its quantization kernel
    (``engine.backends.deferred_norm``)."""

    defers_norms = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2:
            return super().rms_norm(x, weight, eps)
        return add_rms_norm(x, None, weight, eps)[0]

    def rms_norm_round_once(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
    ) -> torch.Tensor:
        # One kernel where PyTorch's float32 steps take about ten, six times a Gemma layer.
        if x.dim() not in (2, 3) or x.stride(-1) != 1:
            return super().rms_norm_round_once(x, weight, eps, weight_offset)
        return rms_norm_round_once(x, weight, eps, weight_offset)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum overwrites the residual: nothing else reads the old stream.
        return add_rms_norm(x, residual, weight, eps, residual_out=residual)

    def add_rms_norm_round_once(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        weight_offset: float = 0.0,
        output_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The sum overwrites the residual, as add_rms_norm's.
        return add_rms_norm(
            x,
            residual,
            weight,
            eps,
            residual_out=residual,
            weight_offset=weight_offset,
            output_norm_weight=output_norm_weight,
        )

    def normalize(self, norm: DeferredNorm) -> torch.Tensor:
        residual_out = None if norm.residual is None else norm.stream
        normalized, _ = add_rms_norm(
            norm.x, norm.residual, norm.weight, norm.eps, residual_out=residual_out
        )
        return normalized

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)

    def linear(
        self, x: LinearInput, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # One row (a batch-1 decode step, a prompt's LM head): the one-row kernel reads the
        # weight faster than cuBLAS, computes a deferred norm of the row as it reads it, and
        # adds the bias as it stores (no add kernel of its own in the chain of launches).
        if takes_one_row(x):
            return one_row_matmul(x, weight, bias=bias)
        return super().linear(x, weight, bias)

    def linear_float32(self, x: LinearInput, weight: torch.Tensor) -> torch.Tensor:
        if takes_one_row(x):
            return one_row_matmul(x, weight, out_dtype=torch.float32)
        return super().linear_float32(x, weight)

    def takes_one_row(self, x: LinearInput) -> bool:
        return takes_one_row(x)

    def one_row_matmul(
        self,
        x: LinearInput,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
        all_reduce: OneKernelAllReduce | None = None,
    ) -> torch.Tensor:
        assert all_reduce is None or isinstance(all_reduce, PushAllReduce)
        return one_row_matmul(
            x, weight, scale, gated=gated, bias=bias, add=add, all_reduce=all_reduce
        )

    def weight_only_matmul(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, gated: bool = False
    ) -> torch.Tensor:
        if x.is_cuda:
            return weight_only_matmul(x, codes, scale, gated=gated)
        return super().weight_only_matmul(x, codes, scale, gated=gated)

    def quantize_fp8(
        self, x: LinearInput, *, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One kernel instead of PyTorch's eight; a deferred norm (only these ops defer them,
        # and only where this kernel computes it) computed in it.
        if isinstance(x, DeferredNorm) or x.is_cuda:
            return quantize_rows_fp8(x, gated=gated)
        return super().quantize_fp8(x, gated=gated)

    def fp8_matmul(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        if codes.is_cuda:
            return fp8_matmul(codes, scale, weight, weight_scale, out_dtype)
        return super().fp8_matmul(codes, scale, weight, weight_scale, out_dtype)

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if router_logits.is_cuda:  # one kernel where PyTorch launches five or six
            return moe_route(router_logits.contiguous(), top_k, renormalize)
        return super().moe_route(router_logits, top_k, renormalize)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None,
        expert_offset: int = 0,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        # A decode step's few pairs by pair, two kernels (moe_decode.py); otherwise align,
        # two grouped GEMMs with the activation (and biases) and the routing weights in their
        # epilogues, combine: four or five. No host sync (CUDA graphs replay any routing).
        experts = (x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, expert_offset)
        variant = {"w13_bias": w13_bias, "w2_bias": w2_bias, "activation": activation}
        if w13.dtype == torch.uint8:
            # MXFP4 (--quantization mxfp4): its kernels read it, on any device (on the CPU in
            # Triton's interpreter, as attention's kernels run there), so that a model's
            # tests run them.
            return mxfp4_moe(*experts, **variant)
        if x.is_cuda:
            return fused_moe(*experts, **variant)
        return super().moe_experts(*experts, **variant)  # the torch backend's reference

    def one_kernel_all_reduce(
        self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_bytes: int
    ) -> OneKernelAllReduce | None:
        # Stores into the peers' buffers: no barrier, and launched dependent.
        return push_all_reduce(tp, device, dtype, max_bytes)


class TritonStepOps(TorchStepOps):
    """A kernel each where PyTorch launches several or reduces a row in one thread block
    (``argmax`` and ``nucleus`` for sampling, ``penalties``, ``pending_tokens``,
    ``graph_inputs``; the grammar library's for its masks): between two steps' CUDA graphs
    each launch leaves the device a gap."""

    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        if values.is_cuda:
            return argmax_rows(values)
        return super().argmax_rows(values)

    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        step: torch.Tensor,
        cuts: Cuts | None,
    ) -> torch.Tensor:
        if logits.is_cuda:
            return draw_tokens(logits, temperature, seed, step, cuts)
        return super().sample_rows(logits, temperature, seed, step, cuts)

    def apply_penalties(self, logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
        if logits.is_cuda:
            return apply_penalties(logits, penalties)
        return super().apply_penalties(logits, penalties)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if not logits.is_cuda:
            return super().apply_token_bitmask(logits, bitmask)
        import xgrammar as xgr  # the grammar library's Triton kernel

        xgr.apply_token_bitmask_inplace(logits, bitmask, backend="triton")

    def emitted_tokens(
        self,
        sampled: torch.Tensor,
        next_drafts: torch.Tensor,
        row_starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        if sampled.is_cuda:
            return emitted_tokens(sampled, next_drafts, row_starts, width)
        return super().emitted_tokens(sampled, next_drafts, row_starts, width)

    def fill_pending_tokens(
        self,
        input_ids: torch.Tensor,
        index: torch.Tensor,
        source: torch.Tensor,
        last_sampled: torch.Tensor,
    ) -> None:
        if input_ids.is_cuda:
            fill_pending_tokens(input_ids, index, source, last_sampled)
        else:
            super().fill_pending_tokens(input_ids, index, source, last_sampled)

    def fill_graph_inputs(
        self,
        buffers: Sequence[torch.Tensor],
        num_rows: int,
        query_len: int,
        step: Sequence[torch.Tensor] | None = None,
    ) -> None:
        fill_graph_inputs(buffers, num_rows, query_len, step)
