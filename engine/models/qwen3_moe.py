"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, a mixture of experts in
place of the MLP (128 experts, 8 a token, their weights renormalized)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.gguf_checkpoint import GGUFMetadata
from engine.checkpoint.hf_checkpoint import hf_config_fields
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
    step = config.get("decoder_sparse_step", 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    return MoEConfig(
        **hf_config_fields(config, path),
        **qwen_sliding_fields(config),
        # transformers 5 saves num_experts under Mixtral's name
        num_experts=config.get("num_experts", config.get("num_local_experts")),
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False),  # transformers' default
        dense_layers=tuple(
            layer
            for layer in range(config["num_hidden_layers"])
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
