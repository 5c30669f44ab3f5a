"""Paged attention as a plain loop over sequences: the definition the attention kernels are
tested against, where the torch backend cannot serve.

The torch backend (engine/backends/pytorch.py) reads each sequence's whole blocks, and the
kernel tests fill every slot no sequence owns with NaN, so that a kernel reading one shows;
this reads only the slots it attends to. Written for clarity, not speed: it reads lengths
back to the host.
"""

from __future__ import annotations

import torch

from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.pytorch import clamped_swiglu, quantize_per_token_fp8


def paged_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed q [T, heads, dim] (sequence by sequence, query_lens[b] tokens each, the last of
    a sequence at position context_lens[b] - 1), attending causally, in float32, to the keys
    it can see: those at or before its position and, with a window, after position - window;
    with ``sinks`` [heads], each head's sink logit a column of the softmax, dropped after it
    (transformers' gpt-oss). Covers decode too (all query_lens 1). Returned in float32: a
    kernel's error is measured against it, in units of its own dtype's rounding."""
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = q.shape[1] // num_kv_heads
    outputs = []
    start = 0
    for table, context_len, query_len in zip(
        block_tables, context_lens.tolist(), query_lens.tolist(), strict=True
    ):
        key_positions = torch.arange(context_len, device=q.device)
        slots = table[key_positions // block_size] * block_size + key_positions % block_size
        keys = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        values = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        query_positions = torch.arange(context_len - query_len, context_len, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            visible &= key_positions[None, :] > query_positions[:, None] - sliding_window
        queries = q[start : start + query_len].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.float().view(-1, 1, 1).expand(-1, query_len, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += query_len
    return torch.cat(outputs)


def moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    expert_offset: int = 0,
    quantize_activations: bool = False,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """``LayerOps.moe_experts`` expert by expert, in float32 (FP8 weights dequantized):
    each local expert's picks gathered, gate and up products summed in float32, their
    activation silu(gate) * up rounded to x's dtype (as the fused kernel and the dense MLP
    round it), the down product and its routing weight in float32, added to each token's
    float32 sum. Returned in float32, for the error to be measured in units of x's dtype.
    Reads the routing back to the host.

    ``quantize_activations`` (W8A8): x and the activation are each quantized per row to
    float8 e4m3 as the dense FP8 layers quantize theirs (``quantize_per_token_fp8``) and
    multiplied dequantized.

    gpt-oss's experts: the biases added to the float32 products, and the clamped SwiGLU
    (``activation``) in place of silu(gate) * up."""
    rows = dequantized(x) if quantize_activations else x.float()
    num_experts, double_intermediate, _ = w13.shape
    intermediate = double_intermediate // 2
    gate_up = w13.float() if w13_scale is None else w13.float() * w13_scale[..., None]
    down = w2.float() if w2_scale is None else w2.float() * w2_scale[..., None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_offset
    for expert in range(num_experts):
        tokens, picks = (local == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        products = rows[tokens] @ gate_up[expert].T
        if w13_bias is not None:
            products += w13_bias[expert].float()
        if activation is None:
            gate, up = products[:, :intermediate], products[:, intermediate:]
            hidden = torch.nn.functional.silu(gate) * up
        else:
            hidden = clamped_swiglu(products, activation)
        hidden = hidden.to(x.dtype)
        hidden = dequantized(hidden) if quantize_activations else hidden.float()
        projected = hidden @ down[expert].T
        if w2_bias is not None:
            projected += w2_bias[expert].float()
        weighted = projected * topk_weights[tokens, picks, None]
        out.index_add_(0, tokens, weighted)
    return out


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] quantized per row to float8 e4m3 codes and scales, and back, in float32."""
    codes, scale = quantize_per_token_fp8(x)
    return codes.float() * scale
