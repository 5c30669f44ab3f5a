"""Mixture-of-experts layers: a router picks each token's top-k experts, each a gated MLP of
its own, and the token's output is their outputs weighed by the router (Qwen3-MoE, Mixtral).

- routing: softmax of the router's logits in float32, the top k, renormalized to sum to one
  where the model does (Qwen3's ``norm_topk_prob``; Mixtral always): the layer ops'
  ``moe_route``;
- ``FusedExperts``: every expert's gate/up rows stacked into ``w13`` [E, 2 * I, H] and its
  down projection into ``w2`` [E, H, I], multiplied by the layer ops' ``moe_experts`` (a
  fused kernel in the Triton backend, the reference in the torch one);
- ``SparseMoeBlock``: the router and the experts, in a decoder layer in place of the MLP;
- ``MoECausalLM``: the decoder whose layers take one, or the MLP on the layers that a config
  leaves dense.

Tensor parallelism splits each expert's matrices as it splits a dense MLP (docs/multi-gpu.md
says why not whole experts over the ranks): a rank holds its share of every expert's
intermediate features, rows of ``w13`` and columns of ``w2``, and the ranks' partial
outputs are summed (one all-reduce). Every rank routes every token alike, the router being
whole on each.

Checkpoints store one tensor an expert and a projection (``experts.3.gate_proj.weight``),
llama.cpp's GGUF files one an projection for all experts (``ffn_gate_exps``, which the family
names ``experts.gate_proj.weight``); either is read a slice at a time into the stacked
matrices (``FusedExperts.load_tensor``), quantized to FP8 per output channel as it loads
under ``--quantization fp8``. Under ``--quantization mxfp4`` the matrices hold MXFP4 as
``LayerOps.moe_experts`` takes it, which only gpt-oss's loader fills (``loads_mxfp4``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.backends.deferred_norm import LinearInput, dense
from engine.backends.fp8 import FP8
from engine.backends.layer_ops import LayerOps
from engine.backends.mxfp4 import BLOCK, E2M1_VALUES
from engine.checkpoint.checkpoint import TensorSlices
from engine.distributed.parallel import TensorParallel
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.layers import MLP, Attention, DecoderLayer
from engine.models.parallel_layers import Rows, read_slice
from engine.quantization.linear_methods import MXFP4, quantize_per_channel


@dataclass(kw_only=True)
class MoEConfig(ModelConfig):
    """A mixture of experts' settings beside a decoder's; ``intermediate_size`` is the dense
    MLP's, on the layers that have one."""

    num_experts: int
    num_experts_per_tok: int  # k, the experts each token is routed to
    moe_intermediate_size: int  # each expert's I
    norm_topk_prob: bool  # the k weights renormalized to sum to one
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts


