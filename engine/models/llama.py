"""Llama and Mistral: the plain decoder that the other families vary."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import CONFIG_JSON, MAX_LAYERS, ConfigValues
from engine.model_config import SLIDING_ATTENTION, ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import GGUF_LLAMA_NORMS, GGUF_PROJECTIONS, GGUFLayout, ModelFamily


class LlamaForCausalLM(CausalLM):
    """RMSNorm, RoPE (plain, Llama 3 or linear scaled), grouped-query attention, SiLU MLP:
    ``CausalLM`` as it is."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers and weight names; Mistral 7B v0.1 slides a window over every layer."""


def refuse_biases(config: Mapping[str, Any], path: Path) -> None:
    # Llama's attention_bias also puts a bias on o_proj, which no model here has.
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{path / CONFIG_JSON}: attention_bias and mlp_bias are not supported")


def llama_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    """A config.json of Llama's fields and no more."""
    refuse_biases(config, path)
    return ModelConfig(**hf_config_fields(config, path))


def mistral_sliding_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    # Mistral 7B v0.1 slides a window over every layer; later versions set it to null.
    values = ConfigValues(config, path)
    window = values.optional_size("sliding_window")
    if window is None:
        return {}
    return {
        "sliding_window": window,
        "layer_types": [SLIDING_ATTENTION] * values.size("num_hidden_layers", MAX_LAYERS),
    }


def _mistral_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    return ModelConfig(**hf_config_fields(config, path), **mistral_sliding_fields(config, path))


def unpermute_qk(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undo `permute` in llama.cpp's convert_hf_to_gguf.py, which interleaves the halves of each
    head's Q and K rows for llama.cpp's RoPE; Hugging Face's rotate-half RoPE needs them back.
    Head by head, so a tensor-parallel rank's heads are restored alone."""
    if ".attn_q." not in name and ".attn_k." not in name:
        return array
    rows = array.reshape(-1, config.head_dim // 2, 2, *array.shape[1:])
    return rows.swapaxes(1, 2).reshape(array.shape)


LLAMA = ModelFamily(
    LlamaForCausalLM,
    llama_config,
    # llama.cpp writes Mistral as "llama" too: such a file loads as Llama.
    GGUFLayout("llama", GGUF_PROJECTIONS | GGUF_LLAMA_NORMS, restore=unpermute_qk),
)
MISTRAL = ModelFamily(MistralForCausalLM, _mistral_config)
