"""W8A8 FP8 products on CUDA: per-token FP8 activations times an FP8 weight with one scale per
output channel, through cuBLAS, with the scales applied where its kernels are fastest.

``torch._scaled_mm`` multiplies FP8 codes either with one scale a tensor (cuBLAS) or with
rowwise scales (a kernel of its own). Where the output is small, a decode batch's rows (a few
hundred) by a narrow layer's outputs (the o and down projections' hidden size), the rowwise
kernel's tiles leave much of the GPU idle and the tensor-wide product is much faster
(``scripts/bench_kernels.py --fp8-products`` times both at a model's shapes). There the
product is taken with scales of one, into float32, and one more kernel multiplies each value
by its token's and channel's scales as it rounds to the output's dtype: a pass over the
[T, N] output, small against what it saves. Larger outputs (wide layers, prompts' many rows)
keep the rowwise product, as fast or faster there with no second pass.

Both accumulate fast (``use_fast_accum``): Hopper's FP8 tensor cores add in reduced precision,
and a kernel that promotes its partial sums to float32 every few steps runs slower; vLLM's
and TensorRT-LLM's FP8 GEMMs skip the promotion too. The tests bound the error against the
float32 product (``tests/gpu/test_fp8_matmul_cuda.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.backends.fp8 import rowwise_scaled_mm
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)

# Where the unscaled product and its scaling kernel beat the rowwise product: outputs of at
# most this many values, 64 of the rowwise kernel's 128 x 128 tiles, too few to fill an H100's
# or H200's 132 SMs. Past it the rowwise kernel keeps up, and the scaling pass, which grows
# with the output, costs more than it saves (``scripts/bench_kernels.py --fp8-products``).
UNSCALED_MAX_OUTPUTS = 1 << 20
_BLOCK = 1024  # a program's output values


@triton.jit
def _scale_product_kernel(
    product_ptr,
    out_ptr,
    token_scale_ptr,
    channel_scale_ptr,
    N,
    stride_product,
    stride_out,
    BLOCK: tl.constexpr,
):
    """Program (token, BLOCK channels): the unscaled product's values times the token's and
    each channel's scale, rounded to the output's dtype."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    values = tl.load(product_ptr + row * stride_product + cols, mask=mask)
    scales = tl.load(token_scale_ptr + row) * tl.load(channel_scale_ptr + cols, mask=mask)
    out = (values * scales).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    # Made by the first product, a warm-up's, never inside a CUDA graph's capture.
    return torch.ones((), dtype=torch.float32, device=device)


# ``fp8_matmul``'s product with the scales in its kernel (``_scaled_mm``'s rowwise scales).
rowwise_product = functools.partial(rowwise_scaled_mm, fast_accumulation=True)


def takes_unscaled_product(num_rows: int, num_columns: int) -> bool:
    """Whether ``fp8_matmul`` takes the product unscaled, then scales it."""
    return num_rows * num_columns <= UNSCALED_MAX_OUTPUTS


def fp8_matmul(
    codes: torch.Tensor,
    token_scale: torch.Tensor,
    weight: torch.Tensor,
    channel_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(codes * token_scale) @ (weight * channel_scale[:, None]).T`` of FP8 codes [T, K]
    with float32 scales [T, 1] and an FP8 weight [N, K] with float32 scales [N], in
    ``out_dtype``: by the faster of the two products at its shape."""
    if takes_unscaled_product(codes.shape[0], weight.shape[0]):
        return scaled_after_product(codes, token_scale, weight, channel_scale, out_dtype)
    return rowwise_product(codes, token_scale, weight, channel_scale, out_dtype)


def scaled_after_product(
    codes: torch.Tensor,
    token_scale: torch.Tensor,
    weight: torch.Tensor,
    channel_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``fp8_matmul``'s product taken unscaled (cuBLAS's tensor-wide kernel) into float32,
    then scaled and rounded by ``_scale_product_kernel``."""
    one = _unit_scale(codes.device)
    product = torch._scaled_mm(
        codes, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True
    )
    out = torch.empty(product.shape, dtype=out_dtype, device=product.device)
    num_rows, num_columns = product.shape
    _scale_product_kernel[(num_rows, triton.cdiv(num_columns, _BLOCK))](
        product,
        out,
        token_scale,
        channel_scale,
        num_columns,
        product.stride(0),
        out.stride(0),
        BLOCK=_BLOCK,
        **launch_options(product.device),
    )
    return out
