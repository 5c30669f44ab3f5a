"""RMSNorm fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)


@triton.jit
def add_and_normalize(
    x_row, residual_row, weight_ptr, residual_out_row, cols, mask, hidden_size, eps, HAS_RESIDUAL
):
    """One row's rms_norm(x + residual) * weight in x's dtype, rounded as Hugging Face's
    RMSNorm rounds; x + residual written to ``residual_out_row``. (The pointers are the row's.)
    The FP8 quantization of a norm's output (``fp8_quantize``) computes it the same way."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Added in the model dtype, as Hugging Face does, so the stream rounds the same way.
        x += tl.load(residual_row + cols, mask=mask, other=0.0)
        tl.store(residual_out_row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    return (x32 * inv_rms).to(x.dtype) * weight


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per row; the whole row stays in registers between the add and the norm."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    out = add_and_normalize(
        x_ptr + row * stride_x,
        residual_ptr + row * stride_residual,
        weight_ptr,
        residual_out_ptr + row * stride_residual_out,
        cols,
        mask,
        hidden_size,
        eps,
        HAS_RESIDUAL,
    )
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; out = rmsnorm(residual) * weight``; returns (out, residual).

    x, residual: [T, hidden]; weight: [hidden], all one dtype. The norm is computed in
    float32 and cast back before the weight, as Hugging Face's RMSNorm. Without a residual
    (the first layer) x is normalized and returned as the residual. ``residual_out`` may be
    ``residual`` or ``x`` itself (each row is read whole before it is written).
    """
    num_rows, hidden_size = x.shape
    assert weight.shape == (hidden_size,) and weight.dtype == x.dtype and x.stride(1) == 1
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    has_residual = residual is not None
    if residual is None:
        assert residual_out is None, "without a residual, x itself is returned as one"
        residual = residual_out = x  # unread and unwritten: the kernel is built without the add
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(1) == 1
        if residual_out is None:
            residual_out = torch.empty_like(x)
        assert residual_out.shape == x.shape and residual_out.dtype == x.dtype
        assert residual_out.stride(1) == 1
    block = triton.next_power_of_2(hidden_size)
    _add_rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        out,
        residual_out,
        hidden_size,
        eps,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        residual_out.stride(0),
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        **launch_options(x.device),
    )
    return out, residual_out
