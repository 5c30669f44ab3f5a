"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture of experts with attention sinks.

What it does differently from Qwen3-MoE and Mixtral:

- attention: biases on Q, K, V and O; a learned sink logit a head (``SinkAttention``,
  ``AttentionBackend.forward``'s ``sinks``); sliding-window and full layers alternating
  (config.json's ``layer_types``); YaRN-scaled RoPE (``engine.models.yarn``);
- router: a linear layer with a bias; each token's top 4 logits, then a softmax over those
  four: the same weights as the other families' softmax renormalized over its top k
  (``norm_topk_prob``), so the layer ops' ``moe_route`` routes it;
- experts: biases on the gate/up and the down projections, and a clamped SwiGLU
  (``ClampedSwiGLU``); the checkpoint stores each layer's experts in two tensors, the
  gate and up features interleaved (gate even, up odd) and both transposed ([E, H, 2I],
  [E, I, H]), or, as published, in MXFP4 (``*_blocks`` and ``*_scales``, [E, 2I, ...] and
  [E, H, ...]: ``engine.backends.mxfp4``), which is dequantized as it loads, or, under
  ``--quantization mxfp4``, kept as published for the MoE kernels to read
  (``LayerOps.moe_experts``; ``check_mxfp4_experts`` says where it cannot be).

Its norms round as Llama's (normalized in float32, rounded, then times the weight; transformers'
rounds once after the product): the difference is below bfloat16's rounding, and vLLM's
kernels round the same way. Under tensor parallelism a rank reads only its share of each
expert's intermediate features (``GptOssExperts.load_tensor``), as Qwen3-MoE's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.backends.layer_ops import ClampedSwiGLU, LayerOps
from engine.backends.mxfp4 import BLOCK, dequantize_mxfp4
from engine.checkpoint.checkpoint import Checkpoint, TensorSlices
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.hf_config import CONFIG_JSON, ConfigValues, expert_counts
from engine.distributed.parallel import TensorParallel
from engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from engine.models.family import ModelFamily
from engine.models.layers import Attention
from engine.models.moe import FusedExperts, MoECausalLM, MoEConfig, SparseMoeBlock
from engine.models.parallel_layers import Rows, read_slice
from engine.quantization.linear_methods import MXFP4

_ROPE_THETA = 150_000.0  # transformers' default for gpt-oss


@dataclass(kw_only=True)
class GptOssConfig(MoEConfig):
    swiglu_alpha: float  # the experts' activation's sigmoid gain
    swiglu_limit: float  # and its clamp
    mxfp4_experts: bool = False  # the checkpoint's experts are MXFP4 (*_blocks, *_scales)


class SinkAttention(Attention):
    """Biased Q, K, V and O projections, and each head's sink logit (``sinks``: this rank's
    heads')."""

    qkv_bias = True
    o_bias = True
    attention_sinks = True


# The experts' checkpoint tensors: interleaved gate/up features first ("gate_up_proj"),
# then the down projection; each stored as a matrix (and its bias), or in MXFP4.
_BIASES = {"gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}
_MATRICES = {"gate_up_proj": "w13", "down_proj": "w2"}
_MXFP4_PARTS = ("_blocks", "_scales")


class GptOssExperts(FusedExperts):
    """``FusedExperts`` with biases (``w13_bias`` [E, 2 * I_rank], gate then up as ``w13``;
    ``w2_bias`` [E, H], added by the first rank only, the ranks' outputs being summed) and
    the clamped SwiGLU, loaded from gpt-oss's tensors; MXFP4 ones kept packed under
    ``--quantization mxfp4``, their rows in the order the dequantized ones take."""

    loads_mxfp4 = True

    def __init__(self, config: MoEConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__(config, ops, tp)
        assert isinstance(config, GptOssConfig)
        experts, length = config.num_experts, self.rows.length
        self.w13_bias = nn.Parameter(torch.empty(experts, 2 * length), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(experts, config.hidden_size), requires_grad=False)
        self.adds_down_bias = tp.rank == 0
        self.activation = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        # An MXFP4 matrix's blocks or scales, this rank's part read, until the other comes.
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.moe_experts(
            x,
            weights,
            ids,
            self.w13,
            self.w2,
            self.w13_scale,
            self.w2_scale,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias if self.adds_down_bias else None,
            activation=self.activation,
        )

    def _shape(self) -> tuple[int, int, int, int, int]:
        """Experts, hidden size, and this rank's first intermediate feature, its count, and
        every rank's."""
        rows = self.rows
        return self.num_experts, self.w2.shape[1], rows.start, rows.length, rows.total

    def load_tensor(self, name: str, source: TensorSlices, hf_name: str) -> list[str]:
        experts, hidden, start, length, intermediate = self._shape()
        # The rank's gate/up features are interleaved pairs: 2 * length of them from 2 * start.
        pairs = Rows(2 * start, 2 * length, 2 * intermediate)
        if name == "gate_up_proj_bias":
            bias = read_slice(source, [experts, 2 * length], hf_name, 1, pairs)
            self.w13_bias.copy_(_deinterleave(bias, dim=1))
        elif name == "down_proj_bias":
            self.w2_bias.copy_(read_slice(source, [experts, hidden], hf_name))
        elif name == "gate_up_proj":  # [E, H, 2I]
            weight = read_slice(source, [experts, hidden, 2 * length], hf_name, 2, pairs)
            self._store("w13", slice(None), slice(None), _deinterleave(weight.transpose(1, 2), 1))
        elif name == "down_proj":  # [E, I, H]
            weight = read_slice(source, [experts, length, hidden], hf_name, 1, self.rows)
            self._store("w2", slice(None), slice(None), weight.transpose(1, 2).contiguous())
        elif name.endswith(_MXFP4_PARTS) and name.rpartition("_")[0] in _MATRICES:
            return self._load_mxfp4(name, source, hf_name)
        else:
            raise ValueError(f"checkpoint has a tensor the model does not: {hf_name}")
        return [_BIASES.get(name) or _MATRICES[name]]

    def _load_mxfp4(self, name: str, source: TensorSlices, hf_name: str) -> list[str]:
        """Read this rank's part of an MXFP4 matrix's blocks or scales; once both are read,
        dequantize them into the matrix, or (MXFP4 experts) store them as they are."""
        matrix, _, part = name.rpartition("_")
        experts, hidden, start, length, intermediate = self._shape()
        if matrix == "gate_up_proj":  # rows: the interleaved features; columns H
            rows, groups = Rows(2 * start, 2 * length, 2 * intermediate), hidden // BLOCK
            shape, dim = [experts, 2 * length, groups], 1
        else:  # rows H; columns: the whole blocks that hold this rank's features
            first, end = start // BLOCK, -(-(start + length) // BLOCK)
            rows, shape, dim = (
                Rows(first, end - first, intermediate // BLOCK),
                [experts, hidden, end - first],
                2,
            )
        if part == "blocks":
            shape = [*shape, BLOCK // 2]
        pending = self._pending.setdefault(matrix, {})
        pending[part] = read_slice(source, shape, hf_name, dim, rows)
        if len(pending) < 2:
            return []
        del self._pending[matrix]
        if self.mxfp4:
            self._store_mxfp4(matrix, pending["blocks"], pending["scales"])
            return [_MATRICES[matrix]]
        # On the model's device, in bfloat16, which holds every MXFP4 value exactly: a
        # layer's experts are GBs in float32 (gpt-oss-120b's gate/up: 8.5 GB).
        device = self.w13.device
        blocks, scales = pending["blocks"].to(device), pending["scales"].to(device)
        weight = dequantize_mxfp4(blocks, scales, torch.bfloat16)
        if matrix == "gate_up_proj":
            self._store("w13", slice(None), slice(None), _deinterleave(weight, dim=1))
        else:
            offset = start - rows.start * BLOCK
            self._store(
                "w2", slice(None), slice(None), weight[..., offset : offset + length].contiguous()
            )
        return [_MATRICES[matrix]]

    def _store_mxfp4(self, matrix: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """A rank's blocks [E, rows, G, 16] and scales [E, rows, G] of ``matrix`` into the
        packed experts: the gate/up rows in the order the dequantized ones take (gate, then
        up); the down projection's columns whole blocks of this rank's features alone
        (``check_mxfp4_experts``)."""
        param = _MATRICES[matrix]
        if matrix == "gate_up_proj":
            blocks, scales = _deinterleave(blocks, dim=1), _deinterleave(scales, dim=1)
        getattr(self, param).copy_(blocks.flatten(-2))
        getattr(self, f"{param}_scale").copy_(scales)

    def missing(self, loaded: set[str]) -> list[str]:
        return [key for key in ("w13", "w2", "w13_bias", "w2_bias") if key not in loaded]

    def load_random(self, generator: torch.Generator, std: float) -> None:
        super().load_random(generator, std)
        self.w13_bias.zero_()
        self.w2_bias.zero_()


def _deinterleave(features: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up features along ``dim`` (gate even, up odd) as the gate's, then
    the up's, contiguous."""
    pairs = features.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssMoeBlock(SparseMoeBlock):
    router_bias = True
    experts_class = GptOssExperts


class GptOssForCausalLM(MoECausalLM):
    attention_class = SinkAttention
    moe_block_class = GptOssMoeBlock
    checkpoint_renames: Mapping[str, str] = {
        "router": "gate",
        # A head's sink is a parameter of the attention in the checkpoint; here the
        # vector of this rank's heads (``PerHeadVector``).
        "sinks": "sinks.weight",
    }


def _gpt_oss_config(config: Mapping[str, Any], path: Path) -> GptOssConfig:
    if not config.get("attention_bias", True):
        raise ValueError(
            f"{path / CONFIG_JSON}: gpt-oss without attention biases (attention_bias false) is "
            "not supported"
        )
    values = ConfigValues(config, path)
    quantization = values.section("quantization_config")
    mxfp4_experts = quantization.get("quant_method") == "mxfp4"
    if mxfp4_experts:
        # The published experts: dequantized to the model's dtype as they load, unless
        # --quantization mxfp4 keeps them; the linear layers are not quantized either way.
        config = {key: value for key, value in config.items() if key != "quantization_config"}
    fields = hf_config_fields(config, path, _ROPE_THETA)
    window = values.optional_size("sliding_window")
    layer_types = config.get("layer_types") or [
        SLIDING_ATTENTION if layer % 2 == 0 else FULL_ATTENTION
        for layer in range(fields["num_hidden_layers"])
    ]
    num_experts, experts_per_token = expert_counts(values, "num_local_experts")
    return GptOssConfig(
        **fields,
        sliding_window=window,
        layer_types=layer_types if window is not None else None,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=fields["intermediate_size"],  # the experts' own
        norm_topk_prob=True,  # a softmax over the top k sums to one
        swiglu_alpha=values.optional_number("swiglu_alpha", 1.702),
        swiglu_limit=values.optional_number("swiglu_limit", 7.0),
        mxfp4_experts=mxfp4_experts,
    )


def check_mxfp4_experts(requested: str | None, checkpoint: Checkpoint, tp_size: int) -> None:
    """Refuse ``--quantization mxfp4`` (``requested``) at start, in one line saying why and
    what to use instead, unless the checkpoint is gpt-oss's from Hugging Face with MXFP4
    experts whose packed dimensions split over ``tp_size`` ranks in whole 32-value blocks
    (the down projection's is the intermediate features: gpt-oss's 2880, 90 blocks, split
    over 2 ranks but not 4)."""
    if requested != MXFP4:
        return
    config = checkpoint.config
    if checkpoint.gguf:
        raise ValueError(
            f"--quantization mxfp4 reads gpt-oss's MXFP4 experts from its Hugging Face "
            f"checkpoint, not from a GGUF file ({checkpoint.name}): leave --quantization out"
        )
    if not isinstance(config, GptOssConfig):
        raise ValueError(
            f"--quantization mxfp4 keeps gpt-oss's MXFP4 experts as published; "
            f"{config.architecture} is not gpt-oss: use --quantization fp8 or int8, or leave "
            "it out"
        )
    if not config.mxfp4_experts:
        raise ValueError(
            f"--quantization mxfp4: {checkpoint.name}'s experts are not MXFP4 (its "
            "quantization_config is not mxfp4): leave --quantization out, or use fp8"
        )
    intermediate = config.moe_intermediate_size
    if intermediate % (tp_size * BLOCK):
        raise ValueError(
            f"--quantization mxfp4 over {tp_size} ranks: a rank's share of the {intermediate} "
            f"intermediate features ({intermediate // BLOCK} blocks of {BLOCK}) is not whole "
            "blocks; use a tensor-parallel size that divides the blocks, or leave "
            "--quantization out (the experts dequantized as they load)"
        )


GPT_OSS = ModelFamily(GptOssForCausalLM, _gpt_oss_config)
