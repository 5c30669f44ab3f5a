"""The building blocks of a Llama, which the other families reuse or subclass.

RMSNorm, RoPE, grouped-query attention, gated MLP and the pre-norm decoder layer. A family that
computes something differently subclasses a block (Qwen3's Q/K norms are ``QKNormAttention``) or
brings its own block in its module; nothing here asks which family it serves. Same code on CPU
(float32) and CUDA (bfloat16); Hugging Face's weight names load directly, with Q/K/V and gate/up
fused into one matrix each.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.backends.attention import AttentionBackend, AttentionMetadata, LayerKVCache, Rotary
from engine.backends.deferred_norm import DeferredNorm, LinearInput
from engine.backends.layer_ops import LayerOps
from engine.distributed.parallel import TensorParallel
from engine.model_config import ModelConfig, RopeScaling, YarnScaling
from engine.models.parallel_layers import (
    ColumnParallelLinear,
    PerHeadVector,
    RowParallelLinear,
    Rows,
)
from engine.models.yarn import yarn_attention_factor, yarn_inverse_frequencies
from engine.quantization.linear_methods import LinearMethod, linear_method

# The gated MLP's activations: SiLU, left to the down projection, which may fold it into its
# product (``gated``), and the tanh-approximated GELU (Gemma's, ``LayerOps.gelu_tanh_and_mul``).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalized in float32, rounded, then scaled by the weight."""

    def __init__(
        self, size: int, eps: float, ops: LayerOps, reader: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops
        # The method of the linear layer that reads the norm's output, where there is one:
        # it may take the norm of several rows too (LinearMethod.takes_deferred_norm).
        self.reader = reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        """Add ``x`` to the residual stream (None: ``x`` starts it); the stream normalized,
        and the stream. One row the next linear layer reads with the ops' one-row product
        (``LayerOps.takes_one_row``) gets its norm there (``DeferredNorm``), where the ops
        defer them; so do rows that the next layer's method takes the norm of (an FP8
        layer's W8A8 quantization)."""
        if self.ops.defers_norms and (
            self.ops.takes_one_row(x)
            or (self.reader is not None and self.reader.takes_deferred_norm(x.shape[0]))
        ):
            deferred = DeferredNorm(x, residual, self.weight, self.eps, self.ops)
            return deferred, deferred.stream
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RoundOnceRMSNorm(RMSNorm):
    """RMSNorm whose product with the weight is in float32 too, rounded once (OLMo 2's); a
    subclass may scale by ``weight_offset`` + the weight (Gemma's 1 + weight)."""

    weight_offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_round_once(x, self.weight, self.eps, self.weight_offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        if residual is None:
            return self(x), x
        return self.ops.add_rms_norm_round_once(
            x, residual, self.weight, self.eps, self.weight_offset
        )

    def add_normed_and_norm(
        self, x: torch.Tensor, output_norm: RoundOnceRMSNorm | None, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        """``add_and_norm`` of a sublayer's output ``x`` normalized by its own norm first
        (``output_norm``, of this norm's kind; None: x as it is): a sandwich
        layer's norm after its sublayer, the add and the next norm in one pass where the ops
        fuse them."""
        if output_norm is None:
            return self.add_and_norm(x, residual)
        assert residual is not None, "a sublayer's output joins a stream"
        assert (output_norm.eps, output_norm.weight_offset) == (self.eps, self.weight_offset)
        return self.ops.add_rms_norm_round_once(
            x, residual, self.weight, self.eps, self.weight_offset, output_norm.weight
        )


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, linear_factor: float | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if linear_factor is not None:
        inv_freq = inv_freq / linear_factor  # "linear": every position divided by the factor
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


class RotaryEmbedding:
    """Rotate-half RoPE's cos/sin tables, precomputed for every position; the attention backend
    applies them. Under YaRN (``yarn``) its frequencies, and the tables times its attention
    factor, as transformers scales them.

    No nn.Module: the layers of one kind share it, and its tables are plain float32
    tensors made on ``device``, so a model built on the meta device and then materialized
    keeps their real values, and casting the model leaves them float32.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        device: torch.device,
        scaling: RopeScaling | None = None,
        linear_factor: float | None = None,
        yarn: YarnScaling | None = None,
    ) -> None:
        if yarn is None:
            inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, linear_factor)
            attention_factor = 1.0
        else:
            inv_freq = yarn_inverse_frequencies(head_dim, theta, yarn)
            attention_factor = yarn_attention_factor(yarn)
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1).to(device)
        self.cos = angles.cos() * attention_factor
        self.sin = angles.sin() * attention_factor


class Attention(nn.Module):
    """Llama's grouped-query attention: one fused Q/K/V projection without biases, RoPE,
    scale head_dim ** -0.5, and a sliding window when the layer has one.

    Under tensor parallelism a rank computes its share of the query heads with the KV heads
    they attend with (``TensorParallel.kv_heads``), and its cache holds only those.

    Subclasses change ``qkv_bias``, ``o_bias`` and ``attention_sinks``, or ``project_qkv`` for
    what comes between the projection and RoPE, or ``rotary`` for what the backend applies
    with RoPE, or ``scale``.
    """

    qkv_bias = False
    o_bias = False
    attention_sinks = False  # a learned logit a head in each softmax's denominator (gpt-oss)

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        tp: TensorParallel,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.head_dim = head_dim = config.head_dim
        self.first_head, self.num_heads = tp.split(
            config.num_attention_heads, "the number of attention heads"
        )
        self.first_kv_head, self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        q_total = config.num_attention_heads * head_dim
        q_rows = Rows(self.first_head * head_dim, self.q_size, q_total)
        kv_rows = Rows(
            self.first_kv_head * head_dim, self.kv_size, config.num_key_value_heads * head_dim
        )
        method = linear_method(config.quantization, ops)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_rows, kv_rows, kv_rows], self.qkv_bias, method
        )
        self.o_proj = RowParallelLinear(q_rows, config.hidden_size, tp, method, self.o_bias)
        # This rank's heads' sinks (``sink_logits``).
        self.sinks = (
            PerHeadVector(Rows(self.first_head, self.num_heads, config.num_attention_heads))
            if self.attention_sinks
            else None
        )
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend
        self.ops = ops
        self.rotary_embedding = rotary
        self.cache: LayerKVCache | None = None  # bound once the engine allocates the cache

    def project_qkv(self, x: LinearInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of ``x`` [T, hidden]."""
        q, k, v = self.split_qkv(self.qkv_proj(x))
        return self.split_heads(q, k, v)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
        )

    def rotary(self) -> Rotary:
        """RoPE, as the backend applies it to the projected q and k."""
        return Rotary(self.rotary_embedding.cos, self.rotary_embedding.sin)

    def sink_logits(self) -> torch.Tensor | None:
        """Each of this rank's heads' sink logit (``AttentionBackend.forward``), if any."""
        return None if self.sinks is None else self.sinks.weight

    def forward(self, x: LinearInput, metadata: AttentionMetadata) -> torch.Tensor:
        out, _ = self.into_stream(x, metadata, None)
        return out

    def into_stream(
        self, x: LinearInput, metadata: AttentionMetadata, stream: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention's output as it joins the residual ``stream``, and what is left of the
        stream to add (``RowParallelLinear.into_stream``)."""
        assert self.cache is not None, "the KV cache must be bound before the first forward"
        rotary = self.rotary()
        sinks = self.sink_logits()
        out = None
        # A subclass's own project_qkv puts a step between the projection and RoPE: then the
        # backend may not do the projection itself.
        if type(self).project_qkv is Attention.project_qkv:
            out = self.backend.project_and_attend(
                x,
                self.qkv_proj,
                self.cache,
                metadata,
                self.scale,
                self.sliding_window,
                rotary,
                sinks,
            )
        if out is None:
            q, k, v = self.project_qkv(x)
            out = self.backend.forward(
                q,
                k,
                v,
                self.cache,
                metadata,
                self.scale,
                self.sliding_window,
                rotary=rotary,
                sinks=sinks,
            )
        return self.o_proj.into_stream(out.reshape(-1, self.q_size), stream)


class QKNormAttention(Attention):
    """An RMSNorm over each head of Q and K (weights of size head_dim), before RoPE, as the
    checkpoints were trained (Qwen3; ``head_norm_class``, Gemma's rounds once). The backend
    applies them, with RoPE and the cache write in one pass (``Rotary``)."""

    head_norm_class: type[RMSNorm] = RMSNorm

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
        self.q_norm = self.head_norm_class(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = self.head_norm_class(self.head_dim, config.rms_norm_eps, ops)

    def rotary(self) -> Rotary:
        rotary = super().rotary()
        rotary.q_norm, rotary.k_norm = self.q_norm.weight, self.k_norm.weight
        rotary.eps = self.q_norm.eps
        if isinstance(self.q_norm, RoundOnceRMSNorm):
            rotary.norm_offset = self.q_norm.weight_offset
        return rotary


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU or tanh-approximated GELU; a rank
    holds its share of the intermediate features."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"activation {config.hidden_act!r} is not supported, only {', '.join(ACTIVATIONS)}"
            )
        self.silu = config.hidden_act == "silu"
        self.ops = ops
        start, length = tp.split(config.intermediate_size, "intermediate_size")
        rows = Rows(start, length, config.intermediate_size)
        method = linear_method(config.quantization, ops)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [rows, rows], False, method)
        self.down_proj = RowParallelLinear(rows, config.hidden_size, tp, method)

    @property
    def input_method(self) -> LinearMethod:
        """The method of the projection that reads the MLP's input (``RMSNorm.reader``)."""
        return self.gate_up_proj.method

    def forward(self, x: LinearInput) -> torch.Tensor:
        out, _ = self.into_stream(x, None)
        return out

    def into_stream(
        self, x: LinearInput, stream: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's output as it joins the residual ``stream``, and what is left of the
        stream to add (``RowParallelLinear.into_stream``)."""
        gate_up = self.gate_up_proj(x)
        if self.silu:
            return self.down_proj.into_stream(gate_up, stream, gated=True)
        return self.down_proj.into_stream(self.ops.gelu_tanh_and_mul(gate_up), stream)


class DecoderLayer(nn.Module):
    """Llama's layer: pre-norm attention and MLP, each added to the residual stream.

    A layer takes and returns the last sublayer's output and the stream without it: the next
    norm adds the two, in one fused pass where the ops have one. Every decoder layer keeps to
    this, so ``CausalLM`` runs any of them. The stream may be None: the output is the stream
    already (the first layer's input; and here, at one row on one rank, the o and down
    projections' one-row kernel adds the stream in its epilogue, so the norm after them,
    computed by the next projection's kernel, has no residual to add and write as it reads).
    """

    def __init__(
        self,
        config: ModelConfig,
        self_attn: Attention,
        ops: LayerOps,
        tp: TensorParallel,
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the block after attention, ``MLP`` if None (a mixture of experts'
        ``engine.models.moe.SparseMoeBlock``): its ``into_stream`` and ``input_method``."""
        super().__init__()
        # Each norm knows the method of the projection that reads it (RMSNorm.reader).
        self.input_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ops, self_attn.qkv_proj.method
        )
        self.self_attn = self_attn
        mlp = MLP(config, ops, tp) if mlp is None else mlp
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ops, mlp.input_method
        )
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.self_attn.into_stream(h, metadata, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.into_stream(h, residual)
