"""Attention over the paged KV cache, behind one small interface.

The model calls ``backend.forward(q, k, v, layer_cache, metadata, scale, sliding_window)``
and nothing else, so a GPU backend (Triton kernels) can replace this PyTorch one without
touching the model. The batch is packed: the new tokens of every sequence in one [T, ...]
tensor, prefills and decodes mixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class LayerKVCache:
    """One layer's slice of the cache: [num_blocks, block_size, num_kv_heads, head_dim] each."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where each new token sits, for every layer of one forward pass. Built once per step."""

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot (block * block_size + offset)
    token_seq_index: torch.Tensor  # [T] int64, which sequence of the batch each token is in
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64, tokens in the cache once this step's are written
    query_lens: torch.Tensor  # [B] int64, new tokens of each sequence in this step
    query_starts: torch.Tensor  # [B] int64, index in the packed batch of each one's first
    max_query_len: int


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k and v into the cache, then attend each query to its sequence's cache.

        With ``sliding_window`` (the layer's; None for full attention) a query at position p
        attends only to the keys at positions p - sliding_window + 1 to p. The reference masks
        the older ones; a kernel should skip the cache blocks that lie wholly before the window.
        """
        ...


class TorchPagedAttention:
    """The reference backend: gathers each sequence's cache and runs masked SDPA on a padded batch.

    Simple and exact; it copies every sequence's whole context each layer, which a
    paged-attention kernel avoids.
    """

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
        num_blocks, block_size, num_kv_heads, head_dim = cache.key.shape
        key_flat = cache.key.view(num_blocks * block_size, num_kv_heads, head_dim)
        value_flat = cache.value.view(num_blocks * block_size, num_kv_heads, head_dim)
        key_flat.index_copy_(0, metadata.slot_mapping, k)
        value_flat.index_copy_(0, metadata.slot_mapping, v)

        batch, max_blocks = metadata.block_tables.shape
        context = max_blocks * block_size
        # [B, heads, context, head_dim]: each sequence's cache in order, garbage past its length.
        keys = cache.key[metadata.block_tables].view(batch, context, num_kv_heads, head_dim)
        values = cache.value[metadata.block_tables].view(batch, context, num_kv_heads, head_dim)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)

        # Scatter the packed queries into a [B, max_query_len] grid.
        num_heads = q.shape[1]
        first_new_position = metadata.context_lens - metadata.query_lens
        column = metadata.positions - first_new_position[metadata.token_seq_index]
        grid_index = metadata.token_seq_index * metadata.max_query_len + column
        q_grid = q.new_zeros(batch * metadata.max_query_len, num_heads, head_dim)
        q_grid[grid_index] = q
        q_grid = q_grid.view(batch, metadata.max_query_len, num_heads, head_dim).transpose(1, 2)

        # A query sees the keys at or before its own position; grid padding sits at
        # position 0 so its row is never empty (an empty row would give NaN).
        query_positions = torch.zeros(
            batch * metadata.max_query_len, dtype=torch.int64, device=q.device
        )
        query_positions[grid_index] = metadata.positions
        key_positions = torch.arange(context, device=q.device).view(1, 1, -1)
        query_positions = query_positions.view(batch, -1, 1)
        mask = key_positions <= query_positions
        if sliding_window is not None:
            # The window includes the query's own key, so padding rows still see key 0.
            mask &= key_positions > query_positions - sliding_window

        out = F.scaled_dot_product_attention(
            q_grid,
            keys,
            values,
            attn_mask=mask.unsqueeze(1),
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch * metadata.max_query_len, num_heads, head_dim)
        return out[grid_index]
