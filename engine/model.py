"""The Llama architecture over a packed batch and a paged KV cache.

Same code on CPU (float32) and CUDA (bfloat16). Hugging Face's weight names load
directly; Q/K/V and gate/up projections are fused into one matrix each so a layer
runs two GEMMs where it would run five.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from engine.model_config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Hugging Face does; bf16 variance loses too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1).to(device)
        # Plain float32 attributes, not buffers: a model built on the meta device and then
        # materialized keeps these real values, and casting the model leaves them float32.
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.cache: LayerKVCache | None = None  # bound once the engine allocates the cache

    def forward(
        self,
        x: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(metadata.positions, q, k)
        assert self.cache is not None, "the KV cache must be bound before the first forward"
        out = self.backend.forward(q, k, v, self.cache, metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, metadata: AttentionMetadata, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), metadata, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


# Hugging Face names of the separate projections, and where they go in our fused ones.
_FUSED_WEIGHTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions, device)
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
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, metadata, self.rotary)
        x = self.norm(x[logits_index])
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def bind_kv_cache(self, caches: list[LayerKVCache]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, one at a time; fail naming any missing one."""
        params = dict(self.named_parameters())
        expected = set(params)
        loaded: set[str] = set()
        shard_sizes = {
            "self_attn.qkv_proj": self._qkv_split_sizes(),
            "mlp.gate_up_proj": [self.config.intermediate_size] * 2,
        }
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store the head anyway
            for separate, (fused, shard) in _FUSED_WEIGHTS.items():
                if f".{separate}." in name:
                    name = name.replace(separate, fused)
                    rows = shard_sizes[fused]
                    target = params[name].narrow(0, sum(rows[:shard]), rows[shard])
                    loaded.add(f"{name}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint has a tensor the model does not: {hf_name}")
                target = params[name]
                loaded.add(name)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
        for fused, rows in shard_sizes.items():
            for name in [n for n in expected if n.endswith(f"{fused}.weight")]:
                if all(f"{name}#{i}" in loaded for i in range(len(rows))):
                    loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _qkv_split_sizes(self) -> list[int]:
        attention = self.layers[0].self_attn
        return [attention.q_size, attention.kv_size, attention.kv_size]


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """An uninitialized model allocated once, directly on ``device`` in ``dtype``."""
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend, max_positions, device)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.to_empty(device=device)
