"""Dequantize GGUF tensors to float32, bit for bit as `gguf.quants.dequantize` does.

gguf's numpy code works 16 rows at a time, with a temporary per step; for the common llama.cpp
types this does the same float32 arithmetic over the whole tensor at once, writing each value
into the output in place, which is about 2.5 times as fast. Other types go to gguf's own code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.checkpoint.gguf_file import GGUFTensor

_Blocks = np.ndarray[Any, np.dtype[np.uint8]]  # one quantized block a row
_Floats = np.ndarray[Any, np.dtype[np.float32]]


def dequantize(tensor: GGUFTensor) -> _Floats:
    """The tensor as float32 in its own shape; F32 comes back as a read-only view of the file."""
    whole_tensor = _WHOLE_TENSOR.get(tensor.type)
    if whole_tensor is None:
        # gguf wants the quantized bytes in rows, a row's blocks in the last dimension.
        rows = tensor.data.reshape(*tensor.shape[:-1], -1)
        array = gguf_dequantize(rows, tensor.type).astype(np.float32, copy=False)
    else:
        array = whole_tensor(tensor.data.reshape(-1, GGML_QUANT_SIZES[tensor.type][1]))
    return array.reshape(tensor.shape)


def _scales(blocks: _Blocks, start: int) -> _Floats:
    """The float16 at byte `start` of every block, as a float32 column to scale its row by."""
    # Every block type here is an even number of bytes, so the rows view as float16s as they are.
    column = start // 2
    return blocks.view(np.float16)[:, column : column + 1].astype(np.float32)


def _nibbles(quants: _Blocks) -> _Floats:
    """A 4-bit block's values as float32: byte i holds value i in its low nibble and value
    i + block_size / 2 in its high one."""
    values = np.empty((quants.shape[0], 2, quants.shape[1]), np.float32)
    np.bitwise_and(quants, 0x0F, out=values[:, 0], casting="unsafe")
    np.right_shift(quants, 4, out=values[:, 1], casting="unsafe")
    return values.reshape(quants.shape[0], -1)


def _q4_0(blocks: _Blocks) -> _Floats:
    # Block: float16 scale d, then 16 bytes of 4-bit values q; x = d * (q - 8).
    values = _nibbles(blocks[:, 2:])
    values -= 8  # exact in float32, as gguf's int8 subtraction is
    values *= _scales(blocks, 0)
    return values


def _q4_1(blocks: _Blocks) -> _Floats:
    # Block: float16 scale d, float16 minimum m, then 16 bytes of 4-bit values q; x = d * q + m.
    values = _nibbles(blocks[:, 4:])
    values *= _scales(blocks, 0)
    values += _scales(blocks, 2)  # a separate rounding after the product, as in gguf: no FMA
    return values


def _q8_0(blocks: _Blocks) -> _Floats:
    # Block: float16 scale d, then 32 signed bytes q; x = q * d.
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    values *= _scales(blocks, 0)
    return values


_WHOLE_TENSOR: dict[GGMLQuantizationType, Callable[[_Blocks], _Floats]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q8_0: _q8_0,
}
