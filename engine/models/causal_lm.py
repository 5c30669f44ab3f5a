"""The decoder-only language model every family is: embedding, decoder layers, norm, LM head.

It runs over a packed batch (the new tokens of every sequence, prefills and decodes mixed)
and a paged KV cache, and loads Hugging Face-named tensors into its fused projections.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from engine.layer_ops import LayerOps
from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.models.layers import Attention, DecoderLayer, RMSNorm, RotaryEmbedding

# Hugging Face names of the separate projections, and where they go in our fused ones.
_FUSED_WEIGHTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _fused_name(name: str) -> tuple[str, str | None, int]:
    """``name`` renamed into our fused projection if it is one of its parts, that fused
    projection and the part's index; else ``name`` itself, None and 0."""
    for separate, (fused, shard) in _FUSED_WEIGHTS.items():
        if f".{separate}." in name:
            return name.replace(separate, fused), fused, shard
    return name, None, 0


class CausalLM(nn.Module):
    """A Llama: embedding, decoder layers, final norm and LM head, shaped by ``ModelConfig``.

    Each family subclasses it, named as config.json's ``architectures`` names it, and says
    what it does differently by the blocks it picks (the class attributes) and by overriding
    ``embed`` or ``compute_logits``.
    """

    attention_class: type[Attention] = Attention
    # Called as (config, attention, ops); keeps DecoderLayer's (x, residual) convention.
    decoder_layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm  # the final norm's

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        max_positions: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        full_rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            max_positions,
            device,
            config.rope_scaling,
            config.rope_linear_factor,
        )
        # Gemma 3's sliding layers have a RoPE base of their own; Mistral's and Qwen's share
        # the full layers' RoPE.
        sliding_rotary = (
            full_rotary
            if config.rope_local_theta is None
            else RotaryEmbedding(config.head_dim, config.rope_local_theta, max_positions, device)
        )
        self.layers = nn.ModuleList(
            self.decoder_layer_class(
                config,
                self.attention_class(config, backend, ops, sliding_rotary, config.sliding_window)
                if layer_type == SLIDING_ATTENTION
                else self.attention_class(config, backend, ops, full_rotary, None),
                ops,
            )
            for layer_type in config.layer_types or [FULL_ATTENTION] * config.num_hidden_layers
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (float32) of the tokens at ``logits_index`` of the packed batch."""
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, metadata)
        assert residual is not None
        x, _ = self.norm.add_and_norm(x[logits_index], residual[logits_index])
        return self.compute_logits(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final norm's output."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    def bind_kv_cache(self, caches: list[LayerKVCache]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, one at a time; fail naming any missing one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        c = self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shard_rows = {
            "self_attn.qkv_proj": [q_size, kv_size, kv_size],
            "mlp.gate_up_proj": [c.intermediate_size] * 2,
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store the head anyway
            name, fused, shard = _fused_name(name)
            if name not in params:
                raise ValueError(f"checkpoint has a tensor the model does not: {hf_name}")
            target = params[name]
            if fused is None:
                loaded.add(name)
            else:
                rows = shard_rows[fused]
                target = target.narrow(0, sum(rows[:shard]), rows[shard])
                loaded.add(f"{name}#{shard}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
        for fused, rows in shard_rows.items():
            for name in [n for n in params if n.rsplit(".", 1)[0].endswith(fused)]:
                if all(f"{name}#{i}" in loaded for i in range(len(rows))):
                    loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
