"""Gemma 3, text only (Gemma3ForCausalLM: the 1B model, or a text model split off a larger one).

What sets it apart from Llama: embeddings scaled by sqrt(hidden_size); RMSNorms that scale by
(1 + weight) in float32, also after each sublayer (the sandwich layer); per-head Q/K norms; a
GELU-tanh MLP; attention scale query_pre_attn_scalar ** -0.5; sliding-window layers with a RoPE
base of their own between global layers; an optional final logit soft-cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.backends.attention import AttentionBackend, AttentionMetadata
from engine.backends.deferred_norm import LinearInput
from engine.backends.layer_ops import LayerOps
from engine.checkpoint.gguf_checkpoint import GGUFMetadata, decimal
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import CONFIG_JSON, MAX_LAYERS, ConfigValues
from engine.distributed.parallel import TensorParallel
from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import GGUF_PROJECTIONS, GGUF_QK_NORMS, GGUFLayout, ModelFamily
from engine.models.layers import MLP, QKNormAttention, RotaryEmbedding, RoundOnceRMSNorm

# transformers' defaults where a config leaves them out: every 6th layer attends globally; RoPE
# bases of the global and the sliding layers.
_SLIDING_WINDOW_PATTERN = 6
_ROPE_THETA = 1_000_000.0
_LOCAL_ROPE_THETA = 10_000.0
# llama.cpp scales Gemma 3's attention by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for
# the 27B model, which it knows by its layer count; the configs of the Hugging Face releases agree.
_GEMMA3_27B_LAYERS = 62


@dataclass(kw_only=True)
class Gemma3Config(ModelConfig):
    query_pre_attn_scalar: float  # the attention scale is this ** -0.5
    final_logit_softcapping: float | None = None


class UnitOffsetRMSNorm(RoundOnceRMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), the weight starting at zero, in float32."""

    weight_offset = 1.0


