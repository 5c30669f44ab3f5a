"""Writing the step's new keys and values into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The slot mapping is a view of the step's packed inputs, at any alignment: one variant.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program per token: all its KV heads, K and V."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    # A negative slot marks a padding token (a CUDA graph's batch padded to its captured
    # size): it has no place in the cache.
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    cache_offsets = slot * stride_cache_slot + heads * stride_cache_head + dims
    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
    )
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy key/value [T, num_kv_heads, head_dim] to the caches' flat slots ``slot_mapping``.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
    + offset, and tokens with a negative slot are skipped. key and value may be strided
    views (of a fused QKV output) as long as head_dim is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and key_cache[0, 0].is_contiguous()
    assert key.dtype == value.dtype == key_cache.dtype == value_cache.dtype
    assert key.stride(-1) == value.stride(-1) == 1
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(1),
        key_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
