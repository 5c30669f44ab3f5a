"""A mixture-of-experts layer's experts at a decode step's few (token, pick) pairs: two
matrix-vector kernels, no alignment and no combine (``fused_moe`` takes this path where
``takes_decode_path`` says; the grouped GEMMs otherwise).

At one token the K picks are K distinct experts: there is nothing to group, and the grouped
path's four kernels (align, gate/up, down, combine) cost more in their chain of launches
than in reading (Qwen3-30B-A3B: 12 kernels a layer at batch 1, each a few percent of its
floor). Here:

1. Gate/up (``_gate_up_pair_kernel``): a program per (pair, BLOCK_N columns of each half)
   reads its expert id from ``topk_ids`` itself and multiplies the token's row of x with
   those gate and up rows on the CUDA cores, as the one-row kernel does (the weight straight
   into registers, float32 products, one reduction at the end); the epilogue as the grouped
   kernel's (FP8 codes' scales, gpt-oss's biases and clamped SwiGLU), rounded to x's dtype
   into ``hidden[pair]``. A pair of another rank's expert returns at once. Or
   (``_gate_up_token_kernel``, ``MoeDecodeConfig.by_token``) a program per (token, BLOCK_N
   columns) walks the token's picks one step after another, the next step's rows loaded
   before the one in hand is reduced: at one token a single wave of programs, each a stream
   of K experts' rows, against K waves of programs that each wait on an expert id, read one
   step and end; each pick's activation goes out after its last step.
2. Down (``_down_token_kernel``): a program per (token, BLOCK_N output channels) reads all of
   its K picks' rows at once, a [K, BLOCK_N, BLOCK_K] load a step: K experts' bytes in flight
   together rather than one expert after another (a first by-pair path looped over the picks
   and was slower than the grouped kernels, latency-bound: 4 KiB in flight a program),
   reduced a step at a time within each warp into float32 sums per (pick, channel). Each
   pick's sums are scaled by its routing weight (and FP8 scales; a bias, times the
   weight), summed over the picks in a fixed order and written once in x's dtype: the
   combine, without partial sums or atomics, the same bits run to run. Another rank's picks
   are masked off (their activations never written) and add nothing. With ``prefetch`` its
   loop, too, loads the next step before reducing the one in hand.

Duplicate experts among the pairs (two tokens picking one expert) are read once a pair here,
once in all by the grouped kernels; so this path stops where duplicates stop being rare
(``takes_decode_path``). Each kernel's step is 8192 products (16 KiB of bf16 weights, 8 of
fp8) over 8 warps (4 where a program walks its picks: ``moe_decode_config``), as the one-row
kernel's best bf16 configurations read: enough bytes in flight for a few programs an SM to
keep the memory busy, and at one token hundreds of programs or more (Qwen3-30B-A3B 384 a
token's walking its picks and 256, Mixtral 14,336 and 512).

MXFP4 weights (``mxfp4_moe``'s decode steps, gpt-oss's 4 picks) take the by-token kernels'
``MXFP4`` variant: a step is loaded as bytes and block scales, each nibble widened in
registers and multiplied by the activation it meets (the even and odd columns loaded apart),
summed a block of 32, then scaled (``mxfp4_widen``); steps of whole blocks.

Launched dependent as every MoE kernel. The down kernel reads its picks' ids, routing
weights and first chunk of weights before waiting for the gate/up kernel: the routing was
written by a kernel before that one, which the gate/up programs waited for before letting
this kernel start (``dependent_launch``), so it is complete; the weights are never written.
The read then overlaps the gate/up kernel's last programs. Nothing is read back to the
host and the grids follow from T, K, H and I: captured in CUDA graphs for any routing.

The experts' rows (bf16 and FP8) are loaded evict-first: a step reads each once, and a
layer's picks are the step's largest read by far (Qwen3-30B-A3B's 75 MB a layer at one token,
more than L2 holds), so left as other lines they would push out of L2 what the layer's other
kernels read again or load ahead of their waits. Which lines that keeps is not measured
apart; the batch-1 step is faster with it (docs/benchmarks.md, Mixtures of experts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.backends.fp8 import FP8, WEIGHT_ONLY_MAX_TOKENS
from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.triton.activation import gated_activation
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)
from engine.backends.triton.fp8_widen import widen
from engine.backends.triton.mxfp4_widen import (
    MXFP4_BLOCK,
    block_scales,
    load_mxfp4_rows,
    nibble_products,
)
from engine.backends.triton.one_row_matmul import READ_ONCE

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Products a program step: 32 a thread of 8 warps (the one-row kernel's 4 rows x 4 KiB).
_STEP_PRODUCTS = 8192
_WARPS = 8
# Registers a thread, at most: 4 programs of 8 warps an SM (64K registers), a step's 16 KiB
# in flight each. Left to itself ptxas gives the gate/up kernel 72 (3 programs) where 64
# spill nothing in bf16 (4 bytes with fp8 codes' widening; sm_90, both kernels, K 2 to 8).
_MAX_REGISTERS = 64
# The weight bytes a depth's steps may read, at most, over its own: beyond, the grouped
# kernels' short steps (``takes_decode_path``).
_MOST_MASKED = 1.125


@dataclass(frozen=True)
class MoeDecodeConfig:
    """The two kernels' blocks: gate/up ``gate_up_columns`` of each half a program,
    ``gate_up_depth`` of H a step; down ``down_rows`` output channels a program,
    ``down_depth`` of I a step (of every pick at once). ``by_token``: a gate/up program per
    token's columns walks its picks (``_gate_up_token_kernel``), not one a pair's.
    ``prefetch``: each program's loop loads its next step before reducing the one loaded
    (two steps in flight). ``max_registers``: a thread's (None: ptxas's choice)."""

    gate_up_columns: int
    gate_up_depth: int
    down_rows: int
    down_depth: int
    warps: int
    by_token: bool = False
    prefetch: bool = False
    max_registers: int | None = _MAX_REGISTERS


def takes_decode_path(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    mxfp4: bool = False,
) -> bool:
    """Whether ``fused_moe`` takes this path for ``num_tokens`` tokens' ``top_k`` picks over
    ``num_experts`` local experts of [2 * intermediate, hidden]: one token (its picks are
    distinct experts: nothing to group), or up to E / 8 pairs. P pairs spread over E experts
    repeat about P^2 / 2E of them, so there this path reads at most 1/16 more weight bytes than
    the grouped kernels, less than the two kernels it saves in the chain cost (each is a few
    percent of a step at batch 1). And only where its long steps divide the depths nearly
    evenly (``_MOST_MASKED``): a last step partly masked costs a whole one, so gpt-oss-20b's H
    of 2880 in steps of 2048 would read 1.4 times its gate/up weights' bytes. Qwen3-30B-A3B
    (E 128, K 8): up to 2 tokens; Mixtral (8, 2): one; gpt-oss-20b: never in bf16, at one
    token in MXFP4 (``mxfp4``: its own steps, by token only; gpt-oss-120b up to 4 tokens).
    FP8 weights stay weight-only here (at most ``WEIGHT_ONLY_MAX_TOKENS`` tokens)."""
    num_pairs = num_tokens * top_k
    if num_tokens > WEIGHT_ONLY_MAX_TOKENS or num_pairs > max(top_k, num_experts // 8):
        return False
    config = moe_decode_config(top_k, mxfp4)
    if mxfp4 and not config.by_token:
        return False
    return all(
        triton.cdiv(depth, step) * step <= _MOST_MASKED * depth
        for depth, step in ((hidden, config.gate_up_depth), (intermediate, config.down_depth))
    )


def moe_decode_config(top_k: int, mxfp4: bool = False) -> MoeDecodeConfig:
    """By shape, never timed: ``_STEP_PRODUCTS`` a step, gate/up as 2 columns of each half (4
    weight rows) by 2048 of H, down as 8 channels of each of the K picks (rounded up to a
    power of two) by what is left of I (Qwen3-30B-A3B's K 8: 128, six steps of its 768).
    Fitted to ``bench_kernels.py --moe --moe-sweep`` at one and two tokens, where these
    blocks beat 4 and 4 at Qwen3-30B-A3B and Mixtral (the narrower gate/up programs: more of
    them, each a longer stream of its rows). At 4 picks or more (Qwen3-30B-A3B's 8), a
    gate/up program a token's columns walks its picks with the next step in flight, and so
    does the down kernel's loop, 4 warps a program, registers uncapped: the pair kernel's
    waves of programs that each read one step, after waiting on its expert id, kept the
    bytes in flight low (the sweep's fastest at one token, bf16 and FP8, and no slower at
    two). Mixtral's 2 picks keep the program a pair (unswept). MXFP4 (``mxfp4``, gpt-oss:
    H = I = 2880, 4 picks) by token only, twice the products a step (the same bytes: half a
    byte a value), its steps whole scale blocks: gate/up as 8 columns of each half by 1024
    (three steps of 2880, the last part-masked; 2048 would read 1.4 times the bytes), down as
    8 channels by 512 (six steps). Fitted to ``bench_kernels.py --moe gpt-oss-20b
    gpt-oss-120b --quantization mxfp4 --moe-sweep``: the fastest of its neighbours at one
    token, close to the fastest at two and four (120b). Interpreted (the CPU
    tests), small: several column blocks and steps, last ones masked (MXFP4: a block a
    step)."""
    walks_picks = top_k >= 4
    if _INTERPRETED:
        if mxfp4:
            return MoeDecodeConfig(
                16, 32, 32, 32, 4, by_token=walks_picks, prefetch=walks_picks, max_registers=None
            )
        return MoeDecodeConfig(16, 32, 32, 16, 4)
    picks = triton.next_power_of_2(top_k)
    step_products = 2 * _STEP_PRODUCTS if mxfp4 else _STEP_PRODUCTS
    gate_up_columns = 8 if mxfp4 else 2
    down_rows = 8
    return MoeDecodeConfig(
        gate_up_columns,
        step_products // (2 * gate_up_columns),
        down_rows,
        max(16, step_products // (picks * down_rows)),
        4 if walks_picks else _WARPS,
        by_token=walks_picks,
        prefetch=walks_picks,
        max_registers=None if walks_picks else _MAX_REGISTERS,
    )


@triton.jit
def _gate_up_pair_kernel(
    x_ptr,  # [T, H]
    ids_ptr,  # [T*K] global expert ids
    w_ptr,  # [E, 2I, H]
    scale_ptr,  # [E, 2I] float32 (HAS_SCALE)
    bias_ptr,  # [E, 2I] in x's dtype (HAS_BIAS)
    hidden_ptr,  # [T*K, I] out: the activation, a row a local pair
    expert_offset,
    num_experts,
    depth,  # H
    intermediate,  # I
    top_k,
    alpha,  # CLAMPED_SWIGLU's
    limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_hidden,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program per (BLOCK_N columns of each half, pair)."""
    wait_for_previous_kernel()  # the routing and x come from the kernels just before
    let_next_kernel_start()
    pair = tl.program_id(1)
    expert = tl.load(ids_ptr + pair) - expert_offset
    if (expert < 0) | (expert >= num_experts):
        return
    expert = expert.to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    gate_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wn
    up_rows = gate_rows + intermediate * stride_wn
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_x
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < depth
        x = tl.load(x_row + ks, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        gate += widen(tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0), tl.float32) * x
        up += widen(tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0), tl.float32) * x
    _store_activation(
        tl.sum(gate, axis=1), tl.sum(up, axis=1), expert, cols, col_mask, scale_ptr, bias_ptr,
        hidden_ptr + pair.to(tl.int64) * stride_hidden, intermediate, alpha, limit, stride_se,
        stride_be, HAS_SCALE, HAS_BIAS, CLAMPED_SWIGLU,
    )  # fmt: skip


