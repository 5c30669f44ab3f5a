"""Everything between the QKV projection and attention, in one pass over each token: the
per-head Q/K RMSNorms (Qwen3's), rotate-half RoPE on Q (in place) and K, and K and V
written into the paged cache. One kernel a layer where PyTorch ran a dozen."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.attention import Rotary
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)


@triton.jit
def norm_and_rotate(
    first,
    second,
    cos_first,
    sin_first,
    cos_second,
    sin_second,
    norm_ptr,
    eps,
    dims,
    dim_mask,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    norm_offset=0.0,
    ROUND_ONCE: tl.constexpr = False,
):
    """The float32 halves [heads, HALF] of each head, normalized (if NORM) as Llama's
    RMSNorm rounds (in float32, rounded to the weight's dtype, the model's, times the
    weight; ROUND_ONCE: as Gemma's, times norm_offset + the weight in float32, then
    rounded), then rotated: x * cos + rotate_half(x) * sin, where rotate_half([a, b]) =
    [-b, a]. In float32; the caller rounds once."""
    if NORM:
        square_sum = tl.sum(first * first, 1) + tl.sum(second * second, 1)
        inv_rms = tl.rsqrt(square_sum / (2 * HALF) + eps)[:, None]
        weight_first = tl.load(norm_ptr + dims, mask=dim_mask, other=0.0)[None, :]
        weight_second = tl.load(norm_ptr + HALF + dims, mask=dim_mask, other=0.0)[None, :]
        dtype = weight_first.dtype
        if ROUND_ONCE:
            first = (first * inv_rms * (weight_first.to(tl.float32) + norm_offset)).to(dtype)
            second = (second * inv_rms * (weight_second.to(tl.float32) + norm_offset)).to(dtype)
        else:
            first = (first * inv_rms).to(dtype) * weight_first
            second = (second * inv_rms).to(dtype) * weight_second
        first = first.to(tl.float32)
        second = second.to(tl.float32)
    new_first = first * cos_first - second * sin_first
    new_second = second * cos_second + first * sin_second
    return new_first, new_second


# The positions and slots are views of the step's packed inputs, at any alignment: one
# variant (engine/execution/warm_up.py).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _rotary_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    norm_offset,
    num_heads,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
    NORM: tl.constexpr,
    NORM_ROUND_ONCE: tl.constexpr,
):
    """Program per token: Q's heads rotated in place, then K's rotated and K and V stored
    at the token's slot (none for a negative slot: a CUDA graph's padding row)."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    token = tl.program_id(0)
    dtype = q_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    # Read only when ROTATE (the branch below then sets them).
    cos_first = 0.0
    sin_first = 0.0
    cos_second = 0.0
    sin_second = 0.0
    if ROTATE:
        table = tl.load(positions_ptr + token) * stride_table + dims
        cos_first = tl.load(cos_ptr + table, mask=dim_mask, other=0.0)[None, :]
        sin_first = tl.load(sin_ptr + table, mask=dim_mask, other=0.0)[None, :]
        cos_second = tl.load(cos_ptr + table + HALF, mask=dim_mask, other=0.0)[None, :]
        sin_second = tl.load(sin_ptr + table + HALF, mask=dim_mask, other=0.0)[None, :]

        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < num_heads) & dim_mask[None, :]
        q_first_ptr = q_ptr + token * stride_q_token + heads * stride_q_head + dims[None, :]
        q_first, q_second = norm_and_rotate(
            tl.load(q_first_ptr, mask=mask, other=0.0).to(tl.float32),
            tl.load(q_first_ptr + HALF, mask=mask, other=0.0).to(tl.float32),
            cos_first,
            sin_first,
            cos_second,
            sin_second,
            q_norm_ptr,
            eps,
            dims,
            dim_mask,
            HALF,
            NORM,
            norm_offset,
            NORM_ROUND_ONCE,
        )
        tl.store(q_first_ptr, q_first.to(dtype), mask=mask)
        tl.store(q_first_ptr + HALF, q_second.to(dtype), mask=mask)

    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    kv_heads = tl.arange(0, BLOCK_KV_H)[:, None]
    kv_mask = (kv_heads < num_kv_heads) & dim_mask[None, :]
    cache_offsets = slot * stride_cache_slot + kv_heads * stride_cache_head + dims[None, :]
    k_first_ptr = k_ptr + token * stride_k_token + kv_heads * stride_k_head + dims[None, :]
    k_first = tl.load(k_first_ptr, mask=kv_mask, other=0.0)
    k_second = tl.load(k_first_ptr + HALF, mask=kv_mask, other=0.0)
    if ROTATE:
        k_first, k_second = norm_and_rotate(
            k_first.to(tl.float32),
            k_second.to(tl.float32),
            cos_first,
            sin_first,
            cos_second,
            sin_second,
            k_norm_ptr,
            eps,
            dims,
            dim_mask,
            HALF,
            NORM,
            norm_offset,
            NORM_ROUND_ONCE,
        )
    # K rounded to the model's dtype, as the reference rounds it, then to the cache's.
    cache_dtype = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + cache_offsets, k_first.to(dtype).to(cache_dtype), mask=kv_mask)
    k_second = k_second.to(dtype).to(cache_dtype)
    tl.store(key_cache_ptr + cache_offsets + HALF, k_second, mask=kv_mask)
    v_first_ptr = v_ptr + token * stride_v_token + kv_heads * stride_v_head + dims[None, :]
    v_first = tl.load(v_first_ptr, mask=kv_mask).to(cache_dtype)
    tl.store(value_cache_ptr + cache_offsets, v_first, mask=kv_mask)
    v_second = tl.load(v_first_ptr + HALF, mask=kv_mask).to(cache_dtype)
    tl.store(value_cache_ptr + cache_offsets + HALF, v_second, mask=kv_mask)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    rotary: Rotary | None = None,
) -> None:
    """Apply ``rotary`` (None: nothing) to q [T, num_heads, head_dim] in place and to k
    [T, num_kv_heads, head_dim], and copy k and v to the caches' flat slots ``slot_mapping``
    (block * block_size + offset; a negative slot is skipped), in the caches' dtype (q's,
    or float8 e4m3 for an fp8 cache). k is left as it was.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; q, k and v may be strided
    views (of a fused QKV output) as long as head_dim is contiguous. positions: [T] int,
    the rows of rotary's float32 [max_positions, head_dim] tables.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _ = k.shape
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert slot_mapping.shape == (num_tokens,)
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and key_cache[0, 0].is_contiguous()
    assert q.dtype == k.dtype == v.dtype
    assert key_cache.dtype == value_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    if rotary is None:
        cos = sin = q_norm = k_norm = key_cache  # unread: the kernel is built without them
        positions = slot_mapping
        eps = 0.0
        norm_offset = None
    else:
        assert positions is not None and positions.shape == (num_tokens,)
        cos, sin = rotary.cos, rotary.sin
        assert cos.shape == sin.shape and cos.shape[1] == head_dim
        assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride()
        assert cos.stride(1) == 1
        q_norm = rotary.q_norm if rotary.q_norm is not None else cos
        k_norm = rotary.k_norm if rotary.k_norm is not None else cos
        if rotary.q_norm is not None:
            assert q_norm.shape == k_norm.shape == (head_dim,) and q_norm.dtype == q.dtype
        eps = rotary.eps
        norm_offset = rotary.norm_offset
    _rotary_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        positions,
        cos,
        sin,
        q_norm,
        k_norm,
        eps,
        norm_offset or 0.0,
        num_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(1),
        key_cache.stride(2),
        cos.stride(0),
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        ROTATE=rotary is not None,
        NORM=rotary is not None and rotary.q_norm is not None,
        NORM_ROUND_ONCE=norm_offset is not None,
        **launch_options(q.device),
    )
