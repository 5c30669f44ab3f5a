"""Paged attention as a plain loop over sequences: the definition the attention kernels are
tested against, where the torch backend cannot serve.

The torch backend (engine/backends/pytorch.py) reads each sequence's whole blocks, and the
kernel tests fill every slot no sequence owns with NaN, so that a kernel reading one shows;
this reads only the slots it attends to. Written for clarity, not speed: it reads lengths
back to the host.
"""

from __future__ import annotations

import torch


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
    Covers decode too (all query_lens 1). Returned in float32: a kernel's error is measured
    against it, in units of its own dtype's rounding."""
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
    return torch.cat(outputs)