@triton.jit
def _store_activation(
    gate_sums,
    up_sums,
    expert,
    cols,
    mask,
    scale_ptr,
    bias_ptr,
    hidden_row,
    intermediate,
    alpha,
    limit,
    stride_se,
    stride_be,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
):
    """A pair's gate and up sums over H, columns ``cols``, as its activation in ``hidden_row``
    (where ``mask``): its FP8 scales and biases applied, as the grouped kernel's epilogue."""
    if HAS_SCALE:  # widened to float32 exactly (fp8_widen): the codes' scales alone
        scale_ptrs = scale_ptr + expert * stride_se + cols
        gate_sums *= tl.load(scale_ptrs, mask=mask, other=0.0)
        up_sums *= tl.load(scale_ptrs + intermediate, mask=mask, other=0.0)
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert * stride_be + cols
        gate_sums += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
        up_sums += tl.load(bias_ptrs + intermediate, mask=mask, other=0.0).to(tl.float32)
    activation = gated_activation(gate_sums, up_sums, alpha, limit, CLAMPED_SWIGLU)
    tl.store(hidden_row + cols, activation.to(hidden_row.dtype.element_ty), mask=mask)


@triton.jit
def _pick_rows(
    w_ptr,
    mx_scale_ptr,
    ids_ptr,
    first_pair,
    step,  # of the token's picks' steps, in order
    steps,  # a pick's
    total,  # the token's: a step past them reads nothing
    expert_offset,
    num_experts,
    cols,
    col_mask,
    depth,
    intermediate,
    stride_we,
    stride_wn,
    stride_me,
    stride_mn,
    MXFP4: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The gate and up rows ``cols`` of a step of the token's picks: its pick's expert's
    (nothing of another rank's expert), its slice of H, as stored (MXFP4: bytes, and their
    scales from ``mx_scale_ptr``; otherwise the scales returned are the rows again, unread);
    and that expert, whether local, a value a column (one address, read once: the
    interpreter takes no scalar in a mask)."""
    pick = step // steps
    start = (step - pick * steps) * BLOCK_K
    valid = (tl.zeros_like(cols) + step) < total
    expert = tl.load(ids_ptr + first_pair + pick + tl.zeros_like(cols), mask=valid, other=-1)
    expert -= expert_offset
    local = valid & (expert >= 0) & (expert < num_experts)
    expert = tl.where(local, expert, 0).to(tl.int64)
    if MXFP4:
        gate_rows = w_ptr + expert * stride_we + cols * stride_wn
        gate_scale_rows = mx_scale_ptr + expert * stride_me + cols * stride_mn
        rows_mask = local & col_mask
        gate, gate_scales = load_mxfp4_rows(
            gate_rows[:, None], gate_scale_rows[:, None], rows_mask[:, None], start, depth, BLOCK_K
        )
        up, up_scales = load_mxfp4_rows(
            (gate_rows + intermediate * stride_wn)[:, None],
            (gate_scale_rows + intermediate * stride_mn)[:, None],
            rows_mask[:, None],
            start,
            depth,
            BLOCK_K,
        )
    else:
        ks = start + tl.arange(0, BLOCK_K)
        gate_rows = w_ptr + expert[:, None] * stride_we + cols[:, None] * stride_wn + ks[None, :]
        mask = (local & col_mask)[:, None] & (ks < depth)[None, :]
        gate = tl.load(gate_rows, mask=mask, other=0.0, eviction_policy=READ_ONCE)
        up = tl.load(
            gate_rows + intermediate * stride_wn, mask=mask, other=0.0, eviction_policy=READ_ONCE
        )
        gate_scales, up_scales = gate, up
    return gate, gate_scales, up, up_scales, expert, local


@triton.jit
def _step_columns(start, MXFP4: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations' columns a step multiplies: ``start`` to ``start + BLOCK_K``; MXFP4,
    the even ones, each odd one next to its even one (``nibble_products``)."""
    return start + (2 * tl.arange(0, BLOCK_K // 2) if MXFP4 else tl.arange(0, BLOCK_K))


@triton.jit
def _row_sums(
    weight,
    mx_scales,
    x,
    x_odd,
    MXFP4: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[ROWS] sums over a step of each weight row (as loaded: [ROWS, BLOCK_K] FP8 codes or
    x's dtype; MXFP4 bytes [ROWS, BLOCK_K / 2] and their scales) times the activations ``x``
    (MXFP4: the even columns', ``x_odd`` the odd ones'), in float32. MXFP4's are summed a
    block, then scaled."""
    if MXFP4:
        products = nibble_products(weight, x[None, :], x_odd[None, :])
        blocks = tl.reshape(products, (ROWS, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK // 2))
        sums = tl.sum(tl.sum(blocks, axis=2) * block_scales(mx_scales), axis=1)
    else:
        sums = tl.sum(widen(weight, tl.float32) * x[None, :], axis=1)
    return sums


@triton.jit
def _gate_up_token_kernel(
    x_ptr,  # [T, H]
    ids_ptr,  # [T*K] global expert ids
    w_ptr,  # [E, 2I, H]
    scale_ptr,  # [E, 2I] float32 (HAS_SCALE)
    bias_ptr,  # [E, 2I] in x's dtype (HAS_BIAS)
    hidden_ptr,  # [T*K, I] out: the activation, a row a local pair
    expert_offset,
    num_experts,
    depth,  # H
    intermediate,  # I
    alpha,  # CLAMPED_SWIGLU's
    limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_hidden,
    mx_scale_ptr,  # [E, 2I, H / 32] uint8 e8m0 (MXFP4: w_ptr [E, 2I, H / 2] uint8)
    stride_me,
    stride_mn,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    PREFETCH: tl.constexpr,
    MXFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program per (BLOCK_N columns of each half, token), over the token's picks in turn:
    a grid of as many programs as one pick's (at one token, one wave), each a stream of
    its picks' rows, where a program a pair reads one step and ends (waves of programs, each
    waiting on its expert id, then its weights). A pick's sums go out as its activation
    after its last step; another rank's pick reads nothing and is not written."""
    wait_for_previous_kernel()  # the routing and x come from the kernels just before
    let_next_kernel_start()
    token = tl.program_id(1).to(tl.int64)
    first_pair = token * TOP_K
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    x_row = x_ptr + token * stride_x
    steps = tl.cdiv(depth, BLOCK_K)
    total = TOP_K * steps
    gate_w, gate_s, up_w, up_s, expert, local = _pick_rows(
        w_ptr, mx_scale_ptr, ids_ptr, first_pair, 0, steps, total, expert_offset, num_experts,
        cols, col_mask, depth, intermediate, stride_we, stride_wn, stride_me, stride_mn, MXFP4,
        BLOCK_K,
    )  # fmt: skip
    gate_sums = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up_sums = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(0, total):
        if PREFETCH:  # the next step's rows in flight while this one's are reduced
            next_gate, next_gate_s, next_up, next_up_s, next_expert, next_local = _pick_rows(
                w_ptr, mx_scale_ptr, ids_ptr, first_pair, step + 1, steps, total,
                expert_offset, num_experts, cols, col_mask, depth, intermediate, stride_we,
                stride_wn, stride_me, stride_mn, MXFP4, BLOCK_K,
            )  # fmt: skip
        else:
            next_gate, next_gate_s, next_up, next_up_s = gate_w, gate_s, up_w, up_s
            next_expert, next_local = expert, local
        pick = step // steps
        ks = _step_columns((step - pick * steps) * BLOCK_K, MXFP4, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < depth, other=0.0).to(tl.float32)
        # MXFP4: the odd columns' too (``_step_columns`` gives the even ones)
        x_odd = tl.load(x_row + ks + 1, mask=ks < depth, other=0.0).to(tl.float32) if MXFP4 else x
        gate_sums += _row_sums(gate_w, gate_s, x, x_odd, MXFP4, BLOCK_N, BLOCK_K)
        up_sums += _row_sums(up_w, up_s, x, x_odd, MXFP4, BLOCK_N, BLOCK_K)
        last = (tl.zeros_like(cols) + step - pick * steps) == steps - 1
        _store_activation(
            gate_sums, up_sums, expert, cols, col_mask & last & local, scale_ptr, bias_ptr,
            hidden_ptr + (first_pair + pick) * stride_hidden, intermediate, alpha, limit,
            stride_se, stride_be, HAS_SCALE, HAS_BIAS, CLAMPED_SWIGLU,
        )  # fmt: skip
        gate_sums = tl.where(last, 0.0, gate_sums)
        up_sums = tl.where(last, 0.0, up_sums)
        if PREFETCH:
            gate_w, gate_s, up_w, up_s = next_gate, next_gate_s, next_up, next_up_s
            expert, local = next_expert, next_local
        else:
            gate_w, gate_s, up_w, up_s, expert, local = _pick_rows(
                w_ptr, mx_scale_ptr, ids_ptr, first_pair, step + 1, steps, total,
                expert_offset, num_experts, cols, col_mask, depth, intermediate, stride_we,
                stride_wn, stride_me, stride_mn, MXFP4, BLOCK_K,
            )  # fmt: skip


@triton.jit
def _down_rows(
    weight_rows,
    scale_rows,
    rows_mask,
    start,
    depth,
    MXFP4: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A step of every pick's weight rows, I's columns ``start`` to ``start + BLOCK_K``, as
    stored (``weight_rows`` and ``rows_mask`` [PICKS, BLOCK_N, 1]): [PICKS, BLOCK_N,
    BLOCK_K]; MXFP4, bytes and the scales from ``scale_rows`` (``load_mxfp4_rows``). Without
    MXFP4 the scales returned are the rows again, unread."""
    if MXFP4:
        weight, scales = load_mxfp4_rows(weight_rows, scale_rows, rows_mask, start, depth, BLOCK_K)
    else:
        ks = start + tl.arange(0, BLOCK_K)
        weight = tl.load(
            weight_rows + ks[None, None, :],
            mask=rows_mask & (ks < depth)[None, None, :],
            other=0.0,
            eviction_policy=READ_ONCE,
        )
        scales = weight
    return weight, scales


@triton.jit
def _down_step(
    sums,
    weight,
    mx_scales,
    ks,
    hidden_rows,
    local,
    depth,
    MXFP4: tl.constexpr,
    PICKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Add one step of every pick's weight rows (``_down_rows``', I's columns
    ``_step_columns``) times its activation to the sums [PICKS, BLOCK_N]. Reduced a step at
    a time, within each warp (its threads hold one row's step): no [PICKS, BLOCK_N, BLOCK_K]
    float32 accumulator held across the loop, so more programs fit an SM. MXFP4's are
    summed a block, then scaled."""
    h_mask = local[:, None] & (ks < depth)[None, :]
    h = tl.load(hidden_rows + ks[None, :], mask=h_mask, other=0.0).to(tl.float32)
    if MXFP4:
        h_odd = tl.load(hidden_rows + ks[None, :] + 1, mask=h_mask, other=0.0).to(tl.float32)
        products = nibble_products(weight, h[:, None, :], h_odd[:, None, :])
        blocks = tl.reshape(products, (PICKS, BLOCK_N, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK // 2))
        step_sums = tl.sum(tl.sum(blocks, axis=3) * block_scales(mx_scales), axis=2)
    else:
        step_sums = tl.sum(widen(weight, tl.float32) * h[:, None, :], axis=2)
    return sums + step_sums


@triton.jit
def _down_token_kernel(
    hidden_ptr,  # [T*K, I]
    ids_ptr,  # [T*K] global expert ids
    topk_weights_ptr,  # [T*K] float32
    w_ptr,  # [E, H, I]
    scale_ptr,  # [E, H] float32 (HAS_SCALE)
    bias_ptr,  # [E, H] in the activation's dtype (HAS_BIAS)
    out_ptr,  # [T, H]
    expert_offset,
    num_experts,
    depth,  # I
    channels,  # H
    stride_hidden,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_out,
    mx_scale_ptr,  # [E, H, I / 32] uint8 e8m0 (MXFP4: w_ptr [E, H, I / 2] uint8)
    stride_me,
    stride_mn,
    TOP_K: tl.constexpr,
    PICKS: tl.constexpr,  # TOP_K rounded up to a power of two
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr,
    MXFP4: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program per (BLOCK_N output channels, token): the sum over its picks of routing weight
    x (activation @ those rows of the pick's down projection, + its bias)."""
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < channels
    picks = tl.arange(0, PICKS)
    pairs = token.to(tl.int64) * TOP_K + picks
    # Read before waiting (module docstring): the routing, complete before this kernel
    # starts, and the weights' first step.
    expert = tl.load(ids_ptr + pairs, mask=picks < TOP_K, other=0) - expert_offset
    local = (picks < TOP_K) & (expert >= 0) & (expert < num_experts)
    routing_weight = tl.load(topk_weights_ptr + pairs, mask=local, other=0.0)
    expert = tl.where(local, expert, 0).to(tl.int64)
    weight_rows = w_ptr + expert[:, None, None] * stride_we + cols[None, :, None] * stride_wn
    scale_rows = mx_scale_ptr + expert[:, None, None] * stride_me + cols[None, :, None] * stride_mn
    rows_mask = local[:, None, None] & col_mask[None, :, None]
    ks = _step_columns(0, MXFP4, BLOCK_K)
    weight, mx_scales = _down_rows(weight_rows, scale_rows, rows_mask, 0, depth, MXFP4, BLOCK_K)
    wait_for_previous_kernel()  # the activations are the gate/up kernel's
    let_next_kernel_start()
    hidden_rows = hidden_ptr + pairs[:, None] * stride_hidden
    if PREFETCH:  # the next step's rows in flight while this one's are reduced
        sums = tl.zeros((PICKS, BLOCK_N), dtype=tl.float32)
        for start in range(BLOCK_K, depth, BLOCK_K):
            next_ks = _step_columns(start, MXFP4, BLOCK_K)
            next_weight, next_mx_scales = _down_rows(
                weight_rows, scale_rows, rows_mask, start, depth, MXFP4, BLOCK_K
            )
            sums = _down_step(
                sums, weight, mx_scales, ks, hidden_rows, local, depth, MXFP4, PICKS, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
            weight, mx_scales, ks = next_weight, next_mx_scales, next_ks
        sums = _down_step(
            sums, weight, mx_scales, ks, hidden_rows, local, depth, MXFP4, PICKS, BLOCK_N,
            BLOCK_K,
        )  # fmt: skip
    else:
        # The first step peeled, as the one-row kernel's (its weight read before the wait).
        sums = _down_step(
            tl.zeros((PICKS, BLOCK_N), dtype=tl.float32), weight, mx_scales, ks, hidden_rows,
            local, depth, MXFP4, PICKS, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        for start in range(BLOCK_K, depth, BLOCK_K):
            ks = _step_columns(start, MXFP4, BLOCK_K)
            weight, mx_scales = _down_rows(
                weight_rows, scale_rows, rows_mask, start, depth, MXFP4, BLOCK_K
            )
            sums = _down_step(
                sums, weight, mx_scales, ks, hidden_rows, local, depth, MXFP4, PICKS, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
    pick_mask = local[:, None] & col_mask[None, :]
    if HAS_SCALE:
        scale_ptrs = scale_ptr + expert[:, None] * stride_se + cols[None, :]
        sums *= tl.load(scale_ptrs, mask=pick_mask, other=0.0)
    sums *= routing_weight[:, None]
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert[:, None] * stride_be + cols[None, :]
        sums += routing_weight[:, None] * tl.load(bias_ptrs, mask=pick_mask, other=0.0).to(
            tl.float32
        )
    total = tl.sum(sums, axis=0)  # over the picks, in one order whatever the routing
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def moe_decode_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    expert_offset: int,
    config: MoeDecodeConfig,
    out: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: ClampedSwiGLU | None,
) -> None:
    """``fused_moe`` (or ``mxfp4_moe``) by pair into ``out`` [T, H] (its arguments checked
    there; ``weights`` and ``ids`` flattened to [T*K]): each pair's gate/up and activation,
    then each token's down products summed over its picks. FP8 weights weight-only, whatever
    T. MXFP4 weights (uint8, ``w13_scale`` and ``w2_scale`` their block scales) by token."""
    num_tokens, hidden = x.shape
    num_experts, double_intermediate, _ = w13.shape
    intermediate = double_intermediate // 2
    num_pairs = ids.numel()
    top_k = num_pairs // num_tokens
    quantized = w13.dtype == FP8
    mxfp4 = w13.dtype == torch.uint8
    assert config.by_token or not mxfp4, "MXFP4 weights are read by the by-token kernel"
    hidden_states = x.new_empty(num_pairs, intermediate)
    operands = (
        x,
        ids,
        w13,
        w13_scale if quantized else w13,  # unread without a scale
        w13 if w13_bias is None else w13_bias,  # unread without a bias
        hidden_states,
        expert_offset,
        num_experts,
        hidden,
        intermediate,
    )
    rest = (
        0.0 if activation is None else activation.alpha,
        0.0 if activation is None else activation.limit,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0) if quantized else 0,
        0 if w13_bias is None else w13_bias.stride(0),
        hidden_states.stride(0),
    )
    flags = {
        "HAS_SCALE": quantized,
        "HAS_BIAS": w13_bias is not None,
        "CLAMPED_SWIGLU": activation is not None,
        "BLOCK_N": config.gate_up_columns,
        "BLOCK_K": config.gate_up_depth,
        "num_warps": config.warps,
        "num_stages": 1,
        "maxnreg": config.max_registers,
        **launch_options(x.device),
    }
    column_blocks = triton.cdiv(intermediate, config.gate_up_columns)
    if config.by_token:
        _gate_up_token_kernel[(column_blocks, num_tokens)](
            *operands,
            *rest,
            *_block_scales(w13, w13_scale if mxfp4 else None),
            TOP_K=top_k,
            PREFETCH=config.prefetch,
            MXFP4=mxfp4,
            **flags,
        )
    else:
        _gate_up_pair_kernel[(column_blocks, num_pairs)](*operands, top_k, *rest, **flags)
    _down_token_kernel[(triton.cdiv(hidden, config.down_rows), num_tokens)](
        hidden_states,
        ids,
        weights,
        w2,
        w2_scale if quantized else w2,
        w2 if w2_bias is None else w2_bias,
        out,
        expert_offset,
        num_experts,
        intermediate,
        hidden,
        hidden_states.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0) if quantized else 0,
        0 if w2_bias is None else w2_bias.stride(0),
        out.stride(0),
        *_block_scales(w2, w2_scale if mxfp4 else None),
        TOP_K=top_k,
        PICKS=triton.next_power_of_2(top_k),
        HAS_SCALE=quantized,
        HAS_BIAS=w2_bias is not None,
        PREFETCH=config.prefetch,
        MXFP4=mxfp4,
        BLOCK_N=config.down_rows,
        BLOCK_K=config.down_depth,
        num_warps=config.warps,
        num_stages=1,
        maxnreg=config.max_registers,
        **launch_options(x.device),
    )


def _block_scales(
    weight: torch.Tensor, block_scales: torch.Tensor | None
) -> tuple[torch.Tensor, int, int]:
    """A kernel's MXFP4 scale arguments: the scales and their expert and row strides, or
    (without them) the weight and zeros, unread."""
    if block_scales is None:
        return weight, 0, 0
    return block_scales, block_scales.stride(0), block_scales.stride(1)
