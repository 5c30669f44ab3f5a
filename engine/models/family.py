"""What a model family is: its model class, how its config.json reads, how llama.cpp stores it.

Each family module ends with one ``ModelFamily``, and ``engine.models`` lists them. The family
turns the files that ``engine.checkpoint`` read into a ``Checkpoint``: a ModelConfig and
Hugging Face-named weights, whichever format they came in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint import Checkpoint, GGUFModelFile, HFDirectory
from engine.checkpoint.gguf_checkpoint import (
    GGUFMetadata,
    check_tensors,
    gguf_config_fields,
    gguf_weights,
    hf_tensor_names,
)
from engine.checkpoint.hf_checkpoint import check_layer_types
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM

# llama.cpp's names for the tensors of a block (blk.N.*) that many families share, with the
# Hugging Face module (model.layers.N.*) each stands for.
GGUF_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
GGUF_PROJECTIONS = GGUF_ATTENTION | {
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A mixture of experts' router and its experts, each projection's stacked for all experts
# (named as one expert's is, without the expert's index: engine.models.moe).
GGUF_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GGUF_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _plain_gguf_config(keys: GGUFMetadata, common: dict[str, Any]) -> ModelConfig:
    """The config of an architecture whose metadata holds only the fields every one has."""
    return ModelConfig(**common)


def _as_stored(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    return array


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's converter stores a family, and what undoes it."""

    arch: str  # the file's general.architecture
    block_names: Mapping[str, str]  # GGUF module in a block -> Hugging Face module in a layer
    biased_modules: tuple[str, ...] = ()  # GGUF modules stored with a bias beside the weight
    # The config from the metadata and the fields every architecture has (``common``).
    read_config: Callable[[GGUFMetadata, dict[str, Any]], ModelConfig] = _plain_gguf_config
    # A tensor's values as Hugging Face has them, from those the converter wrote (by GGUF name).
    restore: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = _as_stored
    # Whether its blocks hold experts ({arch}.expert_count > 0): llama.cpp writes Mixtral as
    # "llama" with experts, and a file is the family's whose arch and experts it has.
    experts: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: its model, the reading of its config.json, its GGUF layout if any."""

    model: type[CausalLM]  # named as config.json's architectures[0]
    read_config: Callable[[Mapping[str, Any], Path], ModelConfig]  # config.json, its path
    gguf: GGUFLayout | None = None
    # Architectures akin to this one that are not supported, and what to say of each.
    refused: Mapping[str, str] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.model.__name__

    def config_from_hf(self, config: Mapping[str, Any], path: Path) -> ModelConfig:
        model_config = self.read_config(config, path)
        check_layer_types(model_config.layer_types, model_config.num_hidden_layers, path)
        return model_config

    def hf_checkpoint(self, directory: HFDirectory) -> Checkpoint:
        return Checkpoint(
            name=directory.name,
            config=self.config_from_hf(directory.config, directory.path),
            tokenizer=directory.tokenizer(),
            weight_source=directory.weights,
            sampling_defaults=directory.sampling_defaults(),
            pooling=directory.pooling(),
        )

    def gguf_checkpoint(self, file: GGUFModelFile) -> Checkpoint:
        layout = self.gguf
        assert layout is not None, f"{self.architecture} has no GGUF layout"
        common = {"architecture": self.architecture, **gguf_config_fields(file)}
        config = layout.read_config(file.metadata, common)
        names = hf_tensor_names(
            layout.block_names,
            layout.biased_modules,
            config.num_hidden_layers,
            config.tie_word_embeddings,
        )
        check_tensors(file, names)

        def restore(name: str, array: np.ndarray) -> np.ndarray:
            return layout.restore(name, array, config)

        return Checkpoint(
            name=file.name,
            config=config,
            tokenizer=file.tokenizer(),
            weight_source=lambda: gguf_weights(file, names, restore),
            tensor_count=len(names),
            gguf=True,
        )
