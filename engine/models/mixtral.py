"""Mixtral (Mixtral-8x7B, 8x22B): Mistral's layers with a mixture of experts in place of the
MLP (8 experts, 2 a token, their weights renormalized)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.checkpoint.gguf_checkpoint import GGUFMetadata
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import ConfigValues, expert_counts
from engine.models.family import GGUF_ATTENTION, GGUF_LLAMA_NORMS, GGUFLayout, ModelFamily
from engine.models.llama import mistral_sliding_fields, refuse_biases, unpermute_qk
from engine.models.moe import MoECausalLM, MoEConfig

_ROPE_THETA = 1_000_000.0  # transformers' default for Mixtral


class MixtralForCausalLM(MoECausalLM):
    """Llama's attention (a window over every layer, if config.json names one); experts on
    every layer, named their own way in its checkpoints."""

    checkpoint_renames: Mapping[str, str] = {
        "block_sparse_moe": "mlp",
        "w1": "gate_proj",
        "w3": "up_proj",
        "w2": "down_proj",
    }


def _mixtral_config(config: Mapping[str, Any], path: Path) -> MoEConfig:
    refuse_biases(config, path)
    fields = hf_config_fields(config, path, _ROPE_THETA)
    num_experts, experts_per_token = expert_counts(ConfigValues(config, path), "num_local_experts")
    return MoEConfig(
        **fields,
        **mistral_sliding_fields(config, path),
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=fields["intermediate_size"],  # the experts' own
        norm_topk_prob=True,
    )


def _mixtral_gguf_config(keys: GGUFMetadata, common: dict[str, Any]) -> MoEConfig:
    return MoEConfig(
        **common,
        num_experts=keys.required("expert_count"),
        num_experts_per_tok=keys.required("expert_used_count"),
        moe_intermediate_size=common["intermediate_size"],
        norm_topk_prob=True,
    )


MIXTRAL = ModelFamily(
    MixtralForCausalLM,
    _mixtral_config,
    # llama.cpp converts Mixtral as Llama (Q and K permuted), its experts stacked.
    GGUFLayout(
        "llama",
        GGUF_ATTENTION
        | GGUF_LLAMA_NORMS
        | {
            "ffn_gate_inp": "block_sparse_moe.gate",
            "ffn_gate_exps": "block_sparse_moe.experts.w1",
            "ffn_up_exps": "block_sparse_moe.experts.w3",
            "ffn_down_exps": "block_sparse_moe.experts.w2",
        },
        read_config=_mixtral_gguf_config,
        restore=unpermute_qk,
        experts=True,
    ),
)
