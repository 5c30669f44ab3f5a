"""The mixture-of-experts layer's experts as two, four or five kernels: ``moe_experts`` of
the layer ops.

Each token's top-k picks are (token, k) *pairs*; pair p = token * K + k. A decode step of
a few pairs (one token's, or up to E / 8: ``takes_decode_path``) goes by pair in two
kernels, without alignment or combine (``moe_decode``: gate/up a program per pair and
columns, down a program per token and channels summing its picks). Otherwise the grouped
kernels (four for a step of a few tokens, whose alignment is one):

1. Align (``_count_kernel``, ``_place_kernel``): the pairs of each local expert are placed
   side by side in ``sorted_pairs``, each expert's run padded to a multiple of BLOCK_M, so
   that every BLOCK_M-row tile of it belongs to one expert; per tile, its expert and its
   count of real rows. The pairs are cut into chunks: the first kernel counts each chunk's
   pairs per expert, the second places each chunk's pairs after the earlier chunks' and
   fills in the tiles. A step of a few tokens is one chunk, and then the second kernel
   counts for itself (one launch, not two). Pairs whose expert is not local (expert
   parallelism: ids outside [expert_offset, expert_offset + E_local)) are placed nowhere.
2. Gate/up (``_gate_up_kernel``): a grouped GEMM, a program per (tile of an expert's rows,
   BLOCK_N columns of the intermediate), gathering its rows of x, with both halves' columns
   (gate and up) in two accumulators, so that the epilogue writes silu(gate) * up, rounded
   to x's dtype as the dense MLP's activation is, to ``hidden[pair]`` [T*K, I]. Programs
   go in groups of 8 tiles, column block by column block (``_tile_and_columns``), so that
   an expert's weights are read about once however many tiles its rows fill (a prefill).
3. Down (``_down_kernel``): the same over ``hidden`` and the down projection, the routing
   weight multiplied into the float32 accumulator, written to ``partial[split, pair]``
   [SPLIT_K, T*K, H] float32. At a few tokens the depth I is split too (``split_k``), to
   give every SM work: each split writes its own partial sums.
4. Combine (``_combine_kernel``): a program per (token, columns) sums its K pairs' partial
   sums over the splits in a fixed order and rounds once to x's dtype; a pair of a non-local
   expert (never written) adds nothing. No atomics: the sums are the same run to run.

Nothing is read back to the host: every buffer's size and every grid follow from T, K,
E_local and the weights' shapes, bounded for any routing (padding adds at most BLOCK_M - 1
rows to each expert that has pairs, and at most min(E_local, T*K) experts have them); tiles
past the routing's last are launched and return at once. So a decode step's layers are
captured in a CUDA graph and replayed for any routing.

Every kernel here is launched dependent (``dependent_launch``: waiting for the kernel
before as it starts, letting the next one start): the next kernel's programs are scheduled
while this one's last finish, which at a few tokens is a good part of each kernel's time.

FP8 weights (float8 e4m3 codes with a float32 scale per output channel), as the dense FP8
layers multiply theirs (``engine.quantization.linear_methods``): up to
``WEIGHT_ONLY_MAX_TOKENS`` tokens they are read a byte an element and widened in the kernel
(``fp8_widen``), the activations staying in the model's dtype, since a few tokens' experts
are bound by reading the weights. Past it (W8A8), the widening would bound the products
(prefills of FP8 experts ran slower than bf16's): x is quantized per token to e4m3
(``quantize_rows_fp8``), the gate/up kernel multiplies FP8 by FP8 on the tensor cores and
scales its float32 sums by the token's and the channel's scales, writes the activation in
x's dtype as before, which is quantized per pair the same way (one small kernel) for the
down kernel's FP8 products. Rounded as the dense FP8 MLP rounds: activation to x's dtype,
then to e4m3. Each step's FP8 product starts from zero and is added to the float32 sums
apart: Hopper's FP8 tensor-core instructions add within a product with fewer bits than
float32, so a sum carried through them across the whole depth (H, or I) drifts by many
units of bf16's rounding; summed a step (128 of depth) at a time, as FP8 GEMMs promote
theirs, it does not.

The path, tiles and splits are chosen by a rule over the shape (``moe_config``), not timed:
a few pairs go by pair; other decode steps take 16-row tiles and narrow columns, or split I,
to fill the SMs; prefills, large tiles (the same regimes as vLLM's and SGLang's tuned tables
for these shapes).

MXFP4 experts (uint8 weights) go to ``mxfp4_moe`` instead, which shares this module's
alignment and combine (``align_pairs``, ``combine_partial_sums``) and its kernels' common
pieces (``program_tile``, ``tile_pairs``, ``split_steps``, ``biased_activation``,
``with_down_bias``, ``store_rows``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
from engine.backends.triton.device import sm_count
from engine.backends.triton.fp8_quantize import quantize_rows_fp8
from engine.backends.triton.fp8_widen import widen, widen_factor
from engine.backends.triton.moe_decode import (
    MoeDecodeConfig,
    moe_decode_config,
    moe_decode_experts,
    takes_decode_path,
)
from engine.backends.triton.paged_attention import dot_precision

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# One align program holds a [chunk, experts] one-hot of its pairs: this many elements; and
# labels this many tiles at a time. Interpreted (the tests), small: several chunks and
# programs labelling tiles at the tests' few pairs.
_ALIGN_ELEMENTS = 256 if _INTERPRETED else 8192
_ALIGN_TILES = 4 if _INTERPRETED else 64
_COMBINE_BLOCK = 512
# Tiles whose programs run side by side, column block by column block (``_tile_and_columns``).
_GROUP_TILES = tl.constexpr(8)
_MAX_SPLIT_K = 8
# A few tokens' grouped programs: spread at least this evenly over the SMs (``_even_share``),
# or narrower (more of them) where that spreads them more evenly.
_EVEN_SHARE = 0.85


@dataclass(frozen=True)
class MoeGemmConfig:
    """One grouped GEMM's launch: BLOCK_N output columns a program (gate/up: of each half),
    BLOCK_K of depth a step, the depth split in ``split_k`` (down only), warps, stages."""

    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


@dataclass(frozen=True)
class MoeConfig:
    """The tile height both GEMMs share (the alignment pads each expert's pairs to it) and
    each GEMM's launch."""

    block_m: int
    gate_up: MoeGemmConfig
    down: MoeGemmConfig


def moe_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    processors: int,
    weight_dtype: torch.dtype,
    dtype: torch.dtype,
) -> MoeConfig | MoeDecodeConfig:
    """The path and its configuration for ``num_tokens`` tokens' ``top_k`` picks each over
    ``num_experts`` local experts of [2 * intermediate, hidden] and [hidden, intermediate]
    in ``weight_dtype``, activations in ``dtype`` (FP8: W8A8), on a GPU of ``processors``
    SMs: by pair at a decode step's few pairs (``moe_decode``), the grouped GEMMs otherwise;
    chosen by shape, never timed (timed choices would differ between processes, and so would
    their sums)."""
    if takes_decode_path(num_tokens, top_k, num_experts, hidden, intermediate):
        return moe_decode_config(top_k)
    return grouped_config(
        num_tokens, top_k, num_experts, hidden, intermediate, processors, weight_dtype, dtype
    )