class Router(nn.Module):
    """The router's linear layer [E, H] (and ``bias`` [E], gpt-oss's), whole on every rank,
    in the model's dtype."""

    def __init__(self, config: MoEConfig, ops: LayerOps, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if bias else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


# A checkpoint tensor of the experts, relative to their module: one expert's
# ("3.gate_proj.weight") or every expert's stacked ("gate_proj.weight", GGUF's).
_EXPERT_TENSOR = re.compile(r"(?:(?P<expert>\d+)\.)?(?P<projection>\w+)\.weight")
# Each projection's place: the stacked matrix, and the part of its rows (gate, then up).
_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


class FusedExperts(nn.Module):
    """Every expert of a layer, stacked: ``w13`` [E, 2 * I_rank, H] and ``w2`` [E, H,
    I_rank], a rank's ``I_rank`` of each expert's intermediate features; in the model's dtype,
    or FP8 codes with float32 scales per output channel (``w13_scale``, ``w2_scale``), or
    MXFP4 (``--quantization mxfp4``, a family whose loader reads it: ``loads_mxfp4``): uint8
    ``w13`` [E, 2 * I_rank, H / 2] and ``w2`` [E, H, I_rank / 2], two values a byte, with
    uint8 e8m0 scales ``w13_scale`` [E, 2 * I_rank, H / 32] and ``w2_scale`` [E, H,
    I_rank / 32] (``LayerOps.moe_experts``)."""

    # Whether the family's ``load_tensor`` fills MXFP4 experts (gpt-oss's, as published).
    loads_mxfp4 = False

    def __init__(self, config: MoEConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        quantization = config.quantization
        self.mxfp4 = quantization is not None and quantization.method == MXFP4
        if self.mxfp4 and not self.loads_mxfp4:
            raise ValueError(
                "--quantization mxfp4 keeps gpt-oss's MXFP4 experts as published; this "
                "model's experts are not: use --quantization fp8, or leave it out"
            )
        if (
            not self.mxfp4
            and quantization is not None
            and (quantization.method != "fp8" or quantization.checkpoint_scales)
        ):
            raise ValueError(
                "expert weights load as stored or quantized to fp8 as they load "
                "(--quantization fp8); int8 and pre-quantized experts are not supported"
            )
        experts, hidden = config.num_experts, config.hidden_size
        start, length = tp.split(config.moe_intermediate_size, "moe_intermediate_size")
        self.rows = Rows(start, length, config.moe_intermediate_size)
        self.num_experts = experts
        self.experts_per_token = config.num_experts_per_tok
        self.ops = ops
        if self.mxfp4:
            self._create_mxfp4(experts, hidden, length)
            return
        dtype = None if quantization is None else FP8  # None: the model's
        self.w13 = nn.Parameter(
            torch.empty(experts, 2 * length, hidden, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(experts, hidden, length, dtype=dtype), requires_grad=False
        )
        if quantization is None:
            self.w13_scale = self.w2_scale = None
        else:
            self.register_buffer("w13_scale", torch.empty(experts, 2 * length, dtype=torch.float32))
            self.register_buffer("w2_scale", torch.empty(experts, hidden, dtype=torch.float32))

    def _create_mxfp4(self, experts: int, hidden: int, length: int) -> None:
        """MXFP4 matrices and their scales, as ``LayerOps.moe_experts`` takes them; the scales
        are buffers, as FP8's are (the roofline counts them with the experts)."""
        self.w13 = nn.Parameter(
            torch.empty(experts, 2 * length, hidden // 2, dtype=torch.uint8), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(experts, hidden, length // 2, dtype=torch.uint8), requires_grad=False
        )
        for name, shape in (
            ("w13_scale", (experts, 2 * length, hidden // BLOCK)),
            ("w2_scale", (experts, hidden, length // BLOCK)),
        ):
            self.register_buffer(name, torch.empty(shape, dtype=torch.uint8))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of each token's weighed sum over its experts."""
        return self.ops.moe_experts(
            x, weights, ids, self.w13, self.w2, self.w13_scale, self.w2_scale
        )

    def load_tensor(self, name: str, source: TensorSlices, hf_name: str) -> list[str]:
        """Load checkpoint tensor ``name`` (relative to this module: one expert's or all of
        them stacked), this rank's rows of it only; the parts it filled (``missing``)."""
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None or match["projection"] not in _PROJECTIONS:
            raise ValueError(f"checkpoint has a tensor the model does not: {hf_name}")
        param, part = _PROJECTIONS[match["projection"]]
        length = self.rows.length
        if param == "w13":  # the rank's rows of the gate's or the up projection's
            dim, shape, rows = (
                0,
                [length, self.w13.shape[2]],
                slice(part * length, (part + 1) * length),
            )
        else:  # its columns of the down projection's
            dim, shape, rows = 1, list(self.w2.shape[1:]), slice(None)
        if match["expert"] is None:  # every expert's, stacked
            experts = range(self.num_experts)
            dim, shape = dim + 1, [self.num_experts, *shape]
        else:
            experts = range(int(match["expert"]), int(match["expert"]) + 1)
            if experts.start >= self.num_experts:
                raise ValueError(f"{hf_name}: the model has {self.num_experts} experts")
        weight = read_slice(source, shape, hf_name, dim, self.rows)
        self._store(param, slice(experts.start, experts.stop), rows, weight)
        return [f"{param}.{expert}.{part}" for expert in experts]

    def missing(self, loaded: set[str]) -> list[str]:
        """The parts of ``w13`` and ``w2`` not among those ``load_tensor`` said it filled."""
        expected = [
            f"{param}.{expert}.{part}"
            for param, part in _PROJECTIONS.values()
            for expert in range(self.num_experts)
        ]
        return [key for key in expected if key not in loaded]

    def load_random(self, generator: torch.Generator, std: float) -> None:
        """Weights drawn from N(0, std), in float32, then stored as ``load_tensor`` stores;
        MXFP4: random codes, every block scaled to about std."""
        if self.mxfp4:
            self._load_random_mxfp4(generator, std)
            return
        for param in ("w13", "w2"):
            target = getattr(self, param)
            weight = torch.empty(target.shape, dtype=torch.float32, device=target.device)
            weight.normal_(0.0, std, generator=generator)
            self._store(param, slice(None), slice(None), weight)

    def _load_random_mxfp4(self, generator: torch.Generator, std: float) -> None:
        """Uniformly random bytes, every scale the power of two nearest to std over the
        codes' root mean square (in units of their block's scale)."""
        code_rms = (sum(value**2 for value in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5
        exponent = 127 + round(math.log2(std / code_rms))
        for param in ("w13", "w2"):
            codes = getattr(self, param)
            codes.copy_(
                torch.randint(
                    0, 256, codes.shape, generator=generator, dtype=torch.uint8, device=codes.device
                )
            )
            getattr(self, f"{param}_scale").fill_(exponent)

    def _store(self, param: str, experts: slice, rows: slice, weight: torch.Tensor) -> None:
        """``weight`` [experts, rows, columns] (or one expert's [rows, columns]) into
        ``param``'s ``experts`` and output ``rows``; quantized per output channel on the
        device, if FP8."""
        target = getattr(self, param)[experts, rows]
        if self.w13_scale is None:
            target.copy_(weight.view(target.shape))
            return
        scale = getattr(self, f"{param}_scale")[experts, rows]
        rows_of = weight.to(target.device).reshape(-1, weight.shape[-1])
        codes, scales = quantize_per_channel(rows_of, FP8)
        target.copy_(codes.view(target.shape))
        scale.copy_(scales.view(scale.shape))


class SparseMoeBlock(nn.Module):
    """A decoder layer's mixture of experts: the router (``gate``, as checkpoints name it)
    and the experts, in place of the MLP."""

    # The router and the experts read the norm's output as a tensor: no linear layer's
    # method takes the norm before them (``RMSNorm.reader``).
    input_method = None
    # What a family changes (gpt-oss: a router with a bias, experts with biases).
    router_bias = False
    experts_class: type[FusedExperts] = FusedExperts

    def __init__(self, config: MoEConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        self.gate = Router(config, ops, self.router_bias)
        self.experts = self.experts_class(config, ops, tp)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.ops = ops
        self.tp = tp

    def forward(self, x: LinearInput) -> torch.Tensor:
        out, _ = self.into_stream(x, None)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts' float32 weights and int32 ids, [T, top_k] each."""
        return self.ops.moe_route(self.gate(x), self.top_k, self.renormalize)

    def into_stream(
        self, x: LinearInput, stream: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output and what is left of the residual stream for the next norm to
        add: all of it (as ``MLP.into_stream`` leaves it but where its one-row product adds
        it), but where the ranks' all-reduce adds it (``TensorParallel.all_reduce_into_stream``)."""
        x = dense(x)
        weights, ids = self.route(x)
        return self.tp.all_reduce_into_stream(self.experts(x, weights, ids), stream)


class MoECausalLM(CausalLM):
    """A decoder whose layers' MLP is a ``SparseMoeBlock`` (``moe_block_class``), but on
    the config's ``dense_layers``. A family names its checkpoint's modules where they differ
    from Qwen3-MoE's (``checkpoint_renames``)."""

    config: MoEConfig
    moe_block_class: type[SparseMoeBlock] = SparseMoeBlock

    def decoder_layer(
        self, index: int, attention: Attention, ops: LayerOps, tp: TensorParallel
    ) -> nn.Module:
        config = self.config
        dense_mlp = index in config.dense_layers
        mlp = MLP(config, ops, tp) if dense_mlp else self.moe_block_class(config, ops, tp)
        return DecoderLayer(config, attention, ops, tp, mlp)
