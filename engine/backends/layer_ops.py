"""The model's per-token operations: the interface. Norms and the gated activation, and the
linear layers' products: one row's, the weight-only quantized GEMM's, FP8 activations'
quantization and the LM head's float32 logits; a mixture of experts' routing and experts.
(RoPE and the per-head Q/K norms before it are the attention backend's, ``engine.backends.
attention.Rotary``, so that they fuse with the cache write.)

Like ``AttentionBackend``, the model calls these and nothing device-specific: the linear
layers' methods (``engine.quantization.linear_methods``) hold the model's ops and ask them
for every product, so the backend chosen decides which kernel runs, on any device. Each
backend of ``engine.backends`` supplies an implementation: ``TorchLayerOps`` (PyTorch, runs
everywhere, the reference) and ``TritonLayerOps`` (fused kernels). Numerics follow Hugging
Face's Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.backends.deferred_norm import DeferredNorm, LinearInput
from engine.distributed.parallel import OneKernelAllReduce, TensorParallel


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation of gate g and up u: g clamped to at most ``limit``, u
    to [-limit, limit], then (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float
    limit: float


class LayerOps(Protocol):
    # Whether RMSNorm leaves a norm to the linear layer that reads it next, of one row
    # (``takes_one_row``) or of the rows an FP8 layer quantizes (``engine.backends.
    # deferred_norm``): the ops' products must then compute it (``one_row_matmul``,
    # ``quantize_fp8``) or ``normalize`` it.
    defers_norms: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rmsnorm(x) * weight, normalized in float32 over the last dimension."""
        ...

    def rms_norm_round_once(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
    ) -> torch.Tensor:
        """rmsnorm(x) * (weight_offset + weight) with the product in float32 too, rounded to
        x's dtype once at the end (OLMo 2's norm; Gemma's, whose weight_offset is 1), over the
        last dimension; rms_norm rounds before it."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual); x: [T, hidden]."""
        ...

    def add_rms_norm_round_once(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        weight_offset: float = 0.0,
        output_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm_round_once(x + residual), x + residual); x: [T, hidden]. Given
        ``output_norm_weight``, x is rms_norm_round_once(x, output_norm_weight) first (the
        same eps and offset): a sandwich layer's norm of its sublayer's output, the add and
        the next norm, as one step."""
        ...

    def normalize(self, norm: DeferredNorm) -> torch.Tensor:
        """A deferred norm these ops left (only ops that defer norms leave one): its rows
        normalized, and its ``stream`` written (x + residual)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2 * I], gate half first."""
        ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, approximate="tanh") * up of gate_up [T, 2 * I], gate half first."""
        ...

    def linear(
        self, x: LinearInput, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` of x [T, K] and a weight [N, K] in x's dtype."""
        ...

    def linear_float32(self, x: LinearInput, weight: torch.Tensor) -> torch.Tensor:
        """``linear`` without a bias, written as float32 however x is stored (the LM head's
        logits, which sampling reads in float32)."""
        ...

    def takes_one_row(self, x: LinearInput) -> bool:
        """Whether ``x`` is one row that ``one_row_matmul`` multiplies: then a linear layer
        may have it apply a gated activation, add the residual stream, or compute a deferred
        norm (so a norm of such a row may be deferred). Ops without such a product: never."""
        ...

    def one_row_matmul(
        self,
        x: LinearInput,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
        all_reduce: OneKernelAllReduce | None = None,
    ) -> torch.Tensor:
        """For a row ``takes_one_row`` takes only: x [1, K] (``gated``: [1, 2K], the input
        silu(gate) * up of its halves; or a deferred norm of a row) times weight [N, K] in
        x's dtype, or int8 / float8 codes with float32 ``scale`` [N] -> [1, N] in x's
        dtype; ``bias`` [N] added to the rounded product if given, as ``with_bias`` adds it;
        summed over the ranks by ``all_reduce`` if given (one that ``fuses_into_one_row``:
        the product makes it); the residual stream ``add`` [1, N] added to the rounded
        product (or sum) if given."""
        ...

    def weight_only_matmul(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, gated: bool = False
    ) -> torch.Tensor:
        """``x @ (codes * scale[:, None]).T`` of x [M, K] and int8 or float8 e4m3 codes [N, K]
        with float32 scales [N], without the dequantized weight, in x's dtype. ``gated``:
        x [M, 2K], the input silu(gate) * up of its halves."""
        ...

    def quantize_fp8(
        self, x: LinearInput, *, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Activations x [T, K] (a deferred norm's rows normalized; ``gated``: silu(gate) * up
        of x [T, 2K]'s halves) as float8 e4m3 codes [T, K] with one float32 scale per token
        [T, 1]: a W8A8 product's first operand."""
        ...

    def fp8_matmul(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The W8A8 product ``(codes * scale) @ (weight * weight_scale[:, None]).T`` of
        ``quantize_fp8``'s codes [T, K] and scales [T, 1] and an FP8 weight [N, K] with float32
        scales [N], in ``out_dtype``."""
        ...

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts of router logits [T, E]: their softmax
        probabilities (float32, renormalized to sum to one if ``renormalize``) and ids
        (int32), [T, top_k] each, the most probable first (ties: the Triton kernel takes the
        lowest id; the reference, torch.topk's order)."""
        ...

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None,
        expert_offset: int = 0,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        """A mixture-of-experts layer's experts (``engine.models.moe``) for tokens x [T, H]
        routed to experts ``topk_ids`` [T, K] (int32, global ids) with float32 weights
        ``topk_weights`` [T, K]: each token's ``sum_k w_k * (silu(x @ g_e.T) * (x @ u_e.T))
        @ d_e.T``, accumulated in float32, returned [T, H] in x's dtype.

        The experts held here, ``E_local`` of them: ``w13`` [E_local, 2 * I, H], each
        expert's gate rows g_e then its up rows u_e, and ``w2`` [E_local, H, I], its down
        projection d_e; in x's dtype, or float8 e4m3 codes with float32 scales per output
        channel ``w13_scale`` [E_local, 2 * I] and ``w2_scale`` [E_local, H] (None
        otherwise), or MXFP4, which a uint8 ``w13`` means (``engine.backends.mxfp4``; gpt-oss's
        experts under ``--quantization mxfp4``): ``w13`` uint8 [E_local, 2 * I, H / 2] and
        ``w2`` uint8 [E_local, H, I / 2], two 4-bit e2m1 values a byte along each row, the
        lower-indexed one in the low nibble (a checkpoint's ``*_blocks`` with its last two
        dimensions flattened), with uint8 e8m0 scales (the exponent plus 127), one a block of
        32 values of a row: ``w13_scale`` [E_local, 2 * I, H / 32] and ``w2_scale`` [E_local,
        H, I / 32]; H and I whole blocks. Local expert 0 is global expert ``expert_offset``:
        an id outside [expert_offset, expert_offset + E_local) adds nothing (another rank's
        expert).

        gpt-oss's experts (``activation`` a ``ClampedSwiGLU``, None: silu(g) * u) have biases
        in x's dtype: ``w13_bias`` [E_local, 2 * I] added to the gate and up products before
        the activation, ``w2_bias`` [E_local, H] to the down product before its weight."""
        ...

    def one_kernel_all_reduce(
        self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_bytes: int
    ) -> OneKernelAllReduce | None:
        """Tensor parallelism's all-reduce of ``dtype`` tensors up to ``max_bytes`` in one
        kernel over symmetric memory (``engine.distributed.symmetric_all_reduce``), or None
        where these ops have none for ``dtype``. Collective: every rank maps its buffer."""
        ...
