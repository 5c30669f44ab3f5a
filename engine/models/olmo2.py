"""OLMo 2 (Olmo2ForCausalLM): Llama's blocks with the norms moved.

No norm before a sublayer: each sublayer's output is normalized before it joins the residual
stream (``post_attention_layernorm``, ``post_feedforward_layernorm``), and Q and K are normalized
over all their heads at once (weights of num_heads * head_dim), before RoPE. Every norm scales in
float32 and rounds once, as Hugging Face's Olmo2RMSNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.checkpoint.gguf_checkpoint import GGUFMetadata
from engine.layer_ops import LayerOps
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import GGUF_PROJECTIONS, GGUF_QK_NORMS, GGUFLayout, ModelFamily
from engine.models.layers import MLP, Attention, RotaryEmbedding, RoundOnceRMSNorm
from engine.models.llama import llama_config


class Olmo2Attention(Attention):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__(config, backend, ops, rotary, sliding_window)
        self.q_norm = RoundOnceRMSNorm(self.q_size, config.rms_norm_eps, ops)
        self.k_norm = RoundOnceRMSNorm(self.kv_size, config.rms_norm_eps, ops)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.split_qkv(self.qkv_proj(x))
        return self.split_heads(self.q_norm(q), self.k_norm(k), v)


class Olmo2DecoderLayer(nn.Module):
    """stream += norm(attention(stream)); stream += norm(mlp(stream)).

    Like every decoder layer it returns the MLP's part apart from the stream; the next layer
    (or the final norm) adds them.
    """

    def __init__(self, config: ModelConfig, self_attn: Olmo2Attention, ops: LayerOps) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.post_attention_layernorm = RoundOnceRMSNorm(size, eps, ops)
        self.mlp = MLP(config, ops)
        self.post_feedforward_layernorm = RoundOnceRMSNorm(size, eps, ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, metadata))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(CausalLM):
    attention_class = Olmo2Attention
    decoder_layer_class = Olmo2DecoderLayer
    norm_class = RoundOnceRMSNorm


def _olmo2_gguf_config(keys: GGUFMetadata, common: dict[str, Any]) -> ModelConfig:
    # llama.cpp converts OLMo 3 to this architecture too, with sliding-window layers.
    if keys.optional("attention.sliding_window") is not None:
        raise ValueError(f"{keys.path}: OLMo 3's sliding-window attention is not supported")
    return ModelConfig(**common)


OLMO2 = ModelFamily(
    Olmo2ForCausalLM,
    llama_config,  # config.json has Llama's fields
    GGUFLayout(
        "olmo2",
        GGUF_PROJECTIONS
        | GGUF_QK_NORMS
        | {
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        read_config=_olmo2_gguf_config,
    ),
)
