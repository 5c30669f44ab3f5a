"""Weight-only GEMM over 8-bit weights: ``x @ (codes * scale[:, None]).T``.

The weight stays one byte an element in memory (int8 or float8 e4m3 codes, [N, K]) and is
widened to the activation's dtype tile by tile inside the kernel, exactly (every int8 and
e4m3 value is a bfloat16; e4m3 by placing bits, ``fp8_widen``); the per-output-channel
scales multiply the float32 accumulator once at the end. At small batch a GEMM is bound by
reading the weight, so this halves the bytes of a bf16 GEMM.

At a few rows, one program per block of output channels is too few programs to keep the
memory system busy (an 8B model's down projection: 128 programs of 14,336 weights a
channel on 132 SMs), so the depth K is split too (``SPLIT_K``): each program writes its
partial sums to a float32 workspace and counts itself in, and the last of a tile's
programs adds them up, scales and stores the output, then resets the tile's counter for the
next call. No second kernel, no zeroed buffer per call.

Tiles and splits are autotuned per weight shape and per bucket of the row count
(``_rows_bucket``), timing each candidate replayed from a CUDA graph: launched one by one
from Python, a 30-microsecond kernel is timed as its launch. The tuning runs at start-up,
before each CUDA graph's capture and in the warm-up's steps, so a captured step only
launches and no request waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

from engine.backends.triton.activation import silu_and_mul
from engine.backends.triton.fp8_widen import widen, widen_factor
from engine.backends.triton.one_row_matmul import one_row_matmul

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Splitting K pays only where the rows are few: the workspace is SPLIT_K x rows x N floats.
_MAX_SPLIT_ROWS = 16
_MAX_SPLIT_K = 8


def _configs() -> list[triton.Config]:
    if _INTERPRETED:  # one small tile, split: the interpreter runs every config it tunes
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2})]
    small = [  # few rows: narrow column blocks and split depths, to spread the weight
        triton.Config(
            {"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split},
            num_warps=w,
            num_stages=s,
        )
        for n, k, w, s in (
            (16, 256, 4, 4),
            (32, 256, 4, 4),
            (64, 128, 4, 4),
            (64, 256, 4, 3),
            (128, 128, 4, 3),
            (32, 512, 8, 3),
        )
        for split in (1, 2, 4, 8)
    ]
    large = [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64, "SPLIT_K": 1}, num_warps=w, num_stages=s
        )
        for m, n, w, s in ((64, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 64, 4, 4))
    ]
    return small + large


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """No tile taller than the rows' bucket (a decode step tries only the small tiles), and
    no split K beyond a few rows."""
    rows = named_args["M_BUCKET"]
    fitting = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= max(rows, 16)
        and (c.kwargs["SPLIT_K"] == 1 or rows <= _MAX_SPLIT_ROWS)
    ]
    return fitting or configs[:1]


def _time_replayed(kernel_call: Callable[[], object], quantiles: list[float]) -> list[float]:
    """A candidate's time replayed from a CUDA graph, over 10 ms of replays (Triton's default
    with graphs, 100 ms, made an 8B engine's start take 88 s: about 230 candidates over its
    layer shapes and row buckets). Triton times it on a stream of its own: the device is
    drained first and after, so that no GEMM of the step being tuned, still running on the
    engine's stream, shares the tile counters with it at the same time."""
    torch.cuda.synchronize()
    timings = triton.testing.do_bench_cudagraph(kernel_call, rep=10, quantiles=quantiles)
    torch.cuda.synchronize()
    return timings


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "M_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_time_replayed,
)
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
    M_BUCKET,  # the autotuning key for the row count
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


def _rows_bucket(rows: int) -> int:
    """Up to 16 rows, 32, 64, then one bucket for more: few enough that the engine's start
    (the decode graphs' batch sizes, the warm-up's prefill of 74 tokens) tunes them all."""
    return 16 if rows <= 16 else min(triton.next_power_of_2(rows), 128)


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split tiles' counters, zero between calls, one buffer per device for every GEMM
    (they run one at a time on the device's stream). Grown only by a larger shape than any
    seen, which the start-up's tuning sees first, before any graph is captured."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _counters[device] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return counters


def weight_only_matmul(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, gated: bool = False
) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32), codes [N, K] int8 or float8 e4m3, scale [N]
    float32 -> [M, N] in x's dtype. ``gated``: x [M, 2K] is a gated MLP's gate and up
    halves, and the input silu(gate) * up."""
    depth = codes.shape[1]
    if x.shape[0] == 1 and _one_row_kernel_is_faster(x[:, :depth], codes, scale):
        return one_row_matmul(x, codes, scale, gated=gated)
    return _tiled_matmul(silu_and_mul(x) if gated else x, codes, scale)


# Per (weight shape, codes' dtype, x's dtype): whether one row reads faster through
# one_row_matmul than through the tiled kernel.
_one_row_faster: dict[tuple, bool] = {}


def _one_row_kernel_is_faster(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """Measured once per weight shape, at the first call (start-up's tuning), each kernel
    after an L2 flush: the one-row kernel wins on the projections and loses to the tiled
    kernel's wide column blocks on an 8B model's gate/up (40 against 43 us in fp8)."""
    key = (tuple(codes.shape), codes.dtype, x.dtype)
    faster = _one_row_faster.get(key)
    if faster is None:
        if _INTERPRETED or torch.cuda.is_current_stream_capturing():
            return True  # the interpreter tests both; a capture cannot time (tuned before)
        one_row = triton.testing.do_bench(lambda: one_row_matmul(x, codes, scale), rep=10)
        tiled = triton.testing.do_bench(lambda: _tiled_matmul(x, codes, scale), rep=10)
        faster = _one_row_faster[key] = one_row <= tiled
    return faster


def _tiled_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, depth = x.shape
    channels = codes.shape[0]
    assert codes.shape[1] == depth and scale.shape == (channels,)
    assert x.stride(1) == 1 and codes.stride(1) == 1 and scale.dtype == torch.float32
    out = x.new_empty(rows, channels)
    # Only a few rows may split (``_prune``); more get a placeholder workspace and counter.
    splits = _INTERPRETED or rows <= _MAX_SPLIT_ROWS
    partial = x.new_empty(_MAX_SPLIT_K * rows * channels if splits else 1, dtype=torch.float32)
    # One counter per (row block, 16 channels): enough for any split config's tiles.
    tiles = triton.cdiv(rows, 16) * triton.cdiv(channels, 16) if splits else 1
    counters = _tile_counters(x.device, tiles)

    def grid(meta: dict) -> tuple[int, int, int]:
        return (
            triton.cdiv(rows, meta["BLOCK_M"]),
            triton.cdiv(channels, meta["BLOCK_N"]),
            meta["SPLIT_K"],
        )

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
        _rows_bucket(rows),
        x.stride(0),
        codes.stride(0),
        out.stride(0),
    )
    return out
