"""Read a llama.cpp GGUF file as a Hugging Face Llama checkpoint."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint.checkpoint import Checkpoint, WeightStream
from engine.checkpoint.gguf_dequantize import dequantize
from engine.checkpoint.gguf_file import GGUFTensor, read_gguf
from engine.checkpoint.gguf_tokenizer import gguf_tokenizer_info
from engine.model_config import ModelConfig, RopeScaling

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<module>\w+)\.(?P<kind>weight|bias)")
_TOP_LEVEL_TENSOR = re.compile(r"(?P<module>\w+)\.(?P<kind>weight|bias)")

# llama.cpp writes Llama 3's RoPE scaling as this tensor of per-frequency divisors, not as
# parameters. It feeds the config, and is no model weight.
_ROPE_FREQS = "rope_freqs.weight"

# Every Llama 3.x release scales RoPE with these and varies only the factor. The divisors in a
# file are checked against them, so another scaling fails loudly instead of decoding badly.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def load_gguf(path: Path, name: str | None = None) -> Checkpoint:
    """A Checkpoint over a GGUF file; `name` overrides the file's own `general.name`."""
    gguf_file = read_gguf(path)
    metadata, tensors = gguf_file.metadata, gguf_file.tensors
    config = gguf_model_config(metadata, tensors, path)
    for tensor_name in tensors:
        if tensor_name != _ROPE_FREQS:
            hf_tensor_name(tensor_name)  # fail on an unknown tensor now, not mid-load
    return Checkpoint(
        name=name or metadata.get("general.name") or path.stem,
        config=config,
        tokenizer=gguf_tokenizer_info(metadata),
        # The tensors are views of a memory map: holding them keeps no tensor in memory.
        weight_source=lambda: _gguf_weights(tensors.values(), config),
    )


def gguf_model_config(
    metadata: Mapping[str, Any], tensors: Mapping[str, GGUFTensor], path: Path
) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported, only 'llama'")

    def key(suffix: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{suffix}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length") or hidden_size // num_heads
    rope_theta = float(key("rope.freq_base", 10000.0))
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=len(metadata["tokenizer.ggml.tokens"]),
        hidden_size=hidden_size,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=key("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=key("context_length"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(metadata, arch, tensors, rope_theta, head_dim, path),
        tie_word_embeddings="output.weight" not in tensors,
    )


def _rope_scaling(
    metadata: Mapping[str, Any],
    arch: str,
    tensors: Mapping[str, GGUFTensor],
    rope_theta: float,
    head_dim: int,
    path: Path,
) -> RopeScaling | None:
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise ValueError(
            f"{path}: RoPE scaling {scaling_type!r} is not supported, only Llama 3's "
            f"(which llama.cpp stores as a {_ROPE_FREQS} tensor)"
        )
    if _ROPE_FREQS not in tensors:
        return None
    divisors = dequantize(tensors[_ROPE_FREQS])
    scaling = RopeScaling(
        factor=float(divisors.max()),
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )
    if not np.allclose(divisors, llama3_rope_divisors(scaling, rope_theta, head_dim), rtol=1e-4):
        raise ValueError(
            f"{path}: its {_ROPE_FREQS} tensor is not Llama 3's RoPE scaling with factor "
            f"{scaling.factor}; other RoPE scalings are not supported"
        )
    return scaling


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


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    block = _BLOCK_TENSOR.fullmatch(gguf_name)
    if block and block["module"] in _BLOCK_NAMES:
        return f"model.layers.{block['layer']}.{_BLOCK_NAMES[block['module']]}.{block['kind']}"
    top = _TOP_LEVEL_TENSOR.fullmatch(gguf_name)
    if top and top["module"] in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[top['module']]}.{top['kind']}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def _gguf_weights(tensors: Iterable[GGUFTensor], config: ModelConfig) -> WeightStream:
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        array = dequantize(tensor)
        # llama.cpp permutes Q and K rows for its interleaved RoPE; Hugging Face's rotate-half
        # RoPE needs the original order back.
        if ".attn_q." in tensor.name:
            array = _unpermute_rope_rows(array, config.num_attention_heads)
        elif ".attn_k." in tensor.name:
            array = _unpermute_rope_rows(array, config.num_key_value_heads)
        # np.require copies only what is read-only (undequantized float32 still points into the
        # memory-mapped file) or not contiguous (the unpermuted rows).
        yield hf_tensor_name(tensor.name), torch.from_numpy(np.require(array, requirements="CW"))


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo `permute` in llama.cpp's convert_hf_to_gguf.py, which interleaves head halves."""
    half_head_dim = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)