class Gemma3Attention(QKNormAttention):
    """Per-head Q/K norms of Gemma's own kind (1 + weight, rounded once), which the backend
    applies with RoPE; the scale is query_pre_attn_scalar ** -0.5."""

    head_norm_class = UnitOffsetRMSNorm

    def __init__(
        self,
        config: Gemma3Config,
        backend: AttentionBackend,
        ops: LayerOps,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__(config, backend, ops, tp, rotary, sliding_window)
        self.scale = config.query_pre_attn_scalar**-0.5


class Gemma3DecoderLayer(nn.Module):
    """Each sublayer normalized before and after: the output of attention is normalized
    before it joins the stream, and so is the MLP's.

    The checkpoints call the norm before the MLP ``pre_feedforward_layernorm`` and use
    Llama's name ``post_attention_layernorm`` for the norm of the attention output.

    A sublayer's output norm, its add to the stream and the next norm are one step
    (``RoundOnceRMSNorm.add_normed_and_norm``). So the layer returns its MLP's output before
    ``post_feedforward_layernorm``, which the next layer's first norm applies (it takes the
    layer before's, ``output_norm``), or the model's after the last layer."""

    def __init__(
        self, config: ModelConfig, self_attn: Gemma3Attention, ops: LayerOps, tp: TensorParallel
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = UnitOffsetRMSNorm(size, eps, ops)
        self.self_attn = self_attn
        self.post_attention_layernorm = UnitOffsetRMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = UnitOffsetRMSNorm(size, eps, ops)
        self.mlp = MLP(config, ops, tp)
        self.post_feedforward_layernorm = UnitOffsetRMSNorm(size, eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        output_norm: UnitOffsetRMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output, not yet normalized, and the stream; x is the layer before's,
        to be normalized by its ``output_norm`` (None: x is the embedding)."""
        h, residual = self.input_layernorm.add_normed_and_norm(x, output_norm, residual)
        attention = self.self_attn(h, metadata)
        norm_after = self.post_attention_layernorm
        h, residual = self.pre_feedforward_layernorm.add_normed_and_norm(
            attention, norm_after, residual
        )
        return self.mlp(h), residual


class Gemma3ForCausalLM(CausalLM):
    attention_class = Gemma3Attention
    decoder_layer_class = Gemma3DecoderLayer
    norm_class = UnitOffsetRMSNorm

    def __init__(
        self,
        config: Gemma3Config,
        backend: AttentionBackend,
        ops: LayerOps,
        tp: TensorParallel,
        max_positions: int,
        device: torch.device,
    ) -> None:
        super().__init__(config, backend, ops, tp, max_positions, device)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcapping = config.final_logit_softcapping

    def run_layers(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Each layer applies the one before's output norm (Gemma3DecoderLayer); the last's
        # is final_norm's.
        x = self.embed(input_ids)
        residual = None
        output_norm = None
        for layer in self.layers:
            x, residual = layer(x, residual, metadata, output_norm)
            output_norm = layer.post_feedforward_layernorm
        return x, residual

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        last_output_norm = self.layers[-1].post_feedforward_layernorm
        return self.norm.add_normed_and_norm(x, last_output_norm, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Rounded to the compute dtype before multiplying, as Hugging Face does. A CPU scalar
        # tensor: no copy to the device.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: LinearInput) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        # In float32 (Hugging Face caps in the compute dtype): sampling reads these.
        return torch.tanh(logits / cap) * cap


def _gemma3_config(config: Mapping[str, Any], path: Path) -> Gemma3Config:
    for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if config.get(unsupported):
            raise ValueError(f"{path / CONFIG_JSON}: Gemma 3 with {unsupported} is not supported")
    fields = hf_config_fields(config, path, _ROPE_THETA, _LOCAL_ROPE_THETA)
    values = ConfigValues(config, path)
    # Configs before transformers 5 give the pattern instead: every Nth layer is global.
    pattern = values.optional_size("sliding_window_pattern", _SLIDING_WINDOW_PATTERN, MAX_LAYERS)
    layer_types = config.get("layer_types") or [
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
        for i in range(fields["num_hidden_layers"])
    ]
    fields |= {
        "tie_word_embeddings": values.flag("tie_word_embeddings", True),
        "hidden_act": values.name("hidden_activation", "gelu_pytorch_tanh"),
        "layer_types": layer_types,
        "sliding_window": values.size("sliding_window"),
    }
    return Gemma3Config(
        **fields,
        query_pre_attn_scalar=values.number("query_pre_attn_scalar"),
        final_logit_softcapping=values.optional_number("final_logit_softcapping"),
    )


def _gemma3_gguf_config(keys: GGUFMetadata, common: dict[str, Any]) -> Gemma3Config:
    # llama.cpp hard-codes the layer pattern and the sliding layers' default RoPE base for the
    # architecture (llama-model.cpp) instead of writing them to the file.
    num_layers = common["num_hidden_layers"]
    softcap = keys.optional("final_logit_softcapping")
    query_pre_attn_scalar = (
        common["hidden_size"] / common["num_attention_heads"]
        if num_layers == _GEMMA3_27B_LAYERS
        else common["head_dim"]
    )
    return Gemma3Config(
        **common,
        hidden_act="gelu_pytorch_tanh",
        layer_types=[
            FULL_ATTENTION if (layer + 1) % _SLIDING_WINDOW_PATTERN == 0 else SLIDING_ATTENTION
            for layer in range(num_layers)
        ],
        sliding_window=keys.required("attention.sliding_window"),
        rope_local_theta=decimal(keys.optional("rope.freq_base_swa", _LOCAL_ROPE_THETA)),
        query_pre_attn_scalar=float(query_pre_attn_scalar),
        final_logit_softcapping=None if softcap is None else decimal(softcap),
    )


def _norms_minus_one(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    # llama.cpp stores the (1 + weight) that Gemma's norms scale by.
    return array - np.float32(1) if name.endswith("norm.weight") else array


GEMMA3 = ModelFamily(
    Gemma3ForCausalLM,
    _gemma3_config,
    GGUFLayout(
        "gemma3",
        GGUF_PROJECTIONS
        | GGUF_QK_NORMS
        | {
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",  # Llama's post_attention_layernorm
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        read_config=_gemma3_gguf_config,
        restore=_norms_minus_one,
    ),
    refused={
        "Gemma3ForConditionalGeneration": "Gemma3ForConditionalGeneration (text and images) is "
        "not supported; text-only Gemma 3 checkpoints (Gemma3ForCausalLM, e.g. gemma-3-1b-it) are"
    },
)
