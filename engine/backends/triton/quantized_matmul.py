"""Weight-only GEMM over 8-bit weights: ``x @ (codes * scale[:, None]).T``.

The weight stays one byte an element in memory (int8 or float8 e4m3 codes, [N, K]) and is
widened to the activation's dtype tile by tile inside the kernel, exactly (every int8 and
e4m3 value is a bfloat16); the per-output-channel scales multiply the float32 accumulator
once at the end. At small batch a GEMM is bound by reading the weight, so this halves the
bytes of a bf16 GEMM.

Tiles are autotuned per weight shape and per bucket of the row count (``_rows_bucket``); the
tuning runs at start-up, before each CUDA graph's capture and in the warm-up's steps, so a
captured step only launches and no request waits for it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    if _INTERPRETED:  # one small tile: the interpreter runs every config it tunes
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32})]
    small = [  # few rows: many narrow column blocks to spread the weight over the SMs
        triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s)
        for n, k, s in ((32, 256, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3))
    ]
    large = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64}, num_warps=w, num_stages=s)
        for m, n, w, s in ((64, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 64, 4, 4))
    ]
    return small + large


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """No tile taller than the rows' bucket: a decode step tries only the small tiles."""
    rows = named_args["M_BUCKET"]
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= max(rows, 16)]
    return fitting or configs[:1]


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "M_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _weight_only_matmul_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    out_ptr,
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
):
    """Program per (BLOCK_M rows, BLOCK_N output channels); float32 accumulator."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    codes_ptrs = codes_ptr + cols[None, :] * stride_codes + ks[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        codes = tl.load(codes_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, codes.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        codes_ptrs += BLOCK_K
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    out = acc * scale[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _rows_bucket(rows: int) -> int:
    """Up to 16 rows, 32, 64, then one bucket for more: few enough that the engine's start
    (the decode graphs' batch sizes, the warm-up's prefill of 74 tokens) tunes them all."""
    return 16 if rows <= 16 else min(triton.next_power_of_2(rows), 128)


def weight_only_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32), codes [N, K] int8 or float8 e4m3, scale [N]
    float32 -> [M, N] in x's dtype."""
    rows, depth = x.shape
    channels = codes.shape[0]
    assert codes.shape[1] == depth and scale.shape == (channels,)
    assert x.stride(1) == 1 and codes.stride(1) == 1 and scale.dtype == torch.float32
    out = x.new_empty(rows, channels)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(rows, meta["BLOCK_M"]), triton.cdiv(channels, meta["BLOCK_N"])

    _weight_only_matmul_kernel[grid](
        x,
        codes,
        scale,
        out,
        rows,
        channels,
        depth,
        _rows_bucket(rows),
        x.stride(0),
        codes.stride(0),
        out.stride(0),
    )
    return out