def grouped_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    processors: int,
    weight_dtype: torch.dtype,
    dtype: torch.dtype,
) -> MoeConfig:
    """The grouped GEMMs' configuration (``moe_config``'s arguments):

    - The tile height follows the rows an expert gets when routing is even,
      ``num_pairs / min(E, num_pairs)``: 16 up to 8 rows, 32 up to 16, 64 up to 32, 128
      beyond (vLLM's and SGLang's tuned tables for these shapes step alike).
    - 16 or 32 rows (decode steps, bound by reading the weights): 256 bytes of each weight
      row a step (128 of depth in bf16, 256 of fp8 codes). Gate/up: 64 columns a program, or
      32 or 16 where wider programs spread unevenly over the SMs; down: 64 channels, the
      depth split in two, four or eight for the same reason (each split keeping at least
      512 of I). Unevenly: where some SMs run one program more than others
      (``_even_share``), the step waits for those (gpt-oss-20b at one token: its 4 pairs'
      180 programs of 64 columns run two on 48 SMs, one on 84).
    - 64 or 128 rows (prefills, bound by the products): 64 of depth a step (32 with a float32
      operand, for the stages to fit in shared memory), gate/up 64 or 128 columns of each
      half, down 128.
    """
    if _INTERPRETED:  # small tiles, split: every mask and the partial sums' combine
        return MoeConfig(16, MoeGemmConfig(16, 32, 1, 4, 1), MoeGemmConfig(16, 32, 2, 4, 1))
    num_pairs = num_tokens * top_k
    active = max(1, min(num_experts, num_pairs))
    rows_per_expert = -(-num_pairs // active)
    if rows_per_expert <= 16:
        block_m = 16 if rows_per_expert <= 8 else 32
        tiles = active * -(-rows_per_expert // block_m)
        block_k = 256 // weight_dtype.itemsize
        gate_n = _most_even(
            (64, 32, 16), lambda n: _even_share(tiles * triton.cdiv(intermediate, n), processors)
        )
        splits = [split for split in (1, 2, 4, _MAX_SPLIT_K) if intermediate >= split * 512]
        split_k = _most_even(
            splits or [1],
            lambda split: _even_share(tiles * triton.cdiv(hidden, 64) * split, processors),
        )
        return MoeConfig(
            block_m,
            MoeGemmConfig(gate_n, block_k, 1, 4, 4),
            MoeGemmConfig(64, block_k, split_k, 4, 4),
        )
    # 128 bytes of depth a step: 32 with a float32 operand (for the stages to fit in shared
    # memory), 64 in 16 bits, 128 with both operands FP8 (W8A8).
    block_k = 128 // max(weight_dtype.itemsize, dtype.itemsize)
    if rows_per_expert <= 32:
        return MoeConfig(
            64, MoeGemmConfig(64, block_k, 1, 4, 4), MoeGemmConfig(128, block_k, 1, 4, 4)
        )
    return MoeConfig(
        128, MoeGemmConfig(128, block_k, 1, 8, 3), MoeGemmConfig(128, block_k, 1, 8, 3)
    )


def _even_share(programs: int, processors: int) -> float:
    """How evenly ``programs`` alike spread over ``processors`` SMs: the programs an SM runs on
    average over the most any runs (1: every SM runs as many; a weight-bound kernel lasts as
    long as its busiest SMs)."""
    return programs / (processors * -(-programs // processors))


def _most_even(choices: tuple[int, ...] | list[int], share: Callable[[int], float]) -> int:
    """The first of ``choices`` (the preferred first: wider programs, fewer splits) whose
    programs spread evenly enough (``_EVEN_SHARE``), else the most evenly spread."""
    return next(
        (choice for choice in choices if share(choice) >= _EVEN_SHARE),
        max(choices, key=share),
    )


@triton.jit
def _launched_dependent():
    """First thing in every kernel here: they are launched dependent (``dependent_launch``),
    the next scheduled while this one's programs finish, so each waits for the kernel before
    before it reads anything (the routing is computed just before, by the router's kernels)."""
    wait_for_previous_kernel()
    let_next_kernel_start()


@triton.jit
def _tile_and_columns(num_tiles, num_columns, BLOCK_N: tl.constexpr):
    """This program's tile and its BLOCK_N columns (of ``num_columns``), from its index in the
    grid's first dimension: in groups of _GROUP_TILES consecutive tiles, a group's programs
    go column block by column block, its tiles side by side. An expert's rows over several
    tiles (a prefill's) then read each block of its weights from memory about once, the other
    tiles finding it in L2, rather than once a tile (its whole weights again, tile after
    tile, when the columns went fastest)."""
    pid = tl.program_id(0)
    per_group = _GROUP_TILES * tl.cdiv(num_columns, BLOCK_N)
    first_tile = pid // per_group * _GROUP_TILES
    group_tiles = tl.minimum(num_tiles - first_tile, _GROUP_TILES)
    within = pid % per_group
    return first_tile + within % group_tiles, within // group_tiles * BLOCK_N + tl.arange(
        0, BLOCK_N
    )


@triton.jit
def program_tile(num_tiles, num_columns, tile_rows_ptr, BLOCK_N: tl.constexpr):
    """First thing in a grouped GEMM's program: after the kernel before (``_launched_dependent``),
    its tile and columns (``_tile_and_columns``) and the tile's real rows (0: past the
    routing's last tile, and the program returns)."""
    _launched_dependent()
    tile, cols = _tile_and_columns(num_tiles, num_columns, BLOCK_N)
    return tile, cols, tl.load(tile_rows_ptr + tile)


@triton.jit
def tile_pairs(tile, rows, tile_expert_ptr, sorted_pairs_ptr, BLOCK_M: tl.constexpr):
    """A tile's local expert (int64, for its weights' offsets), its real rows' mask and the
    pairs in them."""
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row_mask = tl.arange(0, BLOCK_M) < rows
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M), mask=row_mask)
    return expert, row_mask, pairs


@triton.jit
def split_steps(depth, split, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The steps of ``depth`` (BLOCK_K each) that split ``split`` of SPLIT_K sums: an even
    share, in whole steps (first, past the last)."""
    steps = tl.cdiv(depth, BLOCK_K)
    steps_per_split = tl.cdiv(steps, SPLIT_K)
    first = split * steps_per_split
    return first, tl.minimum(first + steps_per_split, steps)


@triton.jit
def biased_activation(
    gate,
    up,
    bias_ptrs,
    col_mask,
    intermediate,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
):
    """The gate/up kernels' epilogue: float32 gate and up [BLOCK_M, BLOCK_N], their biases
    added if HAS_BIAS (gpt-oss's: the gate's at ``bias_ptrs``, the up's ``intermediate``
    further), through the activation."""
    if HAS_BIAS:
        gate += tl.load(bias_ptrs, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptrs + intermediate, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return gated_activation(gate, up, alpha, limit, CLAMPED_SWIGLU)


@triton.jit
def with_down_bias(acc, routing_weight, bias_ptrs, col_mask, split, HAS_BIAS: tl.constexpr):
    """A down kernel's sums ``acc`` (times the routing weights) with, if HAS_BIAS (gpt-oss's),
    the bias times the routing weight added by the first split only."""
    if HAS_BIAS:
        bias = tl.load(bias_ptrs, mask=col_mask, other=0.0)
        acc += routing_weight[:, None] * tl.where(split == 0, bias.to(tl.float32), 0.0)[None, :]
    return acc


@triton.jit
def store_rows(out_ptr, stride_out, rows, row_mask, cols, col_mask, values):
    """``values`` [len(rows), len(cols)] in the output's dtype at rows ``rows`` (a tile's
    pairs) and columns ``cols`` of ``out_ptr``'s matrix, where both masks hold."""
    tl.store(
        out_ptr + rows[:, None] * stride_out + cols[None, :],
        values.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _local_experts(ids_ptr, pairs, num_pairs, expert_offset, num_experts, EXPERTS: tl.constexpr):
    """[len(pairs), EXPERTS] int32: 1 where the pair picked that local expert."""
    expert = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) - expert_offset
    local = (pairs < num_pairs) & (expert >= 0) & (expert < num_experts)
    one_hot = (expert[:, None] == tl.arange(0, EXPERTS)[None, :]) & local[:, None]
    return one_hot.to(tl.int32)


