"""The float8 e4m3 format that FP8 weights and activations are quantized to: its dtype, its
largest value, the scale of an all-zero row (any scale gives zero codes there), and the
step size past which FP8 products quantize their activations (W8A8) rather than read the
weights into a GEMM in the model's dtype (``engine.quantization.linear_methods`` says why
16): the dense layers' rule, which the fused MoE kernel follows too. And the W8A8 product
with its scales in the kernel, which both backends run."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12
WEIGHT_ONLY_MAX_TOKENS = 16


def rowwise_scaled_mm(
    codes: torch.Tensor,
    token_scale: torch.Tensor,
    weight: torch.Tensor,
    channel_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """``(codes * token_scale) @ (weight * channel_scale[:, None]).T`` of FP8 codes [T, K] with
    float32 scales [T, 1] and an FP8 weight [N, K] with float32 scales [N], in ``out_dtype``,
    by ``torch._scaled_mm`` with rowwise scales; ``fast_accumulation``: its ``use_fast_accum``
    (``engine.backends.triton.fp8_matmul`` says why the Triton backend takes it)."""
    return torch._scaled_mm(
        codes,
        weight.t(),  # column-major, as _scaled_mm takes its second operand
        scale_a=token_scale,
        scale_b=channel_scale.view(1, -1),
        out_dtype=out_dtype,
        use_fast_accum=fast_accumulation,
    )
