"""Sampling's random numbers: a pure function of (request seed, output index, token id).

A counter-based hash instead of a generator per request, so a seeded request gives the same
tokens whatever else shares its batch, and a whole batch's numbers come at once with no
Python loop over rows. ``StepOps.sample_rows`` runs the exponential race on them; the torch
backend computes them here as tensors, the Triton backend's kernel the same bits in
registers (``engine/backends/triton/argmax.py``), so both draw the same token for a seeded
request up to float32 rounding near a tie.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# The hash's constants, which the Triton kernel repeats.
MIX_MULTIPLIER = 0x45D9F3B
SEED_HIGH_SALT = 0x5BD1E995
COLUMN_MULTIPLIER = 0x9E3779B1


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' two-round multiply-xorshift), on int64 lanes.

    The multiplier is under 2**27 and lanes under 2**32, so products never overflow int64.
    """
    x = x ^ (x >> 16)
    x = (x * MIX_MULTIPLIER) & MASK32
    x = x ^ (x >> 16)
    x = (x * MIX_MULTIPLIER) & MASK32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit key [B] (int64 lanes) from its seed and output index [B] (int64)."""
    key = mix32(seed & MASK32) ^ mix32((seed >> 32) & MASK32 ^ SEED_HIGH_SALT)
    return mix32((key + mix32(step & MASK32)) & MASK32)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1), determined by each row's (seed, step) and the column."""
    column = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    column_key = (column * COLUMN_MULTIPLIER) & MASK32
    bits = mix32(mix32(row_keys(seed, step).unsqueeze(1) ^ column_key.unsqueeze(0)))
    return unit_interval(bits)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 in (0, 1), both ends excluded: the top 23 bits k give
    (k + 0.5) / 2^23, exact in float32. (With 24 bits the largest, 1 - 2^-25, rounds to 1.0:
    its exponential race is 0, a forbidden token's 0 / 0 is NaN, and argmax picks the NaN.
    About one sampled row in 340 of a 49k vocabulary broke its grammar that way.)"""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def race_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """``StepOps.sample_rows`` in PyTorch (the reference): each row's argmax where its
    temperature is 0, else the exponential race's winner, argmax_i p_i / E_i of the softmax p
    at its temperature, E_i = -log U_i of ``uniform_noise``: token i wins with probability
    p_i."""
    greedy_tokens = logits.argmax(dim=-1)
    is_greedy = temperature == 0
    temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    race = uniform_noise(seed, step, logits.shape[1]).log_().neg_()
    return torch.where(is_greedy, greedy_tokens, (probs / race).argmax(dim=-1))
