"""Read a llama.cpp GGUF file as the Hugging Face checkpoint it was converted from.

llama.cpp's convert_hf_to_gguf.py renames every tensor, moves the config into metadata and changes a
few tensors on the way; this undoes that per architecture, so a GGUF gives the ModelConfig and the
weight names and values that a Hugging Face directory of the same model gives (and that
transformers' own GGUF loading gives: the tests check against it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint.checkpoint import Checkpoint, WeightStream
from engine.checkpoint.gguf_dequantize import dequantize
from engine.checkpoint.gguf_file import GGUFTensor, read_gguf
from engine.checkpoint.gguf_tokenizer import gguf_tokenizer_info
from engine.model_config import ModelConfig, RopeScaling
from engine.models.layers import FULL_ATTENTION, SLIDING_ATTENTION

# llama.cpp writes Llama 3's RoPE scaling as this tensor of per-frequency divisors, not as
# parameters. It feeds the config, and is no model weight.
_ROPE_FREQS = "rope_freqs.weight"

# Every Llama 3.x release scales RoPE with these and varies only the factor. The divisors in a
# file are checked against them, so another scaling fails loudly instead of decoding badly.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192

# Gemma 3 facts that llama.cpp hard-codes for the architecture instead of writing them to the
# file (llama-model.cpp), as transformers' Gemma3TextConfig defaults them too: every 6th layer
# attends globally, and sliding layers use RoPE base 10000.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
# llama.cpp scales Gemma 3's attention by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for
# the 27B model, which it knows by its layer count; the configs of the Hugging Face releases agree.
_GEMMA3_27B_LAYERS = 62

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BIASED_MODULES = ("attn_q", "attn_k", "attn_v")  # with attention_bias (Qwen2)


class _Metadata:
    """One architecture's `{arch}.*` metadata keys, failing on a missing one by its name."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: Path) -> None:
        self.metadata, self.arch, self.path = metadata, arch, path

    def required(self, suffix: str) -> Any:
        key = f"{self.arch}.{suffix}"
        if key not in self.metadata:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} is missing")
        return self.metadata[key]

    def optional(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)


def _decimal(value: float) -> float:
    """The value config.json had, from the float32 that llama.cpp wrote of it.

    1e-6 comes back from float32 as 9.99999997e-07; the shortest decimal that rounds to the same
    float32 is the one that was written, so configs from either format compare equal.
    """
    return float(str(np.float32(value)))


