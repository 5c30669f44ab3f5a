"""The decoder-only language model every family is: embedding, decoder layers, norm, LM head.

It runs over a packed batch (the new tokens of every sequence, prefills and decodes mixed)
and a paged KV cache, and loads Hugging Face-named tensors into its fused projections.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from engine.backends.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from engine.backends.deferred_norm import LinearInput, dense
from engine.backends.layer_ops import LayerOps
from engine.checkpoint.checkpoint import TensorSlices
from engine.distributed.parallel import TensorParallel
from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine.models.layers import Attention, DecoderLayer, RMSNorm, RotaryEmbedding
from engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLayer,
    ParallelLinear,
    VocabParallelEmbedding,
    load_slice,
)
from engine.quantization.linear_methods import UNREAD_SCALES

# Hugging Face names of the separate projections, and where they go in our fused ones.
_FUSED_WEIGHTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _fused_name(name: str) -> tuple[str, int | None]:
    """``name`` renamed into our fused projection if it is one of its parts, and the part's
    index; else ``name`` itself and None."""
    for separate, (fused, part) in _FUSED_WEIGHTS.items():
        if f".{separate}." in name:
            return name.replace(separate, fused), part
    return name, None


@runtime_checkable
class LoadsItsTensors(Protocol):
    """A module that loads the checkpoint tensors under its name itself, however they map to
    its parameters (``engine.models.moe.FusedExperts``: a tensor an expert, held stacked)."""

    def load_tensor(self, name: str, source: TensorSlices, hf_name: str) -> list[str]:
        """Load tensor ``name`` (relative to the module), this rank's part of it; the keys
        of the parts of its parameters that it filled."""
        ...

    def missing(self, loaded: set[str]) -> list[str]:
        """The keys of its parameters' parts that ``loaded`` lacks."""
        ...

    def load_random(self, generator: torch.Generator, std: float) -> None:
        """Its matrices drawn from N(0, std) (``CausalLM.load_random_weights``)."""
        ...


