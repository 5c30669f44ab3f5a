"""Read a llama.cpp GGUF file in the terms of the Hugging Face checkpoint it was converted from.

llama.cpp's convert_hf_to_gguf.py renames every tensor, moves the config into metadata and changes a
few tensors on the way. What all architectures share is undone here: the config fields every one of
them has, the names of the tensors outside the blocks, Llama 3's RoPE scaling tensor. The family
(``engine.models``) does the rest: it names its block tensors, undoes what the converter did to its
own tensors and reads its own metadata keys. A GGUF then gives the ModelConfig and the weight names
and values that a Hugging Face directory of the same model gives (and that transformers' own GGUF
loading gives: the tests check against it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint.checkpoint import SliceStream
from engine.checkpoint.gguf_dequantize import can_dequantize, dequantize
from engine.checkpoint.gguf_file import GGUFTensor, read_gguf
from engine.checkpoint.gguf_tokenizer import gguf_tokenizer_info
from engine.model_config import RopeScaling, TokenizerInfo

# llama.cpp writes Llama 3's RoPE scaling as this tensor of per-frequency divisors, not as
# parameters. It feeds the config, and is no model weight.
ROPE_FREQS = "rope_freqs.weight"

# Every Llama 3.x release scales RoPE with these and varies only the factor. The divisors in a
# file are checked against them, so another scaling fails loudly instead of decoding badly.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192

# The special tokens the tokenizer is built with, by id.
_SPECIAL_TOKEN_IDS = [f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos")]

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFMetadata:
    """A GGUF file's metadata; its architecture's ``{arch}.*`` keys fail by name when missing."""

    def __init__(self, metadata: Mapping[str, Any], path: Path) -> None:
        self.metadata, self.path = metadata, path
        self.arch: str | None = metadata.get("general.architecture")

    def required(self, suffix: str) -> Any:
        key = f"{self.arch}.{suffix}"
        if key not in self.metadata:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return self.metadata[key]

    def optional(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    def size(self, suffix: str, required: bool = True) -> Any:
        """A count or length: a positive integer (None when optional and missing or 0)."""
        value = self.required(suffix) if required else self.optional(suffix)
        if not required and not value:
            return None
        if type(value) is not int or value <= 0:
            key = f"{self.arch}.{suffix}"
            raise ValueError(
                f"{self.path}: GGUF metadata {key!r} is {value!r}, not a positive integer"
            )
        return value


def decimal(value: float) -> float:
    """The value config.json had, from the float32 that llama.cpp wrote of it.

    1e-6 comes back from float32 as 9.99999997e-07; the shortest decimal that rounds to the same
    float32 is the one that was written, so configs from either format compare equal.
    """
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class GGUFModelFile:
    """A GGUF file's metadata and tensor index; the tensor data stays on disk."""

    name: str  # the model name shown to users
    path: Path
    metadata: GGUFMetadata = field(repr=False)
    # Views of a memory map, in file order: holding them keeps no tensor in memory.
    tensors: Mapping[str, GGUFTensor] = field(repr=False)

    def tokenizer(self) -> TokenizerInfo:
        """The tokenizer and chat template, rebuilt from the metadata."""
        metadata = self.metadata.metadata
        vocab_size = len(metadata.get("tokenizer.ggml.tokens") or ())
        for key in _SPECIAL_TOKEN_IDS:
            token_id = metadata.get(key)
            if token_id is not None and (
                type(token_id) is not int or not 0 <= token_id < vocab_size
            ):
                raise ValueError(
                    f"{self.path}: GGUF metadata {key!r} is {token_id!r}, not a token id of the "
                    f"{vocab_size}-token vocabulary"
                )
        return gguf_tokenizer_info(metadata)


def read_gguf_model(path: Path, name: str | None = None) -> GGUFModelFile:
    """``path`` read; ``name`` overrides the file's own ``general.name``."""
    gguf_file = read_gguf(path)
    metadata = gguf_file.metadata
    return GGUFModelFile(
        name=name or metadata.get("general.name") or path.stem,
        path=path,
        metadata=GGUFMetadata(metadata, path),
        tensors=gguf_file.tensors,
    )


