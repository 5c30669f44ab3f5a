"""SiLU-and-multiply, the gated MLP's activation on the fused gate/up projection; and the
experts' activation as the MoE kernels' epilogues compute it (``gated_activation``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
):
    """Program per (row, block of BLOCK columns); computed in float32, rounded once."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate_ptr = x_ptr + row * stride_x + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2 * I], gate then up halves -> silu(gate) * up: [T, I] in x's dtype."""
    num_rows, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    intermediate_size = width // 2
    if out is None:
        out = x.new_empty(num_rows, intermediate_size)
    assert out.shape == (num_rows, intermediate_size) and out.dtype == x.dtype
    assert out.stride(1) == 1
    grid = (num_rows, triton.cdiv(intermediate_size, _BLOCK))
    _silu_and_mul_kernel[grid](x, out, intermediate_size, x.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out