class CausalLM(nn.Module):
    """A Llama: embedding, decoder layers, final norm and LM head, shaped by ``ModelConfig``.

    Each family subclasses it, named as config.json's ``architectures`` names it, and says
    what it does differently by the blocks it picks (the class attributes) and by overriding
    ``embed`` or ``compute_logits``.

    Under tensor parallelism (``tp``) every rank builds one: its share of the heads, the MLP's
    features and the vocabulary, the rest (norms, RoPE) whole; its logits are the whole
    vocabulary's, on every rank.
    """

    attention_class: type[Attention] = Attention
    # Called as (config, attention, ops, tp); keeps DecoderLayer's (x, residual) convention.
    decoder_layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm  # the final norm's
    # The checkpoint's module names that differ from ours, one dot-separated part for another
    # (Mixtral's "block_sparse_moe" is our "mlp").
    checkpoint_renames: Mapping[str, str] = {}

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        tp: TensorParallel,
        max_positions: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, ops)
        full_rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            max_positions,
            device,
            config.rope_scaling,
            config.rope_linear_factor,
            config.rope_yarn,
        )
        # Gemma 3's sliding layers have a RoPE base of their own; Mistral's and Qwen's share
        # the full layers' RoPE.
        sliding_rotary = (
            full_rotary
            if config.rope_local_theta is None
            else RotaryEmbedding(config.head_dim, config.rope_local_theta, max_positions, device)
        )
        self.layers = nn.ModuleList(
            self.decoder_layer(
                index,
                self.attention_class(
                    config, backend, ops, tp, sliding_rotary, config.sliding_window
                )
                if layer_type == SLIDING_ATTENTION
                else self.attention_class(config, backend, ops, tp, full_rotary, None),
                ops,
                tp,
            )
            for index, layer_type in enumerate(
                config.layer_types or [FULL_ATTENTION] * config.num_hidden_layers
            )
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, ops)
        )

    def decoder_layer(
        self, index: int, attention: Attention, ops: LayerOps, tp: TensorParallel
    ) -> nn.Module:
        """Layer ``index``, around its ``attention``: ``decoder_layer_class``'s, unless the
        family's layers differ one from another (a mixture of experts' dense layers)."""
        return self.decoder_layer_class(self.config, attention, ops, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (float32) of the tokens at ``logits_index`` of the packed batch."""
        x, residual = self.run_layers(input_ids, metadata)
        if x.shape[0] != 1 or logits_index.shape[0] != 1:
            # (One token whose logits are wanted, a batch-1 step's: it is the row already.)
            x = x[logits_index]
            residual = None if residual is None else residual[logits_index]
        hidden, _ = self.final_norm(x, residual)
        return self.compute_logits(hidden)

    def run_layers(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every packed token through the decoder layers: the last layer's output and the
        residual stream it adds to (None: no residual yet), before the final norm."""
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, metadata)
        return x, residual

    def last_hidden_states(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Every packed token's last hidden state: the final norm's output, as transformers'
        ``last_hidden_state`` (what embeddings pool, engine/execution/pooling.py)."""
        x, residual = self.run_layers(input_ids, metadata)
        return dense(self.final_norm(x, residual)[0])

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        """The last layer's output added to the stream and normalized (``run_layers``'
        results), and the stream."""
        return self.norm.add_and_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: LinearInput) -> torch.Tensor:
        """float32 logits of the final norm's output."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.logits(hidden)

    def bind_kv_cache(self, caches: list[LayerKVCache]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, TensorSlices]]) -> None:
        """Copy Hugging Face-named tensors in, one at a time, each rank reading only its own
        part of each; fail naming any missing one."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        owners = {n: m for n, m in modules.items() if isinstance(m, LoadsItsTensors)}
        owned_parts: dict[str, set[str]] = {n: set() for n in owners}
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = ".".join(
                self.checkpoint_renames.get(part, part)
                for part in hf_name.removeprefix("model.").split(".")
            )
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store the head anyway
            if name.endswith(UNREAD_SCALES):
                continue
            owner = _owner(name, owners)
            if owner is not None:
                relative = name.removeprefix(f"{owner}.")
                owned_parts[owner].update(owners[owner].load_tensor(relative, source, hf_name))
                continue
            name, part = _fused_name(name)
            if name not in params:
                raise ValueError(f"checkpoint has a tensor the model does not: {hf_name}")
            module_name, _, param = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, ParallelLayer):
                module.load(param, part or 0, source, hf_name)
            else:
                load_slice(params[name], source, hf_name)
            loaded.add(name if part is None else f"{name}#{part}")
        for name in params:  # a fused projection is loaded once all its parts are
            module = modules[name.rpartition(".")[0]]
            if isinstance(module, ColumnParallelLinear) and all(
                f"{name}#{i}" in loaded for i in range(len(module.parts))
            ):
                loaded.add(name)
        for owner, module in owners.items():  # loaded once all their parts are
            if not module.missing(owned_parts[owner]):
                loaded.update(f"{owner}.{param}" for param, _ in module.named_parameters())
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @torch.no_grad()
    def load_random_weights(self, seed: int = 0) -> None:
        """Random weights instead of a checkpoint's (``--load-format dummy``, vLLM's): the
        shape's speed without its files. Matrices N(0, 0.02), vectors (norms, biases) ones."""
        generator = torch.Generator(self.embed_tokens.weight.device).manual_seed(seed)
        done: set[int] = set()
        for module in self.modules():  # stored their own way (quantized, say)
            if isinstance(module, ParallelLinear):
                module.load_random(generator, 0.02)
                done.add(id(module.weight))
            elif isinstance(module, LoadsItsTensors):
                module.load_random(generator, 0.02)
                done.update(id(param) for param in module.parameters())
        for param in self.parameters():
            if id(param) in done:
                continue
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.fill_(1.0)


def _owner(name: str, owners: Mapping[str, LoadsItsTensors]) -> str | None:
    """The module of ``owners`` that tensor ``name`` lies under, if any."""
    parts = name.split(".")
    return next(
        (prefix for i in range(1, len(parts)) if (prefix := ".".join(parts[:i])) in owners),
        None,
    )
