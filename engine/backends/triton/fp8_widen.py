"""Float8 e4m3 to bfloat16 or float16 by placing bits, inside Triton kernels.

Triton widens e4m3 to bfloat16 through float16 on Hopper: one packed conversion per two
values, then one F2F conversion per value, and F2F runs at a quarter of the integer rate or
less. A kernel that reads fp8 weights or an fp8 KV cache at copy bandwidth must widen a
value for every byte the memory delivers, trillions a second, which those conversions cannot
keep up with: through them the weight-only GEMM read fp8 well below copy bandwidth, and the
decode kernel was no faster than bf16 reading twice the bytes
(docs/history/benchmarks-lab-notebook.md). ``scripts/bench_quantization.py --kernels`` prints
the weight-only GEMM's bandwidth, ``scripts/bench_kernels.py --kv-cache-dtype fp8`` decode
attention's share of copy bandwidth.

Every e4m3 value is the same bits as a bfloat16 (or float16) with the exponent's bias moved:
sign, then the exponent and mantissa shifted right into place, subnormals included. So
three integer instructions make two values (``prmt`` sign-extends each byte into a 16-bit
half, a shift places it, a mask keeps sign, exponent and mantissa), and the result is the
value times ``2**-120`` (bfloat16) or ``2**-8`` (float16). The caller multiplies once by the
factor (``widen_factor``): in a GEMM's epilogue, into a softmax's scale.

To float32 (the one-row kernel's products), the hardware's packed e4m3 -> float16 conversion
and a float16 -> float32 one cost less than placing bits: 1.5 instructions a value, exact,
factor 1.

The interpreter (the CPU tests) and other dtypes convert as Triton does, factor 1.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

# Four e4m3 bytes in $2 -> four 16-bit values in $0 (bytes 0, 1) and $1 (bytes 2, 3).
# prmt selector 0x9180 makes halves [sign(b1) b1 | sign(b0) b0], 0xB3A2 the same of b2, b3.
_SHIFT_ASM = """
{{
.reg .b32 lo, hi;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, {shift};
shl.b32 hi, hi, {shift};
and.b32 $0, lo, {mask};
and.b32 $1, hi, {mask};
}}
"""
# bfloat16 (8 exponent bits, bias 127): s 0000 eeee mmm 0000, the value times 2**(7 - 127).
_TO_BF16_ASM = tl.constexpr(_SHIFT_ASM.format(shift=4, mask="0x87F087F0"))
_BF16_FACTOR = tl.constexpr(2.0**120)
# float16 (5 exponent bits, bias 15): s 0eeee mmm 0000000, the value times 2**(7 - 15).
_TO_FP16_ASM = tl.constexpr(_SHIFT_ASM.format(shift=7, mask="0xBF80BF80"))
_FP16_FACTOR = tl.constexpr(2.0**8)


@triton.jit
def widen(values, dtype: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``values`` as ``dtype``; e4m3 ones by placing bits, which leaves them divided by
    ``widen_factor(values.dtype, dtype)`` (exactly: NaN codes aside, which a clamped
    quantization never makes).

    TRANSPOSED: the values feed ``tl.dot`` across their contiguous dimension (an attention's V,
    key-major, reduced over keys). Hopper cannot transpose bytes on their way from shared
    memory into a dot (ldmatrix transposes 16-bit values only), so Triton, which widens as
    late as it can, would read them there one byte at a time (64 loads a tile). Marked
    impure, the widening stays where it is written, in registers, and the 16-bit result goes
    through shared memory instead."""
    if _INTERPRETED or values.dtype != tl.float8e4nv:
        return values.to(dtype)
    elif dtype == tl.float32:
        # Through the hardware's packed conversion to float16 (exact; 8.9 and up), then one
        # HADD2.F32 a value: fewer instructions in the one-row kernel's loop than placing
        # bfloat16's bits and widening those to float32 (compare the loops' SASS).
        return values.to(tl.float16).to(tl.float32)
    elif dtype == tl.bfloat16 or dtype == tl.float16:
        return tl.inline_asm_elementwise(
            _TO_BF16_ASM if dtype == tl.bfloat16 else _TO_FP16_ASM,
            "=r,=r,r",
            [values.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16 if dtype == tl.bfloat16 else tl.float16,
            is_pure=not TRANSPOSED,
            pack=4,
        )
    else:
        return values.to(dtype)


@triton.jit
def widen_factor(source: tl.constexpr, dtype: tl.constexpr):
    """What ``widen`` from ``source`` to ``dtype`` leaves its values divided by."""
    if _INTERPRETED or source != tl.float8e4nv:
        return 1.0
    elif dtype == tl.bfloat16:
        return _BF16_FACTOR
    elif dtype == tl.float16:
        return _FP16_FACTOR
    else:
        return 1.0
