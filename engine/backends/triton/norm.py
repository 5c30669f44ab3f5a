"""RMSNorm fused with the residual add that precedes it; and the norm whose product with its
weight is in float32 too, rounded once (OLMo 2's; Gemma's, which scales by 1 + its weight),
of whole rows or of each head of a row (Q/K norms). Gemma's sandwich layer normalizes a
sublayer's output by a norm of its own before it joins the stream, and the stream by the
next norm: both norms and the add in one pass (``output_norm_weight``)."""

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
def _normalize(
    x, weight_ptr, cols, mask, hidden_size, eps, weight_offset, ROUND_ONCE: tl.constexpr
):
    """One row x's rms_norm * weight in x's dtype, rounded as Hugging Face's RMSNorm rounds
    (ROUND_ONCE: times weight_offset + weight in float32, rounded once at the end)."""
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask)
    if ROUND_ONCE:
        return (x32 * inv_rms * (weight.to(tl.float32) + weight_offset)).to(x.dtype)
    return (x32 * inv_rms).to(x.dtype) * weight


@triton.jit
def add_and_normalize(
    x_row,
    residual_row,
    weight_ptr,
    residual_out_row,
    cols,
    mask,
    hidden_size,
    eps,
    HAS_RESIDUAL,
    weight_offset=0.0,
    ROUND_ONCE: tl.constexpr = False,
    output_norm_ptr=None,
    OUTPUT_NORM: tl.constexpr = False,
):
    """One row's rms_norm(x + residual) * weight (``_normalize``); x + residual written to
    ``residual_out_row``. (The pointers are the row's.) OUTPUT_NORM (with ROUND_ONCE): x is
    first normalized so by its own weight at ``output_norm_ptr``, and rounded, as its norm's
    kernel would store it. The FP8 quantization of a norm's output (``fp8_quantize``)
    computes it the same way."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if OUTPUT_NORM:
        x = _normalize(x, output_norm_ptr, cols, mask, hidden_size, eps, weight_offset, True)
    if HAS_RESIDUAL:
        # Added in the model dtype, as Hugging Face does, so the stream rounds the same way.
        x += tl.load(residual_row + cols, mask=mask, other=0.0)
        tl.store(residual_out_row + cols, x, mask=mask)
    return _normalize(x, weight_ptr, cols, mask, hidden_size, eps, weight_offset, ROUND_ONCE)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    output_norm_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    weight_offset,
    stride_x,
    stride_x_head,
    stride_residual,
    stride_out,
    stride_out_head,
    stride_residual_out,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_ONCE: tl.constexpr,
    OUTPUT_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per (row, head: one where the rows are not cut into heads); the whole row
    stays in registers between the norms and the add."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    out = add_and_normalize(
        x_ptr + row * stride_x + head * stride_x_head,
        residual_ptr + row * stride_residual,
        weight_ptr,
        residual_out_ptr + row * stride_residual_out,
        cols,
        mask,
        hidden_size,
        eps,
        HAS_RESIDUAL,
        weight_offset,
        ROUND_ONCE,
        output_norm_ptr,
        OUTPUT_NORM,
    )
    tl.store(out_ptr + row * stride_out + head * stride_out_head + cols, out, mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    weight_offset: float | None = None,
    output_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; out = rmsnorm(residual) * weight``; returns (out, residual).

    x, residual: [T, hidden]; weight: [hidden], all one dtype. The norm is computed in
    float32 and cast back before the weight, as Hugging Face's RMSNorm; or, given a
    ``weight_offset``, times weight_offset + weight in float32 too, rounded once
    (``rms_norm_round_once``). Without a residual (the first layer) x is normalized and
    returned as the residual. ``residual_out`` may be ``residual`` or ``x`` itself (each row
    is read whole before it is written). ``output_norm_weight`` [hidden] (with a
    ``weight_offset`` and a residual): x is first ``rms_norm_round_once(x,
    output_norm_weight, eps, weight_offset)``, rounded as that norm stores it.
    """
    hidden_size = x.shape[1]
    assert x.dim() == 2 and weight.shape == (hidden_size,) and x.stride(1) == 1
    assert weight_offset is not None or weight.dtype == x.dtype
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1
    has_residual = residual is not None
    if output_norm_weight is not None:
        assert has_residual and weight_offset is not None
        assert output_norm_weight.shape == weight.shape
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
    _launch(
        x, residual, weight, out, residual_out, eps, has_residual, weight_offset, output_norm_weight
    )
    return out, residual_out


def rms_norm_round_once(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    """``rmsnorm(x) * (weight_offset + weight)`` with the product in float32 too, rounded to
    x's dtype once (``LayerOps.rms_norm_round_once``), in a new tensor: x [T, D] (whole rows)
    or [T, heads, D] (each head's D, the Q/K norms of a view of the QKV projection's rows);
    weight [D] in any float dtype."""
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (x.shape[-1],)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, x, weight, out, x, eps, False, weight_offset)
    return out


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    eps: float,
    has_residual: bool,
    weight_offset: float | None = None,
    output_norm_weight: torch.Tensor | None = None,
) -> None:
    """The kernel over x's rows, [T, D], or each head of them, [T, heads, D] (no residual);
    rounded once, times weight_offset + weight, where there is an offset; x normalized by
    ``output_norm_weight`` first where it is given."""
    heads = x.shape[1] if x.dim() == 3 else 1
    hidden_size = x.shape[-1]
    block = triton.next_power_of_2(hidden_size)
    _add_rms_norm_kernel[(x.shape[0], heads)](
        x,
        residual,
        weight,
        weight if output_norm_weight is None else output_norm_weight,  # unread without one
        out,
        residual_out,
        hidden_size,
        eps,
        weight_offset or 0.0,
        x.stride(0),
        x.stride(1) if heads > 1 else 0,
        residual.stride(0),
        out.stride(0),
        out.stride(1) if heads > 1 else 0,
        residual_out.stride(0),
        HAS_RESIDUAL=has_residual,
        ROUND_ONCE=weight_offset is not None,
        OUTPUT_NORM=output_norm_weight is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
        **launch_options(x.device),
    )
