"""Qwen2 and Qwen2.5: Llama with biases on the Q, K and V projections."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import MAX_LAYERS, ConfigValues
from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import GGUF_LLAMA_NORMS, GGUF_PROJECTIONS, GGUFLayout, ModelFamily
from engine.models.layers import Attention


class BiasedQKVAttention(Attention):
    qkv_bias = True


class Qwen2ForCausalLM(CausalLM):
    """Llama with Q, K and V biases; configs that enable ``use_sliding_window`` slide it over
    the layers from ``max_window_layers`` on."""

    attention_class = BiasedQKVAttention


def qwen_sliding_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    # Qwen configs name a window that applies only with use_sliding_window, and then (unless
    # layer_types says otherwise) to the layers from max_window_layers on.
    values = ConfigValues(config, path)
    if not values.flag("use_sliding_window", False):
        return {}
    window = values.optional_size("sliding_window")
    if window is None:
        return {}
    layer_types = config.get("layer_types")
    if not layer_types:
        first_sliding = values.size("max_window_layers", MAX_LAYERS, at_least=0)
        layer_types = [
            SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION
            for i in range(values.size("num_hidden_layers", MAX_LAYERS))
        ]
    return {"sliding_window": window, "layer_types": layer_types}


def _qwen2_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    return ModelConfig(**hf_config_fields(config, path), **qwen_sliding_fields(config, path))


QWEN2 = ModelFamily(
    Qwen2ForCausalLM,
    _qwen2_config,
    GGUFLayout(
        "qwen2",
        GGUF_PROJECTIONS | GGUF_LLAMA_NORMS,
        biased_modules=("attn_q", "attn_k", "attn_v"),
    ),
)
