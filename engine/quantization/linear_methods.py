"""Quantized linear layers: how a weight is stored, loaded and multiplied.

The linear layers of ``engine.models.parallel_layers`` (QKV, O, gate/up, down) hold a
``LinearMethod`` and call it for everything about their weight; they never ask which one
it is. Embeddings, norms and the LM head stay in the model's dtype.

A method holds the model's layer ops (``engine.backends.layer_ops.LayerOps``, the chosen
backend's) and asks them for every product: which kernel multiplies (the Triton backend's
one-row kernel for one CUDA row, its weight-only and FP8 quantization kernels on CUDA;
PyTorch's ops in the torch backend, on any device) is the backend's choice, never made here.

- ``LinearMethod``: the weight in the model's dtype, the ops' ``linear``.
- ``Fp8Linear`` (``--quantization fp8``, compute capability >= 8.9, or the CPU): float8 e4m3
  weights with one float32 scale per output channel. A step of more than
  ``WEIGHT_ONLY_MAX_TOKENS`` tokens quantizes its activations per token, dynamically (the
  ops' ``quantize_fp8``, a gated MLP's activation and a deferred norm included where the
  ops compute them in the same kernel), and multiplies in FP8 (the ops' ``fp8_matmul``,
  ``torch._scaled_mm``); smaller ones, decode at small batch, read the FP8 weight into a
  GEMM that dequantizes it as it goes (the ops' ``weight_only_matmul``).
- ``Int8Linear`` (``--quantization int8``): int8 weights, one scale per output channel,
  activations in the model's dtype (W8A16), dequantized inside the GEMM.
- ``--quantization mxfp4`` leaves every linear layer as ``LinearMethod`` has it: it keeps
  gpt-oss's MXFP4 experts as published (``engine.models.gpt_oss``), not the linear layers.

Why ``WEIGHT_ONLY_MAX_TOKENS = 16``: at a few tokens a GEMM is bound by the weight's bytes,
which both paths read once at one byte an element, so the weight-only path wins by skipping
the activation's quantization (three small kernels a layer) and the FP8 GEMM's poor tiling of
a handful of rows; 16 rows are one tile of the tensor cores' smallest shape, past which the
FP8 GEMM's compute rate starts to count. ``tandem bench quantization --kernels``
measures both paths at each size so the rule can be checked on a GPU.

Weights are quantized as they load, each rank's slice of each checkpoint tensor on its
own (so a row-parallel layer's scales are those of its own input columns, and the fused
projections' parts are quantized row by row), with nothing allocated during a step but
what a CUDA graph's pool holds. A pre-quantized FP8 checkpoint (``Quantization.
checkpoint_scales``) loads its FP8 weights as they are and its scales, per tensor or per
channel, into per-channel scales: a part's per-tensor scale repeated over its rows, exact.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.backends.deferred_norm import DeferredNorm, LinearInput, dense
from engine.backends.fp8 import FP8, FP8_MAX, MIN_SCALE, WEIGHT_ONLY_MAX_TOKENS
from engine.backends.layer_ops import LayerOps
from engine.backends.pytorch import with_bias
from engine.distributed.parallel import OneKernelAllReduce
from engine.model_config import Quantization

MXFP4 = "mxfp4"  # gpt-oss's experts kept in MXFP4 for the MoE kernels to read
QUANTIZATION_METHODS = ("fp8", "int8", MXFP4)
INT8_MAX = 127
# Scales of FP8 checkpoints that nothing here reads: static activation scales (activations
# are quantized per token) and the KV cache's (stored unscaled, --kv-cache-dtype).
UNREAD_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


def resolve_quantization(
    requested: str | None, stored: Quantization | None, device: torch.device
) -> Quantization | None:
    """The model's quantization: the ``--quantization`` asked for (None: the checkpoint's),
    checked against what the checkpoint stores and what the device can run."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {requested!r}, not one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if stored is not None and requested not in (None, stored.method):
        raise ValueError(
            f"the checkpoint is quantized to {stored.method}; it cannot load as {requested}"
        )
    quantization = stored or (None if requested is None else Quantization(requested))
    if quantization is not None and quantization.method == "fp8":
        require_fp8(device)
    return quantization