def gguf_config_fields(file: GGUFModelFile) -> dict[str, Any]:
    """The ``ModelConfig`` fields every architecture's metadata holds, as config.json has them."""
    keys, tensors = file.metadata, file.tensors
    hidden_size = keys.size("embedding_length")
    num_heads = keys.size("attention.head_count")
    head_dim = keys.size("attention.key_length", required=False) or hidden_size // num_heads
    num_layers = keys.size("block_count")
    # Every block has tensors: a larger count is a corrupt file, not one to loop over.
    if num_layers > len(tensors):
        raise ValueError(
            f"{file.path}: GGUF metadata '{keys.arch}.block_count' is {num_layers}, more than "
            f"the file's {len(tensors)} tensors"
        )
    rope_theta = decimal(keys.optional("rope.freq_base", 10000.0))
    return {
        "vocab_size": len(keys.metadata["tokenizer.ggml.tokens"]),
        "hidden_size": hidden_size,
        "intermediate_size": keys.size("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": keys.size("attention.head_count_kv", required=False) or num_heads,
        "head_dim": head_dim,
        "max_position_embeddings": keys.size("context_length"),
        "rms_norm_eps": decimal(keys.required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        # llama.cpp leaves the output projection out when it is the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        **_rope_scaling(keys, tensors, rope_theta, head_dim),
    }


def _rope_scaling(
    keys: GGUFMetadata, tensors: Mapping[str, GGUFTensor], rope_theta: float, head_dim: int
) -> dict[str, Any]:
    """The config fields of the file's RoPE scaling: none, linear, or Llama 3's."""
    scaling_type = keys.optional("rope.scaling.type", "none")
    if scaling_type == "linear":
        return {"rope_linear_factor": decimal(keys.required("rope.scaling.factor"))}
    if scaling_type != "none":
        raise ValueError(
            f"{keys.path}: RoPE scaling {scaling_type!r} is not supported, only 'linear' and "
            f"Llama 3's (which llama.cpp stores as a {ROPE_FREQS} tensor)"
        )
    if ROPE_FREQS not in tensors:
        return {}
    divisors = dequantize(tensors[ROPE_FREQS])
    if divisors.shape != (head_dim // 2,):
        raise ValueError(
            f"{keys.path}: its {ROPE_FREQS} tensor has shape {divisors.shape}, not one divisor "
            f"for each of the {head_dim // 2} RoPE frequencies of head size {head_dim}"
        )
    scaling = RopeScaling(
        factor=float(divisors.max()),
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )
    if not np.allclose(divisors, llama3_rope_divisors(scaling, rope_theta, head_dim), rtol=1e-4):
        raise ValueError(
            f"{keys.path}: its {ROPE_FREQS} tensor is not Llama 3's RoPE scaling with factor "
            f"{scaling.factor}; other RoPE scalings are not supported"
        )
    return {"rope_scaling": scaling}


def llama3_rope_divisors(scaling: RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter divides each RoPE frequency by for Llama 3 scaling."""
    original_context = scaling.original_max_position_embeddings
    low_freq_wavelen = original_context / scaling.low_freq_factor
    high_freq_wavelen = original_context / scaling.high_freq_factor
    divisors = []
    for index in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (index / head_dim)
        if wavelen < high_freq_wavelen:
            divisors.append(1.0)
        elif wavelen > low_freq_wavelen:
            divisors.append(scaling.factor)
        else:
            smooth = (original_context / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(divisors, dtype=np.float32)


def hf_tensor_names(
    block_names: Mapping[str, str],
    biased_modules: tuple[str, ...],
    num_layers: int,
    tie_word_embeddings: bool,
) -> dict[str, str]:
    """Every tensor the file must hold, GGUF name -> Hugging Face name, e.g.
    blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight.

    ``block_names`` maps a block's GGUF modules to a layer's Hugging Face modules;
    ``biased_modules`` (GGUF names) have a bias beside their weight.
    """
    names = {
        f"{module}.weight": f"{hf_module}.weight"
        for module, hf_module in _TOP_LEVEL_NAMES.items()
        if not (module == "output" and tie_word_embeddings)
    }
    for layer in range(num_layers):
        for module, hf_module in block_names.items():
            for kind in ("weight", "bias") if module in biased_modules else ("weight",):
                names[f"blk.{layer}.{module}.{kind}"] = f"model.layers.{layer}.{hf_module}.{kind}"
    return names


def check_tensors(file: GGUFModelFile, expected: Mapping[str, str]) -> None:
    """Fail now, not mid-load, naming the tensors missing from the file or unknown to the model."""
    present = set(file.tensors) - {ROPE_FREQS}
    for problem, tensors in (
        ("lacks tensors", sorted(expected.keys() - present)),
        ("has tensors with no Hugging Face counterpart", sorted(present - expected.keys())),
    ):
        if tensors:
            shown = ", ".join(tensors[:5]) + (
                f" and {len(tensors) - 5} more" if tensors[5:] else ""
            )
            raise ValueError(f"{file.path}: the GGUF file {problem}: {shown}")
    for tensor in file.tensors.values():
        if not can_dequantize(tensor.type):
            raise ValueError(
                f"{file.path}: tensor {tensor.name!r} is of GGML type {tensor.type.name}, "
                "which cannot be dequantized"
            )


def gguf_weights(
    file: GGUFModelFile,
    names: Mapping[str, str],
    restore: Callable[[str, np.ndarray], np.ndarray],
) -> SliceStream:
    """(Hugging Face name, tensor not read yet) of every tensor in ``names``; ``restore`` (GGUF
    name, array) undoes what the converter did to the values, of whole heads' rows at least."""
    for tensor in file.tensors.values():
        if tensor.name != ROPE_FREQS:
            yield names[tensor.name], GGUFSlices(tensor, restore)


class GGUFSlices:
    """A GGUF tensor, dequantized to float32 when read.

    Rows (dimension 0 of a matrix) are read alone: each row is whole quantization blocks
    (``read_gguf`` checks), so only the rows asked for are dequantized. Columns cut across
    blocks: the whole tensor is dequantized, then sliced."""

    def __init__(self, tensor: GGUFTensor, restore: Callable[[str, np.ndarray], np.ndarray]):
        self.tensor, self.restore = tensor, restore

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        tensor = self.tensor
        if length is not None and dim == 0 and len(tensor.shape) > 1:
            rows = tensor.data.reshape(tensor.shape[0], -1)[start : start + length].reshape(-1)
            tensor = GGUFTensor(tensor.name, tensor.type, (length, *tensor.shape[1:]), rows)
            array = dequantize(tensor)
        else:
            array = dequantize(tensor)
            if length is not None:
                array = array.take(range(start, start + length), axis=dim)
        array = self.restore(tensor.name, array)
        # np.require copies only what is read-only (undequantized float32 still points into the
        # memory-mapped file) or not contiguous (unpermuted rows, say).
        return torch.from_numpy(np.require(array, requirements="CW"))
