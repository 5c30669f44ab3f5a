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

from engine.backends.attention import AttentionBackend, AttentionMetadata
from engine.backends.layer_ops import LayerOps
from engine.checkpoint.gguf_checkpoint import GGUFMetadata
from engine.distributed.parallel import TensorParallel
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.family import GGUF_PROJECTIONS, GGUF_QK_NORMS, GGUFLayout, ModelFamily
from engine.models.layers import MLP, Attention, RotaryEmbedding, RoundOnceRMSNorm
from engine.models.llama import llama_config


class Olmo2Attention(Attention):
    """Under tensor parallelism each norm spans every rank's heads: a rank gathers all of Q
    (and of K, each KV head once), normalizes them with the whole weight and keeps its own
    heads, as vLLM does; exact, where summing squares across ranks would reorder the sum."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__(config, backend, ops, tp, rotary, sliding_window)
        head_dim, eps = config.head_dim, config.rms_norm_eps
        self.q_norm = RoundOnceRMSNorm(config.num_attention_heads * head_dim, eps, ops)
        self.k_norm = RoundOnceRMSNorm(config.num_key_value_heads * head_dim, eps, ops)
        # Ranks that hold the same KV head: its copies in a gathered K.
        self.kv_replicas = max(1, tp.size // config.num_key_value_heads)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.split_qkv(self.qkv_proj(x))
        q = self._norm_all_heads(self.q_norm, q, self.first_head, 1)
        k = self._norm_all_heads(self.k_norm, k, self.first_kv_head, self.kv_replicas)
        return self.split_heads(q, k, v)

    def _norm_all_heads(
        self, norm: RoundOnceRMSNorm, x: torch.Tensor, first_head: int, replicas: int
    ) -> torch.Tensor:
        if self.tp.size == 1:
            return norm(x)
        every_rank = self.tp.all_gather(x)
        if replicas > 1:
            every_rank = every_rank.view(x.shape[0], self.tp.size, -1)[:, ::replicas]
        normed = norm(every_rank.reshape(x.shape[0], -1))
        start = first_head * self.head_dim
        return normed[:, start : start + x.shape[1]]


class Olmo2DecoderLayer(nn.Module):
    """stream += norm(attention(stream)); stream += norm(mlp(stream)).

    Like every decoder layer it returns the MLP's part apart from the stream; the next layer
    (or the final norm) adds them.
    """

    def __init__(
        self, config: ModelConfig, self_attn: Olmo2Attention, ops: LayerOps, tp: TensorParallel
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.post_attention_layernorm = RoundOnceRMSNorm(size, eps, ops)
        self.mlp = MLP(config, ops, tp)
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