def require_fp8(device: torch.device) -> None:
    """FP8 GEMMs need an Ada or Hopper GPU (compute capability 8.9) or later; the CPU runs
    them too (slowly, for tests)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"--quantization fp8 needs a GPU of compute capability 8.9 or later (Ada, "
            f"Hopper); this one is {major}.{minor}: use --quantization int8"
        )


def linear_method(quantization: Quantization | None, ops: LayerOps) -> LinearMethod:
    """The method of every quantized linear layer of a model so quantized, multiplying with
    the model's layer ops."""
    if quantization is None or quantization.method == MXFP4:
        return LinearMethod(ops)
    if quantization.method == "fp8":
        return Fp8Linear(ops, quantization.checkpoint_scales)
    return Int8Linear(ops)


def quantize_per_channel(
    weight: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] as ``dtype`` (float8 e4m3 or int8) codes and one float32 scale per
    row: ``weight ≈ codes * scale[:, None]``, each row's largest magnitude mapped to the
    format's largest value (int8's rounded to nearest)."""
    weight = weight.float()
    largest = FP8_MAX if dtype == FP8 else INT8_MAX
    scale = weight.abs().amax(dim=1).clamp(min=MIN_SCALE) / largest
    scaled = weight / scale[:, None]
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.clamp(-largest, largest).to(dtype), scale


class LinearMethod:
    """A linear layer's weight in the model's dtype: the layer ops' ``linear``."""

    def __init__(self, ops: LayerOps) -> None:
        self.ops = ops

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> None:
        """Register the layer's ``weight`` (and whatever goes with it), not yet filled."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size))

    def load_weight(self, layer: nn.Module, rows: slice, weight: torch.Tensor) -> None:
        """Fill the layer's output rows ``rows`` from this rank's part of a checkpoint
        tensor (on the CPU, as stored)."""
        layer.weight[rows].copy_(weight)

    def load_scale(self, layer: nn.Module, rows: slice, scale: torch.Tensor) -> None:
        raise ValueError("the checkpoint has weight scales, but its weights are not quantized")

    def apply(self, layer: nn.Module, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's output for ``x`` [T, K] (or a deferred norm of one row, or of the rows
        ``takes_deferred_norm`` asked for), ``bias`` added if not None."""
        return self.ops.linear(x, layer.weight, bias)

    def takes_deferred_norm(self, num_rows: int) -> bool:
        """Whether a norm of ``num_rows`` rows (more than one) before this layer is best left
        to it (``DeferredNorm``): where the rows are read by a kernel that can compute it."""
        return False

    def apply_silu_gated(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """The layer's output for silu(gate) * up of ``gate_up`` [T, 2K] (a gated MLP's down
        projection); one row the ops' one-row product takes applies the activation inside
        the product."""
        if self.ops.takes_one_row(gate_up):
            return self.one_row_silu_gated(layer, gate_up)
        return self.apply(layer, self.ops.silu_and_mul(gate_up), None)

    def one_row_silu_gated(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """``apply_silu_gated`` of one row (``LayerOps.takes_one_row``), the activation
        applied as it is read."""
        return self.ops.one_row_matmul(gate_up, layer.weight, gated=True)

    def one_row_into_stream(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        stream: torch.Tensor,
        *,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        all_reduce: OneKernelAllReduce | None = None,
    ) -> torch.Tensor:
        """``stream + apply(layer, x, bias)`` for one row ``x`` that the ops' one-row product
        takes (``gated``: of silu(gate) * up of its halves, as ``apply_silu_gated``), the
        residual stream [1, N] added by that product as it stores it, rounded as the sum of
        the stored product (and bias) and the stream rounds: a layer's o and down
        projections, with nothing left for the next norm to add. ``all_reduce``: the product
        is this rank's share of a sum over the ranks, which the product all-reduces before
        the stream joins it (``TensorParallel.one_row_all_reduce``)."""
        row, weight, scale = self.one_row_operands(layer, x)
        return self.ops.one_row_matmul(
            row, weight, scale, gated=gated, bias=bias, add=stream, all_reduce=all_reduce
        )

    def one_row_operands(
        self, layer: nn.Module, x: LinearInput
    ) -> tuple[LinearInput, torch.Tensor, torch.Tensor | None]:
        """What a one-row product multiplies for ``apply`` of one row ``x``: the row (a
        deferred norm where this method leaves it to the product), the weight and its float32
        scales (None: the weight is in x's dtype). For kernels that do more with the product
        (the Triton backend's ``one_row_qkv``)."""
        return x, layer.weight, None


class QuantizedLinear(LinearMethod):
    """Codes of ``dtype`` [N, K] and float32 scales [N], one per output channel.

    A deferred norm of one row (``engine.backends.deferred_norm``) is computed by the norm's
    own kernel before the product: the one-row kernel reads a byte a weight here, so the
    row's vectors, which every program of it reads again, cost more against the weight than
    the norm's launch saves (``scripts/profile_step.py --rounds`` times a batch-1 step)."""

    dtype: torch.dtype

    def __init__(self, ops: LayerOps, checkpoint_scales: bool = False) -> None:
        super().__init__(ops)
        self.checkpoint_scales = checkpoint_scales

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int) -> None:
        codes = torch.empty(output_size, input_size, dtype=self.dtype)
        layer.weight = nn.Parameter(codes, requires_grad=False)
        scale = torch.empty(output_size, dtype=torch.float32)
        if self.checkpoint_scales:
            # A parameter, so that a checkpoint without it fails to load by name.
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:
            layer.register_buffer("weight_scale", scale)

    def load_weight(self, layer: nn.Module, rows: slice, weight: torch.Tensor) -> None:
        if self.checkpoint_scales:
            if weight.dtype != self.dtype:
                raise ValueError(
                    f"a {self.dtype} checkpoint's weight is {weight.dtype}: its layers must "
                    "all be quantized"
                )
            layer.weight[rows].copy_(weight)
            return
        # On the device: quantizing an 8B model's weights on the host would take minutes.
        codes, scale = quantize_per_channel(weight.to(layer.weight.device), self.dtype)
        layer.weight[rows].copy_(codes)
        layer.weight_scale[rows].copy_(scale)

    def load_scale(self, layer: nn.Module, rows: slice, scale: torch.Tensor) -> None:
        target = layer.weight_scale[rows]
        if scale.numel() not in (1, target.numel()):
            raise ValueError(
                f"weight_scale of {scale.numel()} values for {target.numel()} output channels: "
                "only per-tensor or per-channel scales are supported"
            )
        target.copy_(scale.float().reshape(-1).expand(target.numel()))

    def weight_only(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        product = self.ops.weight_only_matmul(x, layer.weight, layer.weight_scale)
        return with_bias(product, bias)

    def one_row_silu_gated(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.weight_only_matmul(gate_up, layer.weight, layer.weight_scale, gated=True)

    def one_row_operands(
        self, layer: nn.Module, x: LinearInput
    ) -> tuple[LinearInput, torch.Tensor, torch.Tensor | None]:
        return dense(x), layer.weight, layer.weight_scale  # the norm by its own kernel


class Int8Linear(QuantizedLinear):
    """W8A16: int8 weights, activations in the model's dtype, dequantized inside the GEMM."""

    dtype = torch.int8

    def apply(self, layer: nn.Module, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        # A deferred norm is computed first, by the norm's kernel (QuantizedLinear).
        return self.weight_only(layer, dense(x), bias)


class Fp8Linear(QuantizedLinear):
    """W8A8 FP8 past ``WEIGHT_ONLY_MAX_TOKENS`` tokens, weight-only at or below it."""

    dtype = FP8

    def apply(self, layer: nn.Module, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.x if isinstance(x, DeferredNorm) else x
        if not takes_w8a8(layer, rows.shape[0]):
            # A deferred norm computed first, by the norm's kernel (QuantizedLinear).
            return self.weight_only(layer, dense(x), bias)
        codes, scale = self.ops.quantize_fp8(x)  # a deferred norm's rows in the same kernel
        product = self.ops.fp8_matmul(codes, scale, layer.weight, layer.weight_scale, rows.dtype)
        return with_bias(product, bias)  # after: _scaled_mm takes none with rowwise scales

    def takes_deferred_norm(self, num_rows: int) -> bool:
        # The W8A8 product's quantization kernel computes the norm as it reads the rows.
        return num_rows > WEIGHT_ONLY_MAX_TOKENS

    def apply_silu_gated(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        # The activation computed where the ops quantize it (in the same kernel, where they
        # have one).
        if not takes_w8a8(layer, gate_up.shape[0]):
            return super().apply_silu_gated(layer, gate_up)
        codes, scale = self.ops.quantize_fp8(gate_up, gated=True)
        return self.ops.fp8_matmul(codes, scale, layer.weight, layer.weight_scale, gate_up.dtype)


def takes_w8a8(layer: nn.Module, num_tokens: int) -> bool:
    """Whether an FP8 layer multiplies ``num_tokens`` rows in FP8 (W8A8) rather than
    weight-only. _scaled_mm takes dimensions that are multiples of 16 (cuBLASLt's FP8
    layouts)."""
    output_size, input_size = layer.weight.shape
    return num_tokens > WEIGHT_ONLY_MAX_TOKENS and (output_size | input_size) % 16 == 0