@triton.jit
def _count_kernel(
    ids_ptr,
    counts_ptr,  # [chunks, EXPERTS] int32: each chunk's pairs per local expert
    num_pairs,
    expert_offset,
    num_experts,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    _launched_dependent()
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    one_hot = _local_experts(ids_ptr, pairs, num_pairs, expert_offset, num_experts, EXPERTS)
    tl.store(counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), tl.sum(one_hot, axis=0))


@triton.jit
def _place_kernel(
    ids_ptr,
    counts_ptr,  # _count_kernel's (unread with ONE_CHUNK)
    sorted_pairs_ptr,  # [max_tiles * BLOCK_M] int32: pairs, expert by expert, padded
    tile_expert_ptr,  # [max_tiles] int32: each tile's local expert
    tile_rows_ptr,  # [max_tiles] int32: each tile's real rows (0: past the last tile)
    num_pairs,
    expert_offset,
    num_experts,
    num_chunks,
    max_tiles,
    CHUNK: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILES: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    """Program per chunk of pairs: places them, and labels every num_chunks-th group of
    TILES tiles, its own first."""
    _launched_dependent()
    chunk = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    one_hot = _local_experts(ids_ptr, pairs, num_pairs, expert_offset, num_experts, EXPERTS)
    if ONE_CHUNK:
        total = tl.sum(one_hot, axis=0)
        earlier = tl.zeros((EXPERTS,), dtype=tl.int32)
    else:  # every chunk's counts, and the earlier chunks' apart
        total = tl.zeros((EXPERTS,), dtype=tl.int32)
        earlier = tl.zeros((EXPERTS,), dtype=tl.int32)
        for first in range(0, num_chunks, 16):
            chunks = first + tl.arange(0, 16)
            counts = tl.load(
                counts_ptr + chunks[:, None] * EXPERTS + experts[None, :],
                mask=(chunks < num_chunks)[:, None],
                other=0,
            )
            total += tl.sum(counts, axis=0)
            earlier += tl.sum(tl.where((chunks < chunk)[:, None], counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # A pair's slot: its expert's start, the earlier chunks' pairs of that expert, and the
    # pairs of that expert before it in this chunk.
    before_in_chunk = tl.sum((tl.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)
    base = tl.sum(one_hot * (starts + earlier)[None, :], axis=1)
    placed = tl.sum(one_hot, axis=1) > 0
    tl.store(sorted_pairs_ptr + base + before_in_chunk, pairs, mask=placed)
    # A tile's expert: the experts whose padded run ends at or before its first slot come
    # before it (EXPERTS: past the last run, no rows).
    for first in range(chunk * TILES, max_tiles, num_chunks * TILES):
        tiles = first + tl.arange(0, TILES)
        first_slot = tiles * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_slot[:, None]).to(tl.int32), axis=1)
        mine = expert[:, None] == experts[None, :]
        real_end = tl.sum(tl.where(mine, (starts + total)[None, :], 0), axis=1)
        rows = tl.minimum(tl.maximum(real_end - first_slot, 0), BLOCK_M)
        tl.store(tile_expert_ptr + tiles, expert, mask=tiles < max_tiles)
        tl.store(tile_rows_ptr + tiles, rows, mask=tiles < max_tiles)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]: x, or its float8 codes (W8A8)
    x_scale_ptr,  # [T] float32: the codes' scales (W8A8)
    w_ptr,  # [E, 2I, H]
    scale_ptr,  # [E, 2I] float32 (HAS_SCALE)
    hidden_ptr,  # [T*K, I] out: silu(gate) * up, a row a pair
    bias_ptr,  # [E, 2I] in x's dtype (HAS_BIAS)
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles,
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
    W8A8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program per (BLOCK_N columns of each half, tile of one expert's pairs). The epilogue:
    silu(gate) * up, or (gpt-oss) the biases added and the clamped SwiGLU."""
    tile, cols, rows = program_tile(num_tiles, intermediate, tile_rows_ptr, BLOCK_N)
    if rows == 0:
        return
    expert, row_mask, pairs = tile_pairs(tile, rows, tile_expert_ptr, sorted_pairs_ptr, BLOCK_M)
    tokens = pairs // top_k
    col_mask = cols < intermediate
    # [BLOCK_K, BLOCK_N] tiles of the gate's and the up's rows, contiguous in H.
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    up_ptrs = gate_ptrs + intermediate * stride_wn
    x_ptrs = x_ptr + tokens[:, None] * stride_x
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < depth
        x = tl.load(x_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate_w = tl.load(gate_ptrs + ks[:, None], mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs + ks[:, None], mask=w_mask, other=0.0)
        if W8A8:  # each step's FP8 products summed apart, then added in float32: see below
            gate += tl.dot(x, gate_w)
            up += tl.dot(x, up_w)
        else:
            gate = tl.dot(x, widen(gate_w, x.dtype), gate, input_precision=DOT_PRECISION)
            up = tl.dot(x, widen(up_w, x.dtype), up, input_precision=DOT_PRECISION)
    if HAS_SCALE:  # the codes' scales, times what widening them left them divided by
        factor = widen_factor(w_ptr.dtype.element_ty, x_ptr.dtype.element_ty)
        scale_ptrs = scale_ptr + expert * stride_se + cols
        gate *= tl.load(scale_ptrs, mask=col_mask, other=0.0)[None, :] * factor
        up *= tl.load(scale_ptrs + intermediate, mask=col_mask, other=0.0)[None, :] * factor
    if W8A8:  # each token's scale
        x_scale = tl.load(x_scale_ptr + tokens, mask=row_mask, other=0.0)[:, None]
        gate *= x_scale
        up *= x_scale
    bias_ptrs = bias_ptr + expert * stride_be + cols  # unread without a bias
    activation = biased_activation(
        gate, up, bias_ptrs, col_mask, intermediate, alpha, limit, HAS_BIAS, CLAMPED_SWIGLU
    )
    store_rows(hidden_ptr, stride_hidden, pairs, row_mask, cols, col_mask, activation)


@triton.jit
def _down_kernel(
    hidden_ptr,  # [T*K, I]: the activation, or its float8 codes (W8A8)
    hidden_scale_ptr,  # [T*K] float32: the codes' scales (W8A8)
    w_ptr,  # [E, H, I]
    scale_ptr,  # [E, H] float32 (HAS_SCALE)
    topk_weights_ptr,  # [T*K] float32
    bias_ptr,  # [E, H] in the activation's dtype (HAS_BIAS)
    partial_ptr,  # [SPLIT_K, T*K, H] float32 out
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles,
    num_pairs,
    depth,  # I
    channels,  # H
    stride_hidden,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    HAS_SCALE: tl.constexpr,
    W8A8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program per (BLOCK_N output columns, tile of one expert's pairs; split of I). A bias
    (gpt-oss's) is added by the first split, times the routing weight as the product is."""
    tile, cols, rows = program_tile(num_tiles, channels, tile_rows_ptr, BLOCK_N)
    if rows == 0:
        return
    expert, row_mask, pairs = tile_pairs(tile, rows, tile_expert_ptr, sorted_pairs_ptr, BLOCK_M)
    split = tl.program_id(1)
    col_mask = cols < channels
    first, last = split_steps(depth, split, BLOCK_K, SPLIT_K)
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn
    hidden_ptrs = hidden_ptr + pairs[:, None] * stride_hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < depth
        h = tl.load(hidden_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if W8A8:  # as the gate/up kernel's
            acc += tl.dot(h, w)
        else:
            acc = tl.dot(h, widen(w, h.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_SCALE:
        factor = widen_factor(w_ptr.dtype.element_ty, hidden_ptr.dtype.element_ty)
        acc *= (
            tl.load(scale_ptr + expert * stride_se + cols, mask=col_mask, other=0.0)[None, :]
            * factor
        )
    routing_weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
    row_scale = routing_weight
    if W8A8:
        row_scale *= tl.load(hidden_scale_ptr + pairs, mask=row_mask, other=0.0)
    bias_ptrs = bias_ptr + expert * stride_be + cols  # unread without a bias
    acc = with_down_bias(
        acc * row_scale[:, None], routing_weight, bias_ptrs, col_mask, split, HAS_BIAS
    )
    split_ptr = partial_ptr + split * num_pairs * channels
    store_rows(split_ptr, channels, pairs, row_mask, cols, col_mask, acc)


@triton.jit
def _combine_kernel(
    partial_ptr,  # [SPLIT_K, T*K, H] float32
    ids_ptr,  # [T*K]
    out_ptr,  # [T, H]
    num_pairs,
    channels,
    expert_offset,
    num_experts,
    stride_out,
    TOP_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per (token, BLOCK columns): the sum over its pairs and the splits."""
    _launched_dependent()
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < channels
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair) - expert_offset
        # A non-local expert's pair was never written: no columns of it are read.
        local_channels = tl.where((expert >= 0) & (expert < num_experts), channels, 0)
        for split in tl.static_range(SPLIT_K):
            total += tl.load(
                partial_ptr + (split * num_pairs + pair) * channels + cols,
                mask=cols < local_channels,
                other=0.0,
            )
    tl.store(out_ptr + token * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def quantizes_activations(num_tokens: int, weight_dtype: torch.dtype) -> bool:
    """Whether ``fused_moe`` multiplies FP8 weights with FP8 activations (W8A8), as the dense
    FP8 layers do past ``WEIGHT_ONLY_MAX_TOKENS`` tokens, rather than widening the weights."""
    return weight_dtype == FP8 and num_tokens > WEIGHT_ONLY_MAX_TOKENS


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    expert_offset: int = 0,
    config: MoeConfig | MoeDecodeConfig | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """``LayerOps.moe_experts``: x [T, H] (bfloat16, float16 or float32), each token's K
    picks (``topk_ids`` [T, K] global expert ids, ``topk_weights`` [T, K] float32) among
    the local experts ``w13`` [E, 2I, H] (gate rows, then up) and ``w2`` [E, H, I], in x's
    dtype or float8 e4m3 codes with float32 scales per output channel (``w13_scale`` [E, 2I],
    ``w2_scale`` [E, H]) -> [T, H] in x's dtype: sum over k of w_k * (silu(x @ gate_e^T) *
    (x @ up_e^T)) @ down_e^T, e the pick, each product summed in float32; picks outside
    [expert_offset, expert_offset + E) add nothing. ``moe_config``'s configuration unless
    given (the benchmark's candidates). gpt-oss's experts: ``w13_bias`` [E, 2I] and
    ``w2_bias`` [E, H] in x's dtype, and the clamped SwiGLU (``activation``) in the gate/up
    kernel's epilogue instead of silu(gate) * up (``LayerOps.moe_experts``)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, double_intermediate, _ = w13.shape
    intermediate = double_intermediate // 2
    assert w13.shape == (num_experts, 2 * intermediate, hidden)
    assert w2.shape == (num_experts, hidden, intermediate)
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    quantized = w13.dtype == FP8
    assert (w13_scale is not None) == quantized == (w2_scale is not None)
    if not quantized:
        assert w13.dtype == w2.dtype == x.dtype
    for bias, rows in ((w13_bias, 2 * intermediate), (w2_bias, hidden)):
        assert bias is None or (bias.shape == (num_experts, rows) and bias.stride(1) == 1)
    out = x.new_empty(num_tokens, hidden)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    w8a8 = quantizes_activations(num_tokens, w13.dtype)
    config = config or moe_config(
        num_tokens,
        top_k,
        num_experts,
        hidden,
        intermediate,
        sm_count(x.device),
        w13.dtype,
        FP8 if w8a8 else x.dtype,
    )
    weights, ids = flat_routing(topk_weights, topk_ids)
    if isinstance(config, MoeDecodeConfig):
        assert not w8a8, "the decode path reads FP8 weights weight-only"
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
    # 1. Align.
    aligned = align_pairs(ids, num_experts, expert_offset, config.block_m)
    max_tiles = aligned.max_tiles

    precision = dot_precision(x.dtype)
    # 2. Gate/up and the activation. W8A8: x quantized per token first, the product's rows
    # scaled by their tokens' scales.
    a, a_scale = quantize_rows_fp8(x) if w8a8 else (x, x)
    hidden_states = x.new_empty(num_pairs, intermediate)
    gate_up = config.gate_up
    _gate_up_kernel[(triton.cdiv(intermediate, gate_up.block_n) * max_tiles,)](
        a,
        a_scale,
        w13,
        w13_scale if quantized else w13,
        hidden_states,
        w13 if w13_bias is None else w13_bias,  # unread without a bias
        aligned.sorted_pairs,
        aligned.tile_expert,
        aligned.tile_rows,
        max_tiles,
        hidden,
        intermediate,
        top_k,
        0.0 if activation is None else activation.alpha,
        0.0 if activation is None else activation.limit,
        a.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0) if quantized else 0,
        0 if w13_bias is None else w13_bias.stride(0),
        hidden_states.stride(0),
        HAS_SCALE=quantized,
        W8A8=w8a8,
        HAS_BIAS=w13_bias is not None,
        CLAMPED_SWIGLU=activation is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k,
        DOT_PRECISION=precision,
        num_warps=gate_up.warps,
        num_stages=gate_up.stages,
        **launch_options(x.device),
    )

    # 3. Down, times the routing weights, each split's sums apart. W8A8: the activation
    # (rounded to x's dtype, as the dense MLP's is before its quantization) quantized per
    # pair first; rows of pairs not placed here are quantized too, and never read.
    if w8a8:
        hidden_states, hidden_scale = quantize_rows_fp8(hidden_states)
    else:
        hidden_scale = hidden_states
    down = config.down
    partial = x.new_empty(down.split_k, num_pairs, hidden, dtype=torch.float32)
    _down_kernel[(triton.cdiv(hidden, down.block_n) * max_tiles, down.split_k)](
        hidden_states,
        hidden_scale,
        w2,
        w2_scale if quantized else w2,
        weights,
        w2 if w2_bias is None else w2_bias,  # unread without a bias
        partial,
        aligned.sorted_pairs,
        aligned.tile_expert,
        aligned.tile_rows,
        max_tiles,
        num_pairs,
        intermediate,
        hidden,
        hidden_states.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0) if quantized else 0,
        0 if w2_bias is None else w2_bias.stride(0),
        HAS_SCALE=quantized,
        W8A8=w8a8,
        HAS_BIAS=w2_bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=down.block_n,
        BLOCK_K=down.block_k,
        SPLIT_K=down.split_k,
        DOT_PRECISION=precision,
        num_warps=down.warps,
        num_stages=down.stages,
        **launch_options(x.device),
    )

    # 4. Combine.
    combine_partial_sums(partial, ids, out, num_experts, expert_offset)
    return out


@dataclass(frozen=True)
class AlignedPairs:
    """``align_pairs``' output: the pairs of each local expert side by side in
    ``sorted_pairs`` [max_tiles * BLOCK_M] int32, each expert's run padded to whole tiles;
    each tile's local expert ``tile_expert`` [max_tiles] and its real rows ``tile_rows``
    [max_tiles] (0: past the routing's last tile)."""

    sorted_pairs: torch.Tensor
    tile_expert: torch.Tensor
    tile_rows: torch.Tensor
    max_tiles: int


def flat_routing(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing [T, K] as the kernels read it, [T*K] a pair: views of contiguous tensors,
    so no copy under a graph; float32 weights."""
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(num_pairs)
    weights = topk_weights.reshape(num_pairs)
    assert ids.stride(0) == 1 and weights.stride(0) == 1 and weights.dtype == torch.float32
    return weights, ids


def align_pairs(
    ids: torch.Tensor, num_experts: int, expert_offset: int, block_m: int
) -> AlignedPairs:
    """Step 1 of the grouped path (the module's docstring): the pairs of global expert ids
    ``ids`` [T*K] int32 among ``num_experts`` local experts from ``expert_offset``, in
    BLOCK_M-row tiles of one expert each. Sized for any routing: at most min(E, T*K)
    experts have pairs, and each pads to whole tiles."""
    num_pairs = ids.shape[0]
    max_tiles = num_pairs // block_m + min(num_experts, num_pairs)
    sorted_pairs = ids.new_empty(max_tiles * block_m, dtype=torch.int32)
    tile_expert = ids.new_empty(max_tiles, dtype=torch.int32)
    tile_rows = ids.new_empty(max_tiles, dtype=torch.int32)
    experts_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(triton.next_power_of_2(num_pairs), _ALIGN_ELEMENTS // experts_pow2))
    num_chunks = triton.cdiv(num_pairs, chunk)
    counts = ids.new_empty(num_chunks * experts_pow2, dtype=torch.int32)
    if num_chunks > 1:
        _count_kernel[(num_chunks,)](
            ids,
            counts,
            num_pairs,
            expert_offset,
            num_experts,
            CHUNK=chunk,
            EXPERTS=experts_pow2,
            **launch_options(ids.device),
        )
    _place_kernel[(num_chunks,)](
        ids,
        counts,
        sorted_pairs,
        tile_expert,
        tile_rows,
        num_pairs,
        expert_offset,
        num_experts,
        num_chunks,
        max_tiles,
        CHUNK=chunk,
        EXPERTS=experts_pow2,
        BLOCK_M=block_m,
        TILES=_ALIGN_TILES,
        ONE_CHUNK=num_chunks == 1,
        **launch_options(ids.device),
    )
    return AlignedPairs(sorted_pairs, tile_expert, tile_rows, max_tiles)


def combine_partial_sums(
    partial: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    num_experts: int,
    expert_offset: int,
) -> None:
    """Step 4 of the grouped path: each token's row of ``out`` [T, H], the sum of its pairs'
    float32 ``partial`` [SPLIT_K, T*K, H] sums over the splits, in a fixed order; a pair of
    an expert not among the ``num_experts`` local ones from ``expert_offset`` (global ids
    ``ids`` [T*K]) adds nothing."""
    split_k, num_pairs, hidden = partial.shape
    num_tokens = out.shape[0]
    _combine_kernel[(num_tokens, triton.cdiv(hidden, _COMBINE_BLOCK))](
        partial,
        ids,
        out,
        num_pairs,
        hidden,
        expert_offset,
        num_experts,
        out.stride(0),
        TOP_K=num_pairs // num_tokens,
        SPLIT_K=split_k,
        BLOCK=_COMBINE_BLOCK,
        **launch_options(out.device),
    )
