"""Sampling's draw, the reference (``StepOps.sample_rows``): the cuts, the random numbers
and the exponential race, in PyTorch.

Random numbers are a pure function of (request seed, output index, token id): a
counter-based hash instead of a generator per request, so a seeded request gives the same
tokens whatever else shares its batch, and a whole batch's numbers come at once with no
Python loop over rows. A row's token is the race's winner, argmax_i p_i / E_i over the
tokens its cuts keep (min-p, then top-k and top-p, vLLM's order), E_i = -log U_i: token i
wins with probability p_i renormalized over them. The torch backend computes it all here as
tensors (a sort of the vocabulary for top-p, on a CPU of each row's largest k where every
cutting row has a top-k); the Triton backend's kernels hash
the same bits in registers (``engine/backends/triton/argmax.py``, ``nucleus.py``), so both
draw the same token for a seeded request up to float32 rounding near a tie.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

Lanes = TypeVar("Lanes", torch.Tensor, np.ndarray)

MASK32 = 0xFFFFFFFF
# The largest probabilities a CPU's top-p first orders (``_largest_holding_cuts``).
FIRST_LARGEST = 64
# The hash's constants, which the Triton kernel repeats.
MIX_MULTIPLIER = 0x45D9F3B
SEED_HIGH_SALT = 0x5BD1E995
COLUMN_MULTIPLIER = 0x9E3779B1


def mix32(x: Lanes) -> Lanes:
    """A 32-bit integer hash (Wellons' two-round multiply-xorshift), on torch's int64 lanes
    or numpy's uint32 ones.

    The multiplier is under 2**27 and lanes under 2**32, so int64 products never overflow;
    uint32 ones wrap, as the masks make the int64 ones do.
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
    keys = row_keys(seed, step).unsqueeze(1)
    if keys.device.type == "cpu":
        # numpy's uint32 lanes: the same bits several times faster than torch's int64 lanes
        # on a CPU (torch shifts no uint32), where the torch backend draws in production.
        columns = np.arange(vocab_size, dtype=np.uint32) * COLUMN_MULTIPLIER
        bits = mix32(mix32(keys.numpy().astype(np.uint32) ^ columns))
        return torch.from_numpy(unit_interval(bits))
    columns = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    return unit_interval(mix32(mix32(keys ^ ((columns * COLUMN_MULTIPLIER) & MASK32))))


def unit_interval(bits: Lanes) -> Lanes:
    """32-bit hashes (``mix32``'s lanes) as float32 in (0, 1), both ends excluded: the top 23
    bits k give (k + 0.5) / 2^23, exact in float32. (With 24 bits the largest, 1 - 2^-25,
    rounds to 1.0: its exponential race is 0, a forbidden token's 0 / 0 is NaN, and argmax
    picks the NaN. About one sampled row in 340 of a 49k vocabulary broke its grammar that
    way.)"""
    top = bits >> 9
    top = top.float() if isinstance(top, torch.Tensor) else top.astype(np.float32)
    return (top + 0.5) * (1.0 / (1 << 23))


@dataclass(frozen=True)
class Cuts:
    """What a step's sampled rows cut from their distributions, [B] each: top-p (float32, 1
    for none) and top-k (int64, 0 for none), both None when no row has either; min-p
    (float32, 0 for none), None when no row has one."""

    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None


def race_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    cuts: Cuts | None = None,
) -> torch.Tensor:
    """``StepOps.sample_rows`` in PyTorch (the reference): each row's argmax where its
    temperature is 0, else the exponential race's winner, argmax_i p_i / E_i of the softmax p
    at its temperature over what its ``cuts`` keep, E_i = -log U_i of ``uniform_noise``:
    token i wins with probability p_i renormalized."""
    greedy_tokens = logits.argmax(dim=-1)
    if logits.device.type == "cpu" and not temperature.any():
        # Greedy rows shaped by penalties or bans: no random numbers. (On the CPU reading a
        # tensor waits for nothing; on a GPU it would, and the race costs little there.)
        return greedy_tokens
    is_greedy = temperature == 0
    temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    if cuts is not None:
        probs = probs * kept_by_cuts(probs, cuts)
    race = uniform_noise(seed, step, logits.shape[1]).log_().neg_()
    return torch.where(is_greedy, greedy_tokens, (probs / race).argmax(dim=-1))


def kept_by_cuts(probs: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    """Which tokens [B, V] (bool) each row's cuts keep of its probabilities [B, V]: min-p,
    then top-k and top-p over what min-p keeps, renormalized (vLLM's order). The top token
    always stays."""
    kept = torch.ones_like(probs, dtype=torch.bool)
    if cuts.min_p is not None:
        kept = probs >= probs.amax(dim=-1, keepdim=True) * cuts.min_p.unsqueeze(1)
        probs = probs * kept
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if cuts.top_p is None or cuts.top_k is None:
        return kept
    top_p, top_k = cuts.top_p.unsqueeze(1), cuts.top_k.unsqueeze(1)
    uncut = (top_k == 0) & (top_p >= 1)  # rows that neither top-k nor top-p cut
    if probs.device.type == "cpu":
        sorted_probs, order = _largest_holding_cuts(probs, top_p, top_k, uncut)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_probs.shape[1], device=probs.device)
    # A token stays if the mass ranked above it is below top_p; the top token always stays,
    # also where top_p rounds to 0 in float32 (it then kept none). A row of top_p 1 keeps
    # its tail too, which a float32 sum can reach 1 before.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    in_top = (top_p >= 1) | (mass_above < top_p) | (rank == 0)
    in_top &= (top_k == 0) | (rank < top_k)
    return kept & (torch.zeros_like(kept).scatter_(1, order, in_top) | uncut)


def _largest_holding_cuts(
    probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, uncut: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest probabilities, descending, and their tokens: as many as hold what
    every row's top-k and top-p keep. A row's are held by its largest n where n is at least
    its top-k, or where their mass reaches its top-p (the tokens past them have at least that
    much above them). n starts at the largest top-k (at least ``FIRST_LARGEST``) and grows
    fourfold until every row's are held: on a CPU, where asking waits for nothing, a nucleus
    of hundreds of tokens costs a fraction of a sort of the vocabulary, which took most of a
    CPU's draw. (On a GPU asking would wait for the device; the Triton backend sorts
    nothing there anyway.)"""
    vocab_size = probs.shape[1]
    count = min(max(int(top_k.max()), FIRST_LARGEST), vocab_size)
    while True:
        largest, order = probs.topk(count, dim=-1)
        by_top_k = (top_k > 0) & (top_k <= count)
        held = uncut | by_top_k | (largest.sum(dim=-1, keepdim=True) >= top_p)
        if count == vocab_size or bool(held.all()):
            return largest, order
        count = min(4 * count, vocab_size)
