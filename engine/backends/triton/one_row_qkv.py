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

Per-head Q/K norms (Qwen3's and Gemma 3's, ``Rotary.q_norm``) need a whole head's sums,
across programs (a head of 128 is 32 of them at 4 channels a program; a program a head would
leave most SMs idle). So each q or k program stores its rounded sums to ``head_values`` and
counts itself done on its head's counter (``head_counts_ptr``, ``zeroed_counters``; the
stores first, then a barrier, then the count's release); the program that finds itself its
head's last reads the whole head back from L2 (after the count's acquire), normalizes,
rotates and stores it as ``rotary_store_kv`` does (the same ``norm_and_rotate``), and sets
the counter back to zero for the next layer. Only the counts are atomic: the values, and so
the result, do not depend on which program came last. v's programs store as before.

Only for what needs nothing else between the projection and RoPE: no family's own step
between them (OLMo 2's norm over all heads); the caller asks
(``TritonPagedAttention.project_and_attend``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from engine.backends.attention import Rotary
from engine.backends.deferred_norm import LinearInput
from engine.backends.triton.dependent_launch import launch_options
from engine.backends.triton.device import zeroed_counters
from engine.backends.triton.one_row_matmul import (
    OneRowConfig,
    first_weight_chunk,
    one_row_config,
    row_operands,
    row_sums,
)
from engine.backends.triton.rotary_store import norm_and_rotate

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Registers a thread, at most: those of the one-row kernel it extends, so that the epilogue
# costs no program its place on an SM. Left to itself ptxas gives the kernel more (bf16, a
# deferred norm's row, 4 channels a program) where 80 need no spill (sm_90). An SM's 64K
# registers hold 6 programs of 4 warps at 80 a thread, 5 at the next step up (88), and then
# a 1B model's 768 QKV programs no longer fit in one wave of a 132-SM GPU.
_MAX_REGISTERS = 80


def one_row_qkv_config(
    channels: int, depth: int, weight_dtype: torch.dtype, normed: bool, head_norms: bool
) -> OneRowConfig:
    """The QKV kernel's configuration for a weight [channels, depth]: ``one_row_config``'s,
    but where the epilogue or the row's length changes what pays. Fitted to
    ``scripts/sweep_matmul_configs.py --parts qkv`` (each candidate replayed in a CUDA graph
    over weights larger than the L2) at the default models' shapes and their TP shards:

    - per-head norms (Qwen3's) over 4,096 channels or more of rows up to 4 KiB (Qwen3 0.6B's
      and 30B-A3B's whole QKV): 8 channels a program in 1 KiB chunks. Half the programs
      count on each head's counter, and the head's last program, which normalizes and
      rotates the whole head, starts sooner;
    - other rows of a deferred norm up to 2 KiB (hidden 1,024 and below): the whole row in
      one chunk, 4 channels a program, where ``one_row_config`` reads an LM head's or
      gate/up's such rows in two.

    Elsewhere in bf16 the one-row rule was the best candidate or close to it, but for
    shards of 768-1,536 channels at TP=4, where 4 KiB chunks by 8 warps measured faster
    alone (not in 1B's TP=2 shard of 1,536) and were not taken: no four-GPU step has timed
    them. fp8 codes were not swept. docs/benchmarks.md has the figures."""
    config = one_row_config(channels, depth, weight_dtype, normed)
    row_bytes = depth * weight_dtype.itemsize
    if _INTERPRETED or weight_dtype.itemsize == 1 or not normed or row_bytes > 4096:
        return config
    if head_norms and channels >= 4096:
        return OneRowConfig(8, 1024, 4)
    if row_bytes <= 2048:
        return OneRowConfig(4, 2048, 4)
    return config


@triton.jit
def _store_pair(ptr, dims, first, second, mask, HALF: tl.constexpr):
    tl.store(ptr + dims, first, mask=mask)
    tl.store(ptr + dims + HALF, second, mask=mask)


@triton.jit
def _store_head_values(
    first,
    second,
    dims,
    mask,
    head,
    slot,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    num_heads,
    num_kv_heads,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """Channels ``dims`` and ``dims + HALF`` of ``head`` (q's heads, then k's, then v's), in
    float32: q's into q, k's and v's into the cache at ``slot`` (none if negative)."""
    dtype = q_ptr.dtype.element_ty
    if head < num_heads:
        _store_pair(q_ptr + head * HEAD_DIM, dims, first.to(dtype), second.to(dtype), mask, HALF)
    else:
        if slot >= 0:  # none for a CUDA graph's padding row
            # K rounded to the model's dtype, as the reference rounds it, then to the cache's.
            cache_dtype = key_cache_ptr.dtype.element_ty
            cached_first = first.to(dtype).to(cache_dtype)
            cached_second = second.to(dtype).to(cache_dtype)
            kv_head = head - num_heads
            if kv_head < num_kv_heads:
                at = slot * stride_cache_slot + kv_head * stride_cache_head
                _store_pair(key_cache_ptr + at, dims, cached_first, cached_second, mask, HALF)
            else:
                at = slot * stride_cache_slot + (kv_head - num_kv_heads) * stride_cache_head
                _store_pair(value_cache_ptr + at, dims, cached_first, cached_second, mask, HALF)


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
    q_norm_ptr,
    k_norm_ptr,
    head_values_ptr,
    head_counts_ptr,
    K,
    stride_weight,
    eps,
    head_norm_eps,
    head_norm_offset,
    num_heads,
    num_kv_heads,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEAD_NORM: tl.constexpr,
    HEAD_NORM_ROUND_ONCE: tl.constexpr,
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
    position_row = tl.load(positions_ptr) * stride_table
    table = position_row + dims  # read by v's programs too: no branch
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
    if HEAD_NORM and head < num_heads + num_kv_heads:
        # q or k under a per-head norm: the head's last program to finish norms it whole.
        tl.store(head_values_ptr + cols, out)
        tl.debug_barrier()  # every thread's values stored before the count releases them
        finished = tl.atomic_add(head_counts_ptr + head, 1, sem="acq_rel")
        if finished == programs_per_head - 1:
            whole = tl.arange(0, BLOCK_HALF)
            mask = whole < HALF
            row = head_values_ptr + head * HEAD_DIM + whole
            # From L2 (".cg"): another SM wrote them; this SM's L1 may hold an earlier layer's.
            first = tl.load(row, mask=mask, other=0.0, cache_modifier=".cg")
            second = tl.load(row + HALF, mask=mask, other=0.0, cache_modifier=".cg")
            angles = position_row + whole
            norm_ptr = k_norm_ptr
            if head < num_heads:
                norm_ptr = q_norm_ptr
            first, second = norm_and_rotate(
                first.to(tl.float32)[None, :],
                second.to(tl.float32)[None, :],
                tl.load(cos_ptr + angles, mask=mask, other=0.0)[None, :],
                tl.load(sin_ptr + angles, mask=mask, other=0.0)[None, :],
                tl.load(cos_ptr + angles + HALF, mask=mask, other=0.0)[None, :],
                tl.load(sin_ptr + angles + HALF, mask=mask, other=0.0)[None, :],
                norm_ptr,
                head_norm_eps,
                whole,
                mask,
                HALF,
                True,
                head_norm_offset,
                HEAD_NORM_ROUND_ONCE,
            )
            _store_head_values(
                tl.reshape(first, (BLOCK_HALF,)),
                tl.reshape(second, (BLOCK_HALF,)),
                whole,
                mask,
                head,
                slot,
                q_ptr,
                key_cache_ptr,
                value_cache_ptr,
                num_heads,
                num_kv_heads,
                stride_cache_slot,
                stride_cache_head,
                HEAD_DIM,
                HALF,
            )
            tl.store(head_counts_ptr + head, 0)  # zero again for the next layer's kernel
    else:
        first, second = tl.split(tl.reshape(out.to(tl.float32), (PAIRS, 2)))
        if head < num_heads + num_kv_heads:  # q or k: rotate-half RoPE, as rotary_store_kv
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
        _store_head_values(
            first,
            second,
            dims,
            dims < HALF,
            head,
            slot,
            q_ptr,
            key_cache_ptr,
            value_cache_ptr,
            num_heads,
            num_kv_heads,
            stride_cache_slot,
            stride_cache_head,
            HEAD_DIM,
            HALF,
        )


def one_row_qkv_rotary_store(
    x: LinearInput,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    rotary: Rotary,
    *,
    config: OneRowConfig | None = None,
    max_registers: int | None = _MAX_REGISTERS,
) -> torch.Tensor:
    """q [1, num_heads, head_dim] of one row x (or a deferred norm of it) times the fused QKV
    weight [(num_heads + 2 * num_kv_heads) * head_dim, K] (x's dtype, or codes with float32
    ``scale``; plus ``bias``), each head normalized if ``rotary`` has per-head norms, rotated
    by rotate-half RoPE at ``positions`` [1] (its float32 tables [max_positions, head_dim]);
    k, likewise, and v stored at cache slot ``slot_mapping`` [1] (none if negative), in the
    cache's dtype. What ``one_row_matmul``, ``with_bias`` and ``rotary_store_kv`` compute, to
    the bit (with norms, their sums of squares may be added in another order on CUDA).
    ``config`` (``one_row_qkv_config``'s unless given) and ``max_registers`` (a thread's, None: no
    cap) for ``scripts/sweep_matmul_configs.py --parts qkv``."""
    cos, sin = rotary.cos, rotary.sin
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
    head_norm = rotary.q_norm is not None
    config = config or one_row_qkv_config(channels, depth, weight.dtype, operands.normed, head_norm)
    assert head_dim % 2 == 0
    # The rule's channels a program, in pairs of one head: fewer where half a head is not a
    # multiple of them (a power of two, as the rule's are).
    pairs = math.gcd(max(config.rows // 2, 1), head_dim // 2)
    q = operands.x.new_empty(1, num_heads, head_dim)
    if head_norm:
        assert rotary.q_norm.shape == rotary.k_norm.shape == (head_dim,)
        head_values = q.new_empty((num_heads + num_kv_heads) * head_dim)
        # Each q and k head's programs that have stored their values.
        counts = zeroed_counters(q.device, num_heads + num_kv_heads, "QKV head norms")
    else:
        head_values = counts = q  # unread without norms
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
        rotary.q_norm if head_norm else cos,
        rotary.k_norm if head_norm else cos,
        head_values,
        counts,
        depth,
        weight.stride(0),
        operands.eps,
        rotary.eps,
        rotary.norm_offset or 0.0,
        num_heads,
        num_kv_heads,
        key_cache.stride(1),
        key_cache.stride(2),
        cos.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HEAD_NORM=head_norm,
        HEAD_NORM_ROUND_ONCE=rotary.norm_offset is not None,
        HAS_BIAS=bias is not None,
        **operands.flags,
        BLOCK_N=2 * pairs,
        BLOCK_BYTES=config.chunk_bytes,
        num_warps=config.warps,
        num_stages=1,
        maxnreg=max_registers,
        **launch_options(q.device),
    )
    return q