def _no_fields(keys: _Metadata, common: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _gemma3_fields(keys: _Metadata, common: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = common["num_hidden_layers"]
    softcap = keys.optional("final_logit_softcapping")
    query_pre_attn_scalar = (
        common["hidden_size"] / common["num_attention_heads"]
        if num_layers == _GEMMA3_27B_LAYERS
        else common["head_dim"]
    )
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "gemma_norms_and_scaling": True,
        "layer_types": [
            FULL_ATTENTION
            if (layer + 1) % _GEMMA3_SLIDING_WINDOW_PATTERN == 0
            else SLIDING_ATTENTION
            for layer in range(num_layers)
        ],
        "sliding_window": keys.required("attention.sliding_window"),
        "rope_local_theta": _decimal(keys.optional("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)),
        "query_pre_attn_scalar": float(query_pre_attn_scalar),
        "final_logit_softcapping": None if softcap is None else _decimal(softcap),
    }


@dataclass(frozen=True)
class _Family:
    """How llama.cpp stores one architecture, and what undoes it."""

    architecture: str  # the Hugging Face class, as config.json names it
    block_names: Mapping[str, str]  # GGUF module in a block -> Hugging Face module in a layer
    # llama.cpp permutes Q and K rows for its interleaved RoPE in "llama" files only.
    permuted_qk: bool = False
    # Gemma's RMSNorm multiplies by (1 + weight); llama.cpp stores the sum.
    norms_plus_one: bool = False
    attention_bias: bool = False
    # The config fields beyond Llama's, from the metadata and the fields read so far.
    fields: Callable[[_Metadata, Mapping[str, Any]], dict[str, Any]] = _no_fields


_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", _LLAMA_BLOCK_NAMES, permuted_qk=True),
    "qwen2": _Family("Qwen2ForCausalLM", _LLAMA_BLOCK_NAMES, attention_bias=True),
    "qwen3": _Family("Qwen3ForCausalLM", _LLAMA_BLOCK_NAMES | _QK_NORM_NAMES),
    "gemma3": _Family(
        "Gemma3ForCausalLM",
        _LLAMA_BLOCK_NAMES
        | _QK_NORM_NAMES
        | {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",  # Llama's post_attention_layernorm
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norms_plus_one=True,
        fields=_gemma3_fields,
    ),
}


def load_gguf(path: Path, name: str | None = None) -> Checkpoint:
    """A Checkpoint over a GGUF file; `name` overrides the file's own `general.name`."""
    gguf_file = read_gguf(path)
    metadata, tensors = gguf_file.metadata, gguf_file.tensors
    family = _family(metadata, path)
    config = gguf_model_config(metadata, tensors, path)
    names = hf_tensor_names(family, config)
    _check_tensors(set(tensors) - {_ROPE_FREQS}, names, path)  # now, not mid-load
    return Checkpoint(
        name=name or metadata.get("general.name") or path.stem,
        config=config,
        tokenizer=gguf_tokenizer_info(metadata),
        # The tensors are views of a memory map: holding them keeps no tensor in memory.
        weight_source=lambda: _gguf_weights(tensors.values(), names, family, config),
        tensor_count=len(names),
    )


def _family(metadata: Mapping[str, Any], path: Path) -> _Family:
    arch = metadata.get("general.architecture")
    if arch not in _FAMILIES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported, only {', '.join(_FAMILIES)}"
        )
    return _FAMILIES[arch]


def gguf_model_config(
    metadata: Mapping[str, Any], tensors: Mapping[str, GGUFTensor], path: Path
) -> ModelConfig:
    """The config a Hugging Face directory of the model has, from llama.cpp's metadata keys."""
    family = _family(metadata, path)
    keys = _Metadata(metadata, metadata["general.architecture"], path)
    hidden_size = keys.required("embedding_length")
    num_heads = keys.required("attention.head_count")
    head_dim = keys.optional("attention.key_length") or hidden_size // num_heads
    rope_theta = _decimal(keys.optional("rope.freq_base", 10000.0))
    common: dict[str, Any] = {
        "architecture": family.architecture,
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": hidden_size,
        "intermediate_size": keys.required("feed_forward_length"),
        "num_hidden_layers": keys.required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": keys.optional("attention.head_count_kv") or num_heads,
        "head_dim": head_dim,
        "max_position_embeddings": keys.required("context_length"),
        "rms_norm_eps": _decimal(keys.required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        # llama.cpp leaves the output projection out when it is the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": family.attention_bias,
        "qk_norm": "attn_q_norm" in family.block_names,
        **_rope_scaling(keys, tensors, rope_theta, head_dim),
    }
    return ModelConfig(**common, **family.fields(keys, common))


def _rope_scaling(
    keys: _Metadata, tensors: Mapping[str, GGUFTensor], rope_theta: float, head_dim: int
) -> dict[str, Any]:
    """The config fields of the file's RoPE scaling: none, linear, or Llama 3's."""
    scaling_type = keys.optional("rope.scaling.type", "none")
    if scaling_type == "linear":
        return {"rope_linear_factor": _decimal(keys.required("rope.scaling.factor"))}
    if scaling_type != "none":
        raise ValueError(
            f"{keys.path}: RoPE scaling {scaling_type!r} is not supported, only 'linear' and "
            f"Llama 3's (which llama.cpp stores as a {_ROPE_FREQS} tensor)"
        )
    if _ROPE_FREQS not in tensors:
        return {}
    divisors = dequantize(tensors[_ROPE_FREQS])
    scaling = RopeScaling(
        factor=float(divisors.max()),
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )
    if not np.allclose(divisors, llama3_rope_divisors(scaling, rope_theta, head_dim), rtol=1e-4):
        raise ValueError(
            f"{keys.path}: its {_ROPE_FREQS} tensor is not Llama 3's RoPE scaling with factor "
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


def hf_tensor_names(family: _Family, config: ModelConfig) -> dict[str, str]:
    """Every tensor the file must hold, GGUF name -> Hugging Face name, e.g.
    blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    names = {
        f"{module}.weight": f"{hf_module}.weight"
        for module, hf_module in _TOP_LEVEL_NAMES.items()
        if not (module == "output" and config.tie_word_embeddings)
    }
    for layer in range(config.num_hidden_layers):
        for module, hf_module in family.block_names.items():
            biased = family.attention_bias and module in _BIASED_MODULES
            for kind in ("weight", "bias") if biased else ("weight",):
                names[f"blk.{layer}.{module}.{kind}"] = f"model.layers.{layer}.{hf_module}.{kind}"
    return names


def _check_tensors(present: set[str], expected: Mapping[str, str], path: Path) -> None:
    for problem, tensors in (
        ("lacks tensors", sorted(expected.keys() - present)),
        ("has tensors with no Hugging Face counterpart", sorted(present - expected.keys())),
    ):
        if tensors:
            shown = ", ".join(tensors[:5]) + (
                f" and {len(tensors) - 5} more" if tensors[5:] else ""
            )
            raise ValueError(f"{path}: the GGUF file {problem}: {shown}")


def _gguf_weights(
    tensors: Iterable[GGUFTensor], names: Mapping[str, str], family: _Family, config: ModelConfig
) -> WeightStream:
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        array = dequantize(tensor)
        # llama.cpp permutes Q and K rows for its interleaved RoPE; Hugging Face's rotate-half
        # RoPE needs the original order back.
        if family.permuted_qk and ".attn_q." in tensor.name:
            array = _unpermute_rope_rows(array, config.num_attention_heads)
        elif family.permuted_qk and ".attn_k." in tensor.name:
            array = _unpermute_rope_rows(array, config.num_key_value_heads)
        elif family.norms_plus_one and tensor.name.endswith("norm.weight"):
            array = array - np.float32(1)
        # np.require copies only what is read-only (undequantized float32 still points into the
        # memory-mapped file) or not contiguous (the unpermuted rows).
        yield names[tensor.name], torch.from_numpy(np.require(array, requirements="CW"))


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo `permute` in llama.cpp's convert_hf_to_gguf.py, which interleaves head halves."""
    half_head_dim = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
