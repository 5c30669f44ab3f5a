"""Read a GGUF file's metadata and tensor index, leaving the tensor data memory-mapped.

`gguf.GGUFReader` makes a numpy view of every element of every metadata array, which takes
seconds for a 49k-token vocabulary and its merges. This walks the same bytes with `struct` over a
memory map instead, in tens of milliseconds; the `gguf` package still supplies the constants and
the dequantization.

The layout (ggml's docs/gguf.md), all little-endian: magic "GGUF", u32 version, u64 tensor count,
u64 key/value count, the key/values, the tensor infos, padding up to `general.alignment`, then the
tensor data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
# Version 1 had 32-bit counts and lengths; llama.cpp has not written it since 2023.
_SUPPORTED_VERSIONS = (2, 3)

# Arrays of arrays are allowed; real files nest one level at most.
_MAX_ARRAY_DEPTH = 16

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Each scalar type: how one reads alone (struct) and how an array of them reads (numpy).
_SCALAR_TYPES = [
    (GGUFValueType.UINT8, "<B", "<u1"),
    (GGUFValueType.INT8, "<b", "<i1"),
    (GGUFValueType.UINT16, "<H", "<u2"),
    (GGUFValueType.INT16, "<h", "<i2"),
    (GGUFValueType.UINT32, "<I", "<u4"),
    (GGUFValueType.INT32, "<i", "<i4"),
    (GGUFValueType.FLOAT32, "<f", "<f4"),
    (GGUFValueType.BOOL, "<?", "?"),
    (GGUFValueType.UINT64, "<Q", "<u8"),
    (GGUFValueType.INT64, "<q", "<i8"),
    (GGUFValueType.FLOAT64, "<d", "<f8"),
]
_SCALAR_FORMS = {value_type: struct.Struct(form) for value_type, form, _ in _SCALAR_TYPES}
_ARRAY_DTYPES = {value_type: np.dtype(dtype) for value_type, _, dtype in _SCALAR_TYPES}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    # Outermost dimension first, as numpy and torch have it: GGUF lists dimensions innermost first.
    shape: tuple[int, ...]
    # The tensor's bytes as stored, quantized blocks included: a read-only view of the memory map.
    data: np.ndarray[Any, np.dtype[np.uint8]]


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]  # in file order
    alignment: int
    data_offset: int  # where the tensor data starts in the file


def read_gguf(path: Path) -> GGUFFile:
    """Parse `path`'s header, metadata and tensor infos; tensor data stays on disk until read."""
    with path.open("rb") as file:
        if path.stat().st_size < len(_MAGIC):
            raise ValueError(f"{path}: not a GGUF file (too short)")
        # The map outlives the file handle, and each tensor's view keeps it open.
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if buffer[: len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    try:
        return _Parser(buffer, path).file()
    except struct.error as error:
        raise ValueError(f"{path}: truncated GGUF file") from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: a GGUF string is not UTF-8: {error}") from error


class _Parser:
    """Reads values in order from `position` on; each read moves past what it read."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.position = len(_MAGIC)

    def file(self) -> GGUFFile:
        version = self.scalar(_U32)
        if version not in _SUPPORTED_VERSIONS:
            # A big-endian file's small version number reads as a multiple of 65536 here.
            detail = "is big-endian" if (version & 0xFFFF) == 0 else f"has version {version}"
            raise ValueError(
                f"{self.path}: GGUF file {detail}; only little-endian versions 2 and 3 are read"
            )
        tensor_count = self.scalar(_U64)
        metadata_count = self.scalar(_U64)
        metadata: dict[str, Any] = {}
        for _ in range(metadata_count):
            key = self.string()
            if key in metadata:
                raise ValueError(f"{self.path}: metadata key {key!r} appears twice")
            metadata[key] = self.value(self.scalar(_U32))
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = self.alignment(metadata)
        data_offset = -(-self.position // alignment) * alignment  # round up
        tensors: dict[str, GGUFTensor] = {}
        for name, shape, tensor_type, offset in infos:
            if name in tensors:
                raise ValueError(f"{self.path}: tensor {name!r} appears twice")
            tensors[name] = self.tensor(name, shape, tensor_type, data_offset + offset)
        return GGUFFile(version, metadata, tensors, alignment, data_offset)

    def scalar(self, form: struct.Struct) -> Any:
        (value,) = form.unpack_from(self.buffer, self.position)
        self.position += form.size
        return value

    def string(self) -> str:
        length = self.scalar(_U64)
        start = self.position
        self.position += length
        if self.position > len(self.buffer):  # a slice past the end would just come back short
            raise ValueError(f"{self.path}: truncated GGUF file")
        return self.buffer[start : self.position].decode()

    def value(self, raw_type: int) -> Any:
        value_type = self.value_type(raw_type)
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALAR_FORMS[value_type])

    def value_type(self, raw_type: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: unknown GGUF value type {raw_type}") from None

    def array(self, depth: int = 1) -> list[Any]:
        item_type = self.value_type(self.scalar(_U32))
        count = self.scalar(_U64)
        if item_type == GGUFValueType.STRING:
            return self.strings(count)
        if item_type == GGUFValueType.ARRAY:
            # Each level costs a hostile file 12 bytes and the reader a Python stack frame.
            if depth >= _MAX_ARRAY_DEPTH:
                raise ValueError(
                    f"{self.path}: GGUF arrays nested more than {_MAX_ARRAY_DEPTH} deep"
                )
            return [self.array(depth + 1) for _ in range(count)]
        dtype = _ARRAY_DTYPES[item_type]
        end = self.position + count * dtype.itemsize
        if end > len(self.buffer):
            raise ValueError(f"{self.path}: truncated GGUF file")
        items = np.frombuffer(self.buffer, dtype, count, self.position)
        self.position = end
        return items.tolist()

    def strings(self, count: int) -> list[str]:
        """A vocabulary is tens of thousands of strings: one tight loop with everything local."""
        buffer, position, unpack_length = self.buffer, self.position, _U64.unpack_from
        size = len(buffer)
        strings: list[str] = []
        append = strings.append
        for _ in range(count):
            (length,) = unpack_length(buffer, position)
            start = position + 8
            position = start + length
            if position > size:  # the slice would come back short instead of failing
                raise ValueError(f"{self.path}: truncated GGUF file")
            append(buffer[start:position].decode())
        self.position = position
        return strings

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = self.scalar(_U32)
        gguf_shape = struct.unpack_from(f"<{dims}Q", self.buffer, self.position)
        self.position += 8 * dims
        tensor_type = self.scalar(_U32)
        offset = self.scalar(_U64)
        return name, tuple(reversed(gguf_shape)), tensor_type, offset

    def alignment(self, metadata: dict[str, Any]) -> int:
        alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        # The type is checked too: a bool or float here means a broken writer.
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is no power of two")
        return alignment

    def tensor(self, name: str, shape: tuple[int, ...], raw_type: int, start: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        elements = math.prod(shape)
        if shape and shape[-1] % block_size:
            raise ValueError(
                f"{self.path}: tensor {name!r} rows of {shape[-1]} are not whole "
                f"{tensor_type.name} blocks of {block_size}"
            )
        size = elements // block_size * type_size
        if start + size > len(self.buffer):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self.buffer, np.uint8, size, start)
        return GGUFTensor(name, tensor_type, shape, data)
