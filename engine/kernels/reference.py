"""Plain PyTorch versions of the kernels: the definitions the kernels are tested against.

Written for clarity, not speed: they loop over sequences and read lengths back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:])[slot_mapping[keep]] = key[keep]
    value_cache.view(num_slots, *value_cache.shape[2:])[slot_mapping[keep]] = value[keep]


def paged_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Packed q [T, heads, dim] (sequence by sequence, query_lens[b] tokens each, the last of
    a sequence at position context_lens[b] - 1), attending causally, in float32, to the keys
    it can see: those at or before its position and, with a window, after position - window.
    Covers decode too (all query_lens 1)."""
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
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
        start += query_len
    return torch.cat(outputs).to(q.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's residual add and RMSNorm: the norm in float32, cast before the weight."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE computed in float32; returns new (q, k)."""
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
