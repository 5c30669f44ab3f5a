"""MXFP4 weights widened in registers, for the kernels that read them as stored
(``mxfp4_moe``'s grouped kernels, ``moe_decode``'s by-token kernels): a step of BLOCK_N
weight rows is loaded as bytes [BLOCK_N, BLOCK_K / 2] and e8m0 scales [BLOCK_N, BLOCK_K /
32] (``load_mxfp4_rows``), then each nibble's e2m1 code is turned into its value by bit
arithmetic (``e2m1_halves``), times its block's power of two (``block_scales``), the low
and high nibbles interleaved back into the order of the depth (``widened_values``: a
tensor-core tile's), or each multiplied by the activation it meets and summed a block before
its scale (``nibble_products``: the CUDA cores' products of the decode path). Every MXFP4
value is exact in float32, and in bfloat16 (float16 only for scales within its range)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.backends.mxfp4 import BLOCK

MXFP4_BLOCK = tl.constexpr(BLOCK)  # values a scale covers, in the kernels


@triton.jit
def e2m1_halves(codes):
    """float32 values of 4-bit e2m1 codes (any integer type, 0 to 15) times 2 ** -14: each
    code's bits placed as a float16's (its sign bit on the sign, its two exponent bits and
    mantissa bit just under the mantissa's top), whose value is the e2m1 one times 2 ** -14,
    float16's subnormals included (code 1, 0.5, is 2 ** -15), -0.0 too; widened to float32
    exactly. Two shifts, a select of bits and a conversion: the value's 2 ** 14 goes into the
    block's scale (``block_scales``)."""
    codes = codes.to(tl.int32)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def block_scales(exponents):
    """float32 2 ** (s - 127 + 14) of e8m0 scale bytes s: the block's power of two times the
    2 ** 14 that ``e2m1_halves`` leaves out. Exact for s of 1 to 240 (gpt-oss's are near
    127; 0 gives 2 ** -113, not 2 ** -127, and 241 to 255 infinities)."""
    return ((exponents.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_mxfp4_rows(
    row_ptrs,
    scale_row_ptrs,
    row_mask,
    start,
    depth,
    BLOCK_K: tl.constexpr,
):
    """The bytes [..., BLOCK_K / 2] and scales [..., BLOCK_K / 32] of values ``start`` to
    ``start + BLOCK_K`` (of ``depth``, whole blocks) of MXFP4 rows: each row's bytes from
    ``row_ptrs``, its e8m0 scales from ``scale_row_ptrs``, both [..., 1] (any rank), as
    ``row_mask``; zero past the depth and in masked rows (zero bytes are zeros)."""
    bytes_ = start // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(row_ptrs + bytes_, mask=row_mask & (bytes_ < depth // 2), other=0)
    blocks = start // MXFP4_BLOCK + tl.arange(0, BLOCK_K // MXFP4_BLOCK)
    exponents = tl.load(
        scale_row_ptrs + blocks, mask=row_mask & (blocks < depth // MXFP4_BLOCK), other=0
    )
    return packed, exponents


@triton.jit
def widened_values(packed, exponents, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [ROWS, BLOCK_K] of ``load_mxfp4_rows``' bytes and scales, in the order of the
    depth: each byte's low nibble is the even value, its high nibble the odd one."""
    values = tl.join(e2m1_halves(packed & 0xF), e2m1_halves(packed >> 4))
    values = tl.reshape(values, (ROWS, BLOCK_K // MXFP4_BLOCK, MXFP4_BLOCK))
    values = values * block_scales(exponents)[:, :, None]
    return tl.reshape(values, (ROWS, BLOCK_K))


@triton.jit
def nibble_products(packed, even, odd):
    """Each byte's two values (``e2m1_halves``: without their blocks' scales) times the
    activations they meet, ``even`` for the low nibbles' and ``odd`` for the high ones'
    (broadcast to the bytes' shape), added: the depth never interleaved, the scale left for
    the block's sum."""
    return e2m1_halves(packed & 0xF) * even + e2m1_halves(packed >> 4) * odd


@triton.jit
def widened_tile(
    row_ptrs,
    scale_row_ptrs,
    row_mask,
    start,
    depth,
    dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] in ``dtype``, a dot's right operand: values ``start`` to
    ``start + BLOCK_K`` of BLOCK_N MXFP4 rows (``load_mxfp4_rows``' arguments)."""
    packed, exponents = load_mxfp4_rows(
        row_ptrs[:, None], scale_row_ptrs[:, None], row_mask[:, None], start, depth, BLOCK_K
    )
    return tl.trans(widened_values(packed, exponents, BLOCK_N, BLOCK_K).to(dtype))
