"""SiLU-and-multiply and GELU(tanh)-and-multiply, the gated MLP's activation on the fused
gate/up projection; and the experts' activation as the MoE kernels' epilogues compute it
(``gated_activation``)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)

_BLOCK = 1024


@triton.jit
def gated_activation(gate, up, alpha, limit, CLAMPED_SWIGLU: tl.constexpr):
    """float32 gate and up sums -> silu(gate) * up, or gpt-oss's clamped SwiGLU (gate
    clamped above at ``limit``, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha *
    gate); ``LayerOps.moe_experts``), in float32."""
    if CLAMPED_SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1) * gate * tl.sigmoid(alpha * gate)
    return gate * tl.sigmoid(gate) * up


# GELU's tanh form: 0.5 * g * (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) * (g +
# 0.044715 g^3).
_GELU_TANH_SCALE = tl.constexpr(2 * math.sqrt(2 / math.pi))
_GELU_TANH_CUBE = tl.constexpr(0.044715)


@triton.jit
def _gated_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_out,
    GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per (row, block of BLOCK columns): silu(gate) * up, or GELU_TANH's gelu(gate)
    * up; computed in float32, rounded once."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate_ptr = x_ptr + row * stride_x + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = _GELU_TANH_SCALE * (gate + _GELU_TANH_CUBE * gate * gate * gate)
        out = gate * tl.sigmoid(inner) * up
    else:
        out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2 * I], gate then up halves -> silu(gate) * up: [T, I] in x's dtype."""
    return _gated(x, out, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I], gate then up halves -> gelu(gate, approximate="tanh") * up: [T, I] in
    x's dtype (Gemma's MLP)."""
    return _gated(x, None, gelu_tanh=True)


def _gated(x: torch.Tensor, out: torch.Tensor | None, *, gelu_tanh: bool) -> torch.Tensor:
    num_rows, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    intermediate_size = width // 2
    if out is None:
        out = x.new_empty(num_rows, intermediate_size)
    assert out.shape == (num_rows, intermediate_size) and out.dtype == x.dtype
    assert out.stride(1) == 1
    grid = (num_rows, triton.cdiv(intermediate_size, _BLOCK))
    _gated_kernel[grid](
        x,
        out,
        intermediate_size,
        x.stride(0),
        out.stride(0),
        GELU_TANH=gelu_tanh,
        BLOCK=_BLOCK,
        **launch_options(x.device),
    )
    return out
