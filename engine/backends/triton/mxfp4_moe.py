"""A mixture-of-experts layer's experts with MXFP4 weights (gpt-oss's, as published, under
``--quantization mxfp4``): ``moe_experts`` of the layer ops when ``w13`` is uint8.

The weights are read as stored, half a byte a value and a scale byte a block of 32
(``engine.backends.mxfp4``; ``LayerOps.moe_experts`` gives the layout), and widened in
registers a step at a time (``mxfp4_widen``), exactly.

At a decode step's few pairs (``mxfp4_moe_config``), ``moe_decode``'s by-token kernels
multiply the widened float32 steps on the CUDA cores. Otherwise the same grouped path as
``fused_moe``'s, its products on the tensor cores with float32 sums, each weight tile
rounded to the activations' dtype first (which holds every MXFP4 value in bfloat16 and
float32; float16 only for scales within its range): its alignment (``align_pairs``: each
local expert's pairs side by side in tiles of BLOCK_M rows), a gate/up kernel whose
epilogue adds the biases and applies the activation (the clamped SwiGLU, gpt-oss's) as the
bf16 kernel's does (``biased_activation``), a down kernel that multiplies the routing
weights into its float32 sums and adds the down bias once (``with_down_bias``), and its
combine (``combine_partial_sums``). Nothing is read back to the host, every buffer being
sized for the worst routing, so a step replays in a CUDA graph for any routing.

The path and the tiles follow a rule over the shape (``mxfp4_moe_config``), fitted at
decode steps' few tokens to ``bench_kernels.py --moe --quantization mxfp4 --moe-sweep``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.mxfp4 import BLOCK
from engine.backends.triton.dependent_launch import launch_options
from engine.backends.triton.fused_moe import (
    MoeConfig,
    MoeGemmConfig,
    align_pairs,
    biased_activation,
    combine_partial_sums,
    flat_routing,
    program_tile,
    split_steps,
    store_rows,
    tile_pairs,
    with_down_bias,
)
from engine.backends.triton.moe_decode import (
    MoeDecodeConfig,
    moe_decode_config,
    moe_decode_experts,
    takes_decode_path,
)
from engine.backends.triton.mxfp4_widen import widened_tile
from engine.backends.triton.paged_attention import dot_precision

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def mxfp4_moe_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int
) -> MoeConfig | MoeDecodeConfig:
    """The decode path by token where it takes MXFP4 (``takes_decode_path``: gpt-oss-20b at
    one token, 120b up to four), as ``fused_moe``'s bf16 layers take theirs; otherwise the
    grouped kernels' tiles (``grouped_mxfp4_config``)."""
    if takes_decode_path(num_tokens, top_k, num_experts, hidden, intermediate, mxfp4=True):
        return moe_decode_config(top_k, mxfp4=True)
    return grouped_mxfp4_config(num_tokens, top_k, num_experts)


