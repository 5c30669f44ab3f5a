"""Qwen3 (dense): Llama with an RMSNorm over each head of Q and K."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import (
    GGUF_LLAMA_NORMS,
    GGUF_PROJECTIONS,
    GGUF_QK_NORMS,
    GGUFLayout,
    ModelFamily,
)
from engine.models.layers import QKNormAttention
from engine.models.llama import refuse_biases
from engine.models.qwen2 import qwen_sliding_fields


class Qwen3ForCausalLM(CausalLM):
    """Llama with per-head Q/K norms before RoPE, no biases, and a head_dim that need not be
    hidden_size / heads."""

    attention_class = QKNormAttention


def _qwen3_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    refuse_biases(config, path)
    return ModelConfig(**hf_config_fields(config, path), **qwen_sliding_fields(config, path))


QWEN3 = ModelFamily(
    Qwen3ForCausalLM,
    _qwen3_config,
    GGUFLayout("qwen3", GGUF_PROJECTIONS | GGUF_LLAMA_NORMS | GGUF_QK_NORMS),
)
