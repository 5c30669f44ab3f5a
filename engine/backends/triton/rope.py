"""Rotary position embedding (rotate-half convention), applied to Q and K in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    num_heads,
    cos_first,
    sin_first,
    cos_second,
    sin_second,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """x = x * cos + rotate_half(x) * sin for all heads of one token, where
    rotate_half([a, b]) = [-b, a]; computed in float32."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    first_ptr = x_ptr + token * stride_token + heads * stride_head + dims
    first = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    new_first = first * cos_first - second * sin_first
    new_second = second * cos_second + first * sin_second
    tl.store(first_ptr, new_first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptr + HALF, new_second.to(x_ptr.dtype.element_ty), mask=mask)


# The positions are a view of the step's packed inputs, at any alignment: one variant.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program per token: its position's cos/sin row is loaded once for Q's and K's heads."""
    token = tl.program_id(0)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = dims < HALF
    table_ptr = tl.load(positions_ptr + token) * stride_table + dims
    cos_first = tl.load(cos_ptr + table_ptr, mask=mask, other=0.0)
    sin_first = tl.load(sin_ptr + table_ptr, mask=mask, other=0.0)
    cos_second = tl.load(cos_ptr + table_ptr + HALF, mask=mask, other=0.0)
    sin_second = tl.load(sin_ptr + table_ptr + HALF, mask=mask, other=0.0)
    _rotate_heads(
        q_ptr,
        token,
        stride_q_token,
        stride_q_head,
        num_heads,
        cos_first,
        sin_first,
        cos_second,
        sin_second,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        token,
        stride_k_token,
        stride_k_head,
        num_kv_heads,
        cos_first,
        sin_first,
        cos_second,
        sin_second,
        HALF,
        BLOCK_KV_H,
        BLOCK_HALF,
    )


def apply_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] in place.

    cos, sin: float32 [max_positions, head_dim] tables, row p for position p (as the
    model's RotaryEmbedding builds them); positions: [T] int. q and k may be strided views
    (of a fused QKV output) as long as head_dim is contiguous.
    """
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert positions.shape == (num_tokens,) and q.dtype == k.dtype
    assert cos.shape == sin.shape and cos.shape[1] == head_dim
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride()
    assert cos.stride(1) == 1 and q.stride(-1) == 1 and k.stride(-1) == 1
    _rope_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos,
        sin,
        num_heads,
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