def grouped_mxfp4_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The grouped kernels' tiles for ``num_tokens`` tokens' ``top_k`` picks each over
    ``num_experts`` local experts, by the rows an expert gets when routing is even (as
    ``grouped_config`` steps): up to 16 (decode steps, bound by reading and widening the
    weights), 16-row tiles, 128 of depth a step (64 bytes and 4 scales of each weight row),
    gate/up 32 columns of each half and down 64 split in two: twice the programs of 64 and
    64 whole, each with less to widen (fitted to ``bench_kernels.py --moe gpt-oss-20b
    --quantization mxfp4 --moe-sweep`` at two and four tokens: the fastest there or close to
    it); up to 64, 64-row tiles (the fastest at gpt-oss-20b's 512 tokens); beyond (prefills,
    bound by the products and the widening), 128-row tiles, whose widened weight tile serves
    twice the rows, gate/up 64 columns of each half and down 128, 4 warps and 4 stages (the
    fastest at 1,024-4,096 tokens of gpt-oss-20b and 4,096 of 120b, ahead of 128 columns and
    8 warps; docs/benchmarks.md has the figures). BLOCK_K is a whole number of scale
    blocks."""
    if _INTERPRETED:  # small tiles, split: the edge masks and the partial sums' combine
        return MoeConfig(16, MoeGemmConfig(64, 64, 1, 4, 1), MoeGemmConfig(64, 64, 2, 4, 1))
    num_pairs = num_tokens * top_k
    rows_per_expert = -(-num_pairs // max(1, min(num_experts, num_pairs)))
    if rows_per_expert <= 16:
        return MoeConfig(16, MoeGemmConfig(32, 128, 1, 4, 4), MoeGemmConfig(64, 128, 2, 4, 4))
    if rows_per_expert <= 64:
        return MoeConfig(64, MoeGemmConfig(64, 64, 1, 4, 3), MoeGemmConfig(64, 64, 1, 4, 3))
    return MoeConfig(128, MoeGemmConfig(64, 64, 1, 4, 4), MoeGemmConfig(128, 64, 1, 4, 4))


@triton.jit
def _mxfp4_gate_up_kernel(
    x_ptr,  # [T, H]
    stride_x,
    w_ptr,  # [E, 2I, H / 2] uint8: two values a byte
    stride_we,
    stride_wn,
    scale_ptr,  # [E, 2I, H / 32] uint8 e8m0
    stride_se,
    stride_sn,
    bias_ptr,  # [E, 2I] in x's dtype (HAS_BIAS)
    stride_be,
    hidden_ptr,  # [T*K, I] out: the activation, a row a pair
    stride_hidden,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles,
    intermediate,  # I
    depth,  # H
    top_k,
    alpha,  # CLAMPED_SWIGLU's
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program per (BLOCK_N columns of each half, tile of one expert's pairs), as the bf16
    gate/up kernel's, its weight tiles widened from MXFP4."""
    tile, cols, rows = program_tile(num_tiles, intermediate, tile_rows_ptr, BLOCK_N)
    if rows == 0:
        return
    expert, row_mask, pairs = tile_pairs(tile, rows, tile_expert_ptr, sorted_pairs_ptr, BLOCK_M)
    col_mask = cols < intermediate
    gate_rows = w_ptr + expert * stride_we + cols * stride_wn
    gate_scales = scale_ptr + expert * stride_se + cols * stride_sn
    token_rows = x_ptr + (pairs // top_k)[:, None] * stride_x
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(
            token_rows + ks[None, :], mask=row_mask[:, None] & (ks < depth)[None, :], other=0.0
        )
        gate_w = widened_tile(
            gate_rows, gate_scales, col_mask, start, depth, x.dtype, BLOCK_N, BLOCK_K
        )
        up_w = widened_tile(
            gate_rows + intermediate * stride_wn,
            gate_scales + intermediate * stride_sn,
            col_mask,
            start,
            depth,
            x.dtype,
            BLOCK_N,
            BLOCK_K,
        )
        gate = tl.dot(x, gate_w, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, up_w, up, input_precision=DOT_PRECISION)
    activation = biased_activation(
        gate,
        up,
        bias_ptr + expert * stride_be + cols,  # unread without a bias
        col_mask,
        intermediate,
        alpha,
        limit,
        HAS_BIAS,
        CLAMPED_SWIGLU,
    )
    store_rows(hidden_ptr, stride_hidden, pairs, row_mask, cols, col_mask, activation)


@triton.jit
def _mxfp4_down_kernel(
    hidden_ptr,  # [T*K, I]: the activation
    stride_hidden,
    partial_ptr,  # [SPLIT_K, T*K, H] float32 out
    w_ptr,  # [E, H, I / 2] uint8
    stride_we,
    stride_wn,
    scale_ptr,  # [E, H, I / 32] uint8 e8m0
    stride_se,
    stride_sn,
    bias_ptr,  # [E, H] in the activation's dtype (HAS_BIAS)
    stride_be,
    topk_weights_ptr,  # [T*K] float32
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles,
    num_pairs,
    channels,  # H
    depth,  # I
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program per (BLOCK_N output columns, tile of one expert's pairs; split of I), as the
    bf16 down kernel's, its weight tiles widened from MXFP4."""
    tile, cols, rows = program_tile(num_tiles, channels, tile_rows_ptr, BLOCK_N)
    if rows == 0:
        return
    expert, row_mask, pairs = tile_pairs(tile, rows, tile_expert_ptr, sorted_pairs_ptr, BLOCK_M)
    col_mask = cols < channels
    channel_rows = w_ptr + expert * stride_we + cols * stride_wn
    channel_scales = scale_ptr + expert * stride_se + cols * stride_sn
    pair_rows = hidden_ptr + pairs[:, None] * stride_hidden
    split = tl.program_id(1)
    first, last = split_steps(depth, split, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        start = step * BLOCK_K
        ks = start + tl.arange(0, BLOCK_K)
        activation = tl.load(
            pair_rows + ks[None, :], mask=row_mask[:, None] & (ks < depth)[None, :], other=0.0
        )
        w = widened_tile(
            channel_rows, channel_scales, col_mask, start, depth, activation.dtype, BLOCK_N, BLOCK_K
        )
        acc = tl.dot(activation, w, acc, input_precision=DOT_PRECISION)
    routing_weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    weighted = acc * routing_weight[:, None]
    bias_ptrs = bias_ptr + expert * stride_be + cols  # unread without a bias
    weighted = with_down_bias(weighted, routing_weight, bias_ptrs, col_mask, split, HAS_BIAS)
    # This split's rows of the partial sums: [SPLIT_K * T*K, H] in rows.
    partial_rows = split * num_pairs + pairs
    store_rows(partial_ptr, channels, partial_rows, row_mask, cols, col_mask, weighted)


def mxfp4_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    expert_offset: int = 0,
    config: MoeConfig | MoeDecodeConfig | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """``LayerOps.moe_experts`` of MXFP4 experts: x [T, H] (bfloat16, float16 or float32),
    each token's K picks among the local experts ``w13`` uint8 [E, 2I, H / 2] (gate rows,
    then up) with scales ``w13_scale`` uint8 [E, 2I, H / 32], and ``w2`` uint8 [E, H, I / 2]
    with ``w2_scale`` [E, H, I / 32] -> [T, H] in x's dtype; the biases and activation as
    ``fused_moe``'s. ``mxfp4_moe_config``'s tiles unless ``config`` is given."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, double_intermediate, _ = w13.shape
    intermediate = double_intermediate // 2
    assert w13.dtype == w2.dtype == w13_scale.dtype == w2_scale.dtype == torch.uint8
    assert hidden % BLOCK == 0 and intermediate % BLOCK == 0
    assert w13.shape == (num_experts, 2 * intermediate, hidden // 2)
    assert w13_scale.shape == (num_experts, 2 * intermediate, hidden // BLOCK)
    assert w2.shape == (num_experts, hidden, intermediate // 2)
    assert w2_scale.shape == (num_experts, hidden, intermediate // BLOCK)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    for bias, rows in ((w13_bias, 2 * intermediate), (w2_bias, hidden)):
        assert bias is None or (bias.shape == (num_experts, rows) and bias.stride(1) == 1)
    for tensor in (x, w13, w13_scale, w2, w2_scale):
        assert tensor.stride(-1) == 1
    out = x.new_empty(num_tokens, hidden)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    config = config or mxfp4_moe_config(num_tokens, top_k, num_experts, hidden, intermediate)
    weights, ids = flat_routing(topk_weights, topk_ids)
    if isinstance(config, MoeDecodeConfig):
        moe_decode_experts(
            x,
            weights,
            ids,
            w13,
            w2,
            w13_scale,
            w2_scale,
            expert_offset,
            config,
            out,
            w13_bias,
            w2_bias,
            activation,
        )
        return out
    aligned = align_pairs(ids, num_experts, expert_offset, config.block_m)
    precision = dot_precision(x.dtype)
    hidden_states = x.new_empty(num_pairs, intermediate)
    gate_up = config.gate_up
    _mxfp4_gate_up_kernel[(triton.cdiv(intermediate, gate_up.block_n) * aligned.max_tiles,)](
        x,
        x.stride(0),
        w13,
        w13.stride(0),
        w13.stride(1),
        w13_scale,
        w13_scale.stride(0),
        w13_scale.stride(1),
        w13 if w13_bias is None else w13_bias,  # unread without a bias
        0 if w13_bias is None else w13_bias.stride(0),
        hidden_states,
        hidden_states.stride(0),
        aligned.sorted_pairs,
        aligned.tile_expert,
        aligned.tile_rows,
        aligned.max_tiles,
        intermediate,
        hidden,
        top_k,
        0.0 if activation is None else activation.alpha,
        0.0 if activation is None else activation.limit,
        BLOCK_M=config.block_m,
        BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k,
        HAS_BIAS=w13_bias is not None,
        CLAMPED_SWIGLU=activation is not None,
        DOT_PRECISION=precision,
        num_warps=gate_up.warps,
        num_stages=gate_up.stages,
        **launch_options(x.device),
    )
    down = config.down
    partial = x.new_empty(down.split_k, num_pairs, hidden, dtype=torch.float32)
    _mxfp4_down_kernel[(triton.cdiv(hidden, down.block_n) * aligned.max_tiles, down.split_k)](
        hidden_states,
        hidden_states.stride(0),
        partial,
        w2,
        w2.stride(0),
        w2.stride(1),
        w2_scale,
        w2_scale.stride(0),
        w2_scale.stride(1),
        w2 if w2_bias is None else w2_bias,  # unread without a bias
        0 if w2_bias is None else w2_bias.stride(0),
        weights,
        aligned.sorted_pairs,
        aligned.tile_expert,
        aligned.tile_rows,
        aligned.max_tiles,
        num_pairs,
        hidden,
        intermediate,
        BLOCK_M=config.block_m,
        BLOCK_N=down.block_n,
        BLOCK_K=down.block_k,
        SPLIT_K=down.split_k,
        HAS_BIAS=w2_bias is not None,
        DOT_PRECISION=precision,
        num_warps=down.warps,
        num_stages=down.stages,
        **launch_options(x.device),
    )
    combine_partial_sums(partial, ids, out, num_experts, expert_offset)
    return out
