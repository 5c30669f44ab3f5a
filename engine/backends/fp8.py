"""The float8 e4m3 format that FP8 weights and activations are quantized to: its dtype, its
largest value, and the scale of an all-zero row (any scale gives zero codes there)."""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1e-12
