"""One row's QKV projection with RoPE and the cache write in its epilogue: a batch-1 decode
step's attention input in one kernel, where the one-row GEMV and ``rotary_store_kv`` took two.

At batch 1 the rotary kernel is one program with almost nothing to do, yet a launch of its
own on every layer's critical path, between the projection and attention. Here each program
of the one-row kernel (``row_sums``: the same sums, chunks and configuration as
``one_row_matmul``'s) takes output channels in pairs, channel d and channel d + head_dim / 2
of one head, the two that rotate-half RoPE mixes. Its sums are rounded to
the model's dtype as the projection stores them, a bias added as ``with_bias`` adds it, then
q's and k's pairs are rotated in float32 and rounded again, exactly as ``rotary_store_kv``
rounds them: q goes to its own tensor, k and v straight into the cache.

The epilogue's inputs (the position, its angles, the slot) are read before the kernel waits
for the one before, as its first weight chunk is (``dependent_launch``): read after the
sums, two loads one after the other made each program's tail about as long as the rotary
kernel it replaced. ``scripts/profile_step.py --model DIR --batch 1 --rounds 3`` times the
batch-1 step (run on two trees to compare them).

Only for what needs nothing else between the projection and RoPE: no per-head norm (Qwen3's
needs a whole head's sums, across programs), no family's own step between them (Gemma 3's,
OLMo 2's); the caller asks (``TritonPagedAttention.project_and_attend``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.backends.deferred_norm import LinearInput
from engine.backends.triton.dependent_launch import launch_options
from engine.backends.triton.one_row_matmul import (
    first_weight_chunk,
    one_row_config,
    row_operands,
    row_sums,
)
from engine.backends.triton.rotary_store import norm_and_rotate

# Registers a thread, at most: those of the one-row kernel it extends, so that the epilogue
# costs no program its place on an SM. Left to itself ptxas gives the kernel more (bf16, a
# deferred norm's row, 4 channels a program) where 80 need no spill (sm_90). An SM's 64K
# registers hold 6 programs of 4 warps at 80 a thread, 5 at the next step up (88), and then
# a 1B model's 768 QKV programs no longer fit in one wave of a 132-SM GPU.
_MAX_REGISTERS = 80


@triton.jit
def _store_pair(ptr, dims, first, second, HALF: tl.constexpr):
    tl.store(ptr + dims, first)
    tl.store(ptr + dims + HALF, second)


# The positions and slots are views of the step's packed inputs, at any alignment: one
# variant (engine/execution/warm_up.py).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _one_row_qkv_kernel(
    x_ptr,
    weight_ptr,
    scale_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    bias_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    K,
    stride_weight,
    eps,
    num_heads,
    num_kv_heads,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """Program per BLOCK_N / 2 channel pairs of one head (q's heads, then k's, then v's):
    rows interleaved, each pair's first-half channel then its second-half one."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = HEAD_DIM // 2
    programs_per_head = HALF // PAIRS
    head = tl.program_id(0) // programs_per_head
    dims = tl.program_id(0) % programs_per_head * PAIRS + tl.arange(0, PAIRS)
    rows = tl.arange(0, BLOCK_N)
    cols = head * HEAD_DIM + tl.program_id(0) % programs_per_head * PAIRS + rows // 2
    cols += rows % 2 * HALF
    col_mask = cols >= 0  # every row is real: the grid covers the heads exactly
    weight = first_weight_chunk(cols, col_mask, weight_ptr, K, stride_weight, BLOCK_BYTES)
    # What the epilogue reads, read before the wait too, as the weight is: the step's
    # position and slot, written before its forward pass, and the RoPE tables, never.
    slot = tl.load(slot_mapping_ptr)
    table = tl.load(positions_ptr) * stride_table + dims  # read by v's programs too: no branch
    cos_first = tl.load(cos_ptr + table)
    sin_first = tl.load(sin_ptr + table)
    cos_second = tl.load(cos_ptr + table + HALF)
    sin_second = tl.load(sin_ptr + table + HALF)
    out = row_sums(
        weight,
        cols,
        col_mask,
        x_ptr,
        weight_ptr,
        scale_ptr,
        residual_ptr,
        norm_weight_ptr,
        stream_ptr,
        K,
        stride_weight,
        eps,
        HAS_SCALE,
        GATED,
        NORM,
        HAS_RESIDUAL,
        BLOCK_BYTES,
    )
    dtype = q_ptr.dtype.element_ty
    # Rounded as the projection stores its output, and its bias added as with_bias adds it.
    out = out.to(dtype)
    if HAS_BIAS:
        out = (out.to(tl.float32) + tl.load(bias_ptr + cols).to(tl.float32)).to(dtype)
    first, second = tl.split(tl.reshape(out.to(tl.float32), (PAIRS, 2)))
    if head < num_heads + num_kv_heads:  # q or k: rotate-half RoPE, as rotary_store_kv does
        first, second = norm_and_rotate(
            first,
            second,
            cos_first,
            sin_first,
            cos_second,
            sin_second,
            cos_ptr,  # no norm: unread
            0.0,
            dims,
            dims < HALF,
            HALF,
            False,
        )
    if head < num_heads:
        _store_pair(q_ptr + head * HEAD_DIM, dims, first.to(dtype), second.to(dtype), HALF)
    else:
        if slot >= 0:  # none for a CUDA graph's padding row
            # K rounded to the model's dtype, as the reference rounds it, then to the cache's.
            cache_dtype = key_cache_ptr.dtype.element_ty
            cached_first = first.to(dtype).to(cache_dtype)
            cached_second = second.to(dtype).to(cache_dtype)
            kv_head = head - num_heads
            if kv_head < num_kv_heads:
                at = slot * stride_cache_slot + kv_head * stride_cache_head
                _store_pair(key_cache_ptr + at, dims, cached_first, cached_second, HALF)
            else:
                at = slot * stride_cache_slot + (kv_head - num_kv_heads) * stride_cache_head
                _store_pair(value_cache_ptr + at, dims, cached_first, cached_second, HALF)


def one_row_qkv_rotary_store(
    x: LinearInput,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """q [1, num_heads, head_dim] of one row x (or a deferred norm of it) times the fused QKV
    weight [(num_heads + 2 * num_kv_heads) * head_dim, K] (x's dtype, or codes with float32
    ``scale``; plus ``bias``), rotated by rotate-half RoPE at ``positions`` [1] (float32
    tables [max_positions, head_dim]); k, rotated, and v stored at cache slot
    ``slot_mapping`` [1] (none if negative), in the cache's dtype. What ``one_row_matmul``,
    ``with_bias`` and ``rotary_store_kv`` compute, to the bit."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache[0, 0].is_contiguous()
    channels, depth = weight.shape
    num_heads = channels // head_dim - 2 * num_kv_heads
    assert channels == (num_heads + 2 * num_kv_heads) * head_dim and num_heads > 0
    assert positions.shape == slot_mapping.shape == (1,)
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == 1
    assert bias is None or bias.shape == (channels,)
    operands = row_operands(x, weight, scale)
    config = one_row_config(channels, depth, weight.dtype, operands.normed)
    assert head_dim % 2 == 0
    # The rule's channels a program, in pairs of one head: fewer where half a head is not a
    # multiple of them (a power of two, as the rule's are).
    pairs = math.gcd(max(config.rows // 2, 1), head_dim // 2)
    q = operands.x.new_empty(1, num_heads, head_dim)
    _one_row_qkv_kernel[(channels // (2 * pairs),)](
        *operands.pointers,
        weight if bias is None else bias,  # unread without a bias
        q,
        key_cache,
        value_cache,
        slot_mapping,
        positions,
        cos,
        sin,
        depth,
        weight.stride(0),
        operands.eps,
        num_heads,
        num_kv_heads,
        key_cache.stride(1),
        key_cache.stride(2),
        cos.stride(0),
        HEAD_DIM=head_dim,
        HAS_BIAS=bias is not None,
        **operands.flags,
        BLOCK_N=2 * pairs,
        BLOCK_BYTES=config.chunk_bytes,
        num_warps=config.warps,
        num_stages=1,
        maxnreg=_MAX_REGISTERS,
        **launch_options(q.device),
    )
    return q
