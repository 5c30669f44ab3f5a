"""The float8 e4m3 format that FP8 weights and activations are quantized to: its dtype, its
largest value, the scale of an all-zero row (any scale gives zero codes there), and the
step size past which FP8 products quantize their activations (W8A8) rather than read the
weights into a GEMM in the model's dtype (``engine.quantization.linear_methods`` says why
16): the dense layers' rule, which the fused MoE kernel follows too."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12
WEIGHT_ONLY_MAX_TOKENS = 16
