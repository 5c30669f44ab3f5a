"""Activations as float8 e4m3 codes with one float32 scale per token, in one kernel: what a
W8A8 FP8 GEMM (``torch._scaled_mm``, rowwise scales) takes as its first operand.

In PyTorch ops the quantization is eight kernels a linear layer (abs, amax, the float32
copies, the divisions, the clamps, the cast), each reading or writing the whole [T, K]
activation: at a large decode batch of a small model they cost more than the FP8 product
saves (``scripts/bench_quantization.py --speed-model`` times a decode step at batch 64 with
each method). Here a program takes a token: it reads the row into registers, takes its
largest magnitude, divides and rounds, and writes the codes and the scale. A row wider than
``_MAX_BLOCK`` is read twice, in chunks: once for the largest magnitude, then again (from
cache) to divide and round.

``gated``: the row is a gated MLP's gate and up halves [2K], and the activation quantized is
silu(gate) * up, rounded to the row's dtype as ``silu_and_mul`` stores it: the down
projection's input with no activation kernel of its own.

A ``DeferredNorm`` (``engine.backends.deferred_norm``): the activation is the layer norm's output,
rms_norm(x + residual) * weight, computed as the norm's kernel computes it
(``norm.add_and_normalize``), which also writes the residual stream: the Q/K/V and gate/up
projections' inputs with no norm kernel of their own, two launches a layer fewer.

The numbers are those of ``engine.backends.pytorch.quantize_per_token_fp8`` (float32
division, rounding to nearest even): the torch backend's quantization, the Triton backend's
for tensors not on CUDA, and this kernel's reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.backends.deferred_norm import DeferredNorm, norm_arguments
from engine.backends.fp8 import FP8, FP8_MAX, MIN_SCALE
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)
from engine.backends.triton.norm import add_and_normalize

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
# quantize_per_token_fp8's, so that the codes and scales are the same
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_MAX_BLOCK = 16384  # a row's values a program holds at once (16 warps: 32 a thread)


@triton.jit
def _row_chunk(x_ptr, row_start, cols, mask, K, GATED: tl.constexpr):
    """The activation's values at ``cols`` of a row, in float32 (rounded to x's dtype first
    where they are computed)."""
    x = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + row_start + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _on_e4m3_grid(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still as
    float32. Only for Triton's interpreter, whose float32 -> e4m3 conversion rounds half up
    and drops the carry of a mantissa that rounds up (7.8 becomes 4.0): given values already
    on the grid, it has nothing to round. The GPU's conversion rounds correctly itself."""
    bits = x.to(tl.uint32, bitcast=True)
    # Normal e4m3 (|x| >= 2**-6): keep 3 of float32's 23 mantissa bits, a carry moving up.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = kept.to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2**-9; adding and taking away 1.5 * 2**23 rounds to an
    # integer, ties to even, in float32's own arithmetic (of the magnitude: zero keeps its sign).
    magnitude = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) / 512.0
    subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(
        tl.float32, bitcast=True
    )
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_scale(largest, scale_ptr, row):
    """The row's scale, from the largest magnitudes seen (any shape), stored and returned."""
    scale = tl.maximum(tl.max(largest, 0), _MIN_SCALE) / _FP8_MAX
    tl.store(scale_ptr + row, scale)
    return scale


@triton.jit
def _store_codes(values, scale, codes_ptr, cols, mask):
    scaled = tl.minimum(tl.maximum(values / scale, -_FP8_MAX), _FP8_MAX)
    if _INTERPRETED:
        scaled = _on_e4m3_grid(scaled)
    tl.store(codes_ptr + cols, scaled.to(tl.float8e4nv), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scale_ptr,
    residual_ptr,  # NORM: the norm's residual, norm weight and stream (x where unread)
    norm_weight_ptr,
    stream_ptr,
    K,
    stride_x,  # x's, and the residual's and stream's
    stride_codes,
    eps,
    GATED: tl.constexpr,
    NORM: tl.constexpr,  # ONE_PASS only: the norm needs the row's sum of squares first
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK covers the row
):
    """Program per token: its largest magnitude, then its codes."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    row_start = row.to(tl.int64) * stride_x
    row_codes_ptr = codes_ptr + row.to(tl.int64) * stride_codes
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        if NORM:
            values = add_and_normalize(
                x_ptr + row_start,
                residual_ptr + row_start,
                norm_weight_ptr,
                stream_ptr + row_start,
                cols,
                mask,
                K,
                eps,
                HAS_RESIDUAL,
            ).to(tl.float32)
        else:
            values = _row_chunk(x_ptr, row_start, cols, mask, K, GATED)
        scale = _store_scale(tl.abs(values), scale_ptr, row)
        _store_codes(values, scale, row_codes_ptr, cols, mask)
    else:
        largest = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            values = _row_chunk(x_ptr, row_start, cols, cols < K, K, GATED)
            largest = tl.maximum(largest, tl.abs(values))
        scale = _store_scale(largest, scale_ptr, row)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < K
            values = _row_chunk(x_ptr, row_start, cols, mask, K, GATED)
            _store_codes(values, scale, row_codes_ptr, cols, mask)


def quantize_rows_fp8(
    x: torch.Tensor | DeferredNorm, *, gated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (or [T, 2K] gate and up halves, ``gated``: silu(gate) * up is quantized; or a
    deferred norm of rows [T, K], whose output is quantized and whose stream is written) ->
    (codes [T, K] float8 e4m3, scales [T, 1] float32), ``codes * scale`` ≈ the activation."""
    norm = x if isinstance(x, DeferredNorm) else None
    if norm is not None:
        assert not gated
        x = norm.x
        for vector in (norm.residual, norm.stream):
            assert vector is None or vector.stride() == x.stride()
    num_rows, width = x.shape
    assert x.stride(1) == 1 and (not gated or width % 2 == 0)
    depth = width // 2 if gated else width
    codes = torch.empty(num_rows, depth, dtype=FP8, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(depth), _MAX_BLOCK)
    assert norm is None or block >= depth, "a norm's row is quantized in one pass"
    norm_args = norm_arguments(x, norm)
    _quantize_rows_kernel[(num_rows,)](
        x,
        codes,
        scale,
        *norm_args.pointers,
        depth,
        x.stride(0),
        codes.stride(0),
        norm_args.eps,
        GATED=gated,
        NORM=norm is not None,
        HAS_RESIDUAL=norm_args.has_residual,
        BLOCK=block,
        ONE_PASS=block >= depth,
        num_warps=min(max(block // 1024, 4), 16),
        **launch_options(x.device),
    )
    return codes, scale
