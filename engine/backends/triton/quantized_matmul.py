"""Weight-only GEMM over 8-bit weights: ``x @ (codes * scale[:, None]).T``.

The weight stays one byte an element in memory (int8 or float8 e4m3 codes, [N, K]) and is
widened to the activation's dtype tile by tile inside the kernel, exactly (every int8 and
e4m3 value is a bfloat16; e4m3 by placing bits, ``fp8_widen``); the per-output-channel
scales multiply the float32 accumulator once at the end. At small batch a GEMM is bound by
reading the weight, so this halves the bytes of a bf16 GEMM.

At a few rows, one program per block of output channels is too few programs to keep the
memory system busy (an 8B model's down projection: 128 programs of 14,336 weights a
channel on a GPU of 132 SMs), so the depth K is split too (``SPLIT_K``): each program writes
its partial sums to a float32 workspace and counts itself in, and the last of a tile's
programs adds them up, scales and stores the output, then resets the tile's counter for the
next call. No second kernel, no zeroed buffer per call.

Tiles and splits are chosen by a rule over the row count and the weight's shape
(``tiled_config``), not timed at start-up, so that every process sums in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.backends.triton.activation import silu_and_mul
from engine.backends.triton.device import sm_count
from engine.backends.triton.fp8_widen import widen, widen_factor
from engine.backends.triton.one_row_matmul import one_row_matmul

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Splitting K pays only where the rows are few: the workspace is SPLIT_K x rows x N floats.
_MAX_SPLIT_ROWS = 16
_MAX_SPLIT_K = 8


@dataclass(frozen=True)
class TiledConfig:
    """A program's tile of the output (``block_m`` rows, ``block_n`` channels), its steps
    through K (``block_k``), the splits of K, and the launch's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


def tiled_config(rows: int, channels: int, depth: int, processors: int) -> TiledConfig:
    """The tiled kernel's configuration for ``rows`` x [channels, depth] on a GPU of
    ``processors`` SMs, chosen by shape, never timed: splits of K sum in different orders, and
    a start-up timer picked differently in different processes (``one_row_config`` says why
    that matters). Fitted to ``scripts/sweep_matmul_configs.py --parts tiled`` (the default
    models' layers and their TP=2 shards, at 4 and 16 rows in fp8 and 32, 64 and 256 in
    int8), which prints how far the rule is from the best candidate, layer by layer.

    - Up to 16 rows (decode steps): 32 channels by 256 of K a tile, K split in two, four or
      eight where the tiles alone would leave SMs idle and each split keeps at least 2048 of
      K (an 8B model's o and down projections).
    - Up to 64 rows: 16-row tiles still, no split.
    - More: 64 x 64 tiles, or 128 x 128 where the output is large (every SM gets several).
    """
    if _INTERPRETED:  # one small tile, split: every mask and the split's last-program sum
        return TiledConfig(16, 32, 32, 2, 4, 1)
    if rows <= _MAX_SPLIT_ROWS:
        block_n, split_k = 32, 1
        while (
            split_k < _MAX_SPLIT_K
            and triton.cdiv(channels, block_n) * split_k < processors
            and depth >= 2 * split_k * 2048
        ):
            split_k *= 2
        return TiledConfig(16, block_n, 256, split_k, 4, 4)
    if rows <= 32:
        return TiledConfig(16, 32, 256, 1, 4, 4)
    if rows <= 64:
        return TiledConfig(16, 64, 256, 1, 4, 3)
    if rows * channels >= 256 * 8192:
        return TiledConfig(128, 128, 64, 1, 8, 3)
    return TiledConfig(64, 64, 64, 1, 4, 4)


@triton.jit
def _weight_only_matmul_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    out_ptr,
    partial_ptr,  # [SPLIT_K, M, N] float32: each split's sums (unused without a split)
    counter_ptr,  # [tiles] int32, zero between calls: how many splits of a tile are done
    M,
    N,
    K,
    stride_x,
    stride_codes,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program per (BLOCK_M rows, BLOCK_N output channels, split of K); float32 sums."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    # This split's tiles of K: an even share, in whole tiles.
    num_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(num_tiles, SPLIT_K)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(first_tile, last_tile):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        codes = tl.load(  # [BLOCK_K, BLOCK_N]: each channel's codes are contiguous in K
            codes_ptr + cols[None, :] * stride_codes + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(x, widen(codes, x.dtype), acc)
    # The codes' widening left them divided by a power of two (fp8: 2**120 into bfloat16).
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    scale *= widen_factor(codes_ptr.dtype.element_ty, x_ptr.dtype.element_ty)
    out_mask = row_mask[:, None] & col_mask[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc * scale[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial_ptrs = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partial_ptrs + split * M * N, acc, mask=out_mask)
        # Every thread's partial sums are written before the tile counts this split in (a
        # release), and the last split reads the others' after it (an acquire).
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
        done_before = tl.atomic_add(counter, 1, sem="acq_rel")
        if done_before == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for other in range(SPLIT_K):
                total += tl.load(
                    partial_ptrs + other * M * N, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptrs, (total * scale[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0)  # zero again for the next call


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split tiles' counters, zero between calls, one buffer per device for every GEMM
    (they run one at a time on the device's stream). Grown only by a larger shape than any
    seen, which the warm-up's steps see first, before any graph is captured."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _counters[device] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return counters


def weight_only_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, gated: bool = False
) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32), codes [N, K] int8 or float8 e4m3, scale [N]
    float32 -> [M, N] in x's dtype. ``gated``: x [M, 2K] is a gated MLP's gate and up
    halves, and the input silu(gate) * up. One row takes the one-row kernel, as fast as the
    tiled kernel or faster on every layer (``scripts/sweep_matmul_configs.py --parts tiled``
    times both at one row)."""
    if x.shape[0] == 1:
        return one_row_matmul(x, codes, scale, gated=gated)
    return tiled_matmul(silu_and_mul(x) if gated else x, codes, scale)


def tiled_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    config: TiledConfig | None = None,
) -> torch.Tensor:
    """``weight_only_matmul`` through the tiled kernel, with ``tiled_config``'s configuration
    unless given (the sweep's candidates)."""
    rows, depth = x.shape
    channels = codes.shape[0]
    assert codes.shape[1] == depth and scale.shape == (channels,)
    assert x.stride(1) == 1 and codes.stride(1) == 1 and scale.dtype == torch.float32
    out = x.new_empty(rows, channels)
    config = config or tiled_config(rows, channels, depth, sm_count(x.device))
    splits = config.split_k > 1
    # A split writes its partial sums to a workspace and counts itself in on its tile's
    # counter; without splits both are placeholders.
    partial = x.new_empty(config.split_k * rows * channels if splits else 1, dtype=torch.float32)
    # One counter per (16 rows, 16 channels): enough for any split configuration's tiles,
    # so the first call at a shape (the warm-up's, before any graph's capture) sizes it.
    tiles = triton.cdiv(rows, 16) * triton.cdiv(channels, 16) if splits else 1
    counters = _tile_counters(x.device, tiles)
    columns = triton.cdiv(channels, config.block_n)
    grid = (triton.cdiv(rows, config.block_m), columns, config.split_k)
    _weight_only_matmul_kernel[grid](
        x,
        codes,
        scale,
        out,
        partial,
        counters,
        rows,
        channels,
        depth,
        x.stride(0),
        codes.stride(0),
        out.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        num_warps=config.warps,
        num_stages=config.stages,
    )
    return out
