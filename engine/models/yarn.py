"""YaRN's RoPE scaling (https://arxiv.org/abs/2309.00071), as transformers computes it for
``"rope_type": "yarn"`` (gpt-oss; ``_compute_yarn_parameters`` in its modeling_rope_utils).

Each frequency pair of the head is interpolated (divided by ``factor``), extrapolated (kept)
or a linear blend of the two, by how many rotations it makes over the original context:
those that turn more than ``beta_fast`` times are kept, fewer than ``beta_slow`` times
interpolated. cos and sin are then scaled by the attention factor, which sharpens the
softmax back to what it was at the original length.
"""

from __future__ import annotations

import math

import torch

from engine.model_config import YarnScaling


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """The factor cos and sin are multiplied by: the config's, or 0.1 ln(factor) + 1 (with
    DeepSeek's ``mscale`` and ``mscale_all_dim``, their ratio)."""
    if yarn.attention_factor is not None:
        return yarn.attention_factor

    def scale_of(mscale: float) -> float:
        return 1.0 if yarn.factor <= 1 else 0.1 * mscale * math.log(yarn.factor) + 1.0

    if yarn.mscale and yarn.mscale_all_dim:
        return scale_of(yarn.mscale) / scale_of(yarn.mscale_all_dim)
    return scale_of(1.0)


def yarn_inverse_frequencies(head_dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, as transformers' (float32 throughout), on
    the CPU (a model is built on the meta device)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    wavelengths = theta**exponents  # over 2 pi
    extrapolated = 1.0 / wavelengths
    interpolated = 1.0 / (yarn.factor * wavelengths)

    def band_end(rotations: float) -> float:
        """The dimension whose wavelength fits ``rotations`` times in the original context."""
        context = yarn.original_max_position_embeddings
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = band_end(yarn.beta_fast), band_end(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against dividing by zero
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency extrapolated
    return interpolated * (1 - kept) + extrapolated * kept
