"""MXFP4, the OCP microscaling format gpt-oss's experts are published in: blocks of 32
values, each a 4-bit float (e2m1) with one 8-bit power-of-two scale (e8m0) a block.

A checkpoint stores a matrix [..., rows, columns] as ``*_blocks`` uint8 [..., rows,
columns / 32, 16], two values a byte (the low nibble first), and ``*_scales`` uint8 [...,
rows, columns / 32], each the exponent of its block's scale plus 127. The values are
transformers' (``convert_moe_packed_tensors``): value * 2 ** (scale - 127).

Here, beside the backends, because ``LayerOps.moe_experts`` takes MXFP4 experts as stored
(``--quantization mxfp4``): the torch backend dequantizes them with ``dequantize_mxfp4``, the
Triton backend's kernels read them (``engine.backends.triton.mxfp4_moe``).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values a scale covers
# The 16 values of a 4-bit e2m1 code: sign, two exponent bits, one mantissa bit.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``blocks`` uint8 [..., G, 16] and ``scales`` uint8 [..., G] -> [..., G * 32] in
    ``dtype`` (exact in float32 and bfloat16, whose exponents hold every e8m0 scale)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    codes = blocks.to(torch.uint8)
    # Each byte's low nibble is the even value, its high nibble the odd one.
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]
    # Integer exponents: ldexp then scales exactly, where 2 ** 128 alone would overflow.
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)
