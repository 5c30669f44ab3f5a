"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, a mixture of experts in
place of the MLP (128 experts, 8 a token, their weights renormalized)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.gguf_checkpoint import GGUFMetadata
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import MAX_LAYERS, ConfigValues, expert_counts
from engine.models.family import (
    GGUF_ATTENTION,
    GGUF_EXPERTS,
    GGUF_LLAMA_NORMS,
    GGUF_QK_NORMS,
    GGUFLayout,
    ModelFamily,
)
from engine.models.layers import QKNormAttention
from engine.models.llama import refuse_biases
from engine.models.moe import MoECausalLM, MoEConfig
from engine.models.qwen2 import qwen_sliding_fields


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3's per-head Q/K norms; experts on every layer but those config.json leaves
    dense (``mlp_only_layers``, and those off ``decoder_sparse_step``)."""

    attention_class = QKNormAttention


def _qwen3_moe_config(config: Mapping[str, Any], path: Path) -> MoEConfig:
    refuse_biases(config, path)
    fields = hf_config_fields(config, path)
    values = ConfigValues(config, path)
    step = values.optional_size("decoder_sparse_step", 1, MAX_LAYERS)
    mlp_only = set(values.sizes("mlp_only_layers", MAX_LAYERS))
    # transformers 5 saves num_experts under Mixtral's name; a config of neither is refused
    # naming Qwen's own.
    experts_key = (
        "num_local_experts"
        if config.get("num_experts") is None and "num_local_experts" in config
        else "num_experts"
    )
    num_experts, experts_per_token = expert_counts(values, experts_key)
    return MoEConfig(
        **fields,
        **qwen_sliding_fields(config, path),
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=values.size("moe_intermediate_size"),
        norm_topk_prob=values.flag("norm_topk_prob", False),  # transformers' default
        dense_layers=tuple(
            layer
            for layer in range(fields["num_hidden_layers"])
            if layer in mlp_only or (layer + 1) % step
        ),
    )


def _qwen3_moe_gguf_config(keys: GGUFMetadata, common: dict[str, Any]) -> MoEConfig:
    # llama.cpp's qwen3moe renormalizes the top-k weights whatever the file says, and gives
    # every layer experts (as the released models have them).
    return MoEConfig(
        **common,
        num_experts=keys.required("expert_count"),
        num_experts_per_tok=keys.required("expert_used_count"),
        moe_intermediate_size=keys.required("expert_feed_forward_length"),
        norm_topk_prob=True,
    )


QWEN3_MOE = ModelFamily(
    Qwen3MoeForCausalLM,
    _qwen3_moe_config,
    GGUFLayout(
        "qwen3moe",
        GGUF_ATTENTION | GGUF_LLAMA_NORMS | GGUF_QK_NORMS | GGUF_EXPERTS,
        read_config=_qwen3_moe_gguf_config,
        experts=True,
    ),
)
