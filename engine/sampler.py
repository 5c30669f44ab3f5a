"""Choosing the next token of every sequence in the batch at once.

Randomness is a pure function of (request seed, output index, token id): a counter-
based hash instead of a generator per request, so a seeded request gives the same
tokens whatever else shares its batch, and the whole batch samples in a few tensor
operations with no Python loop over rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class Penalties:
    """OpenAI's presence and frequency penalties of a step's rows, on the logits' device."""

    counts: torch.Tensor  # [B, V] float32: how often each row has generated each token
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32


@dataclass
class LogitBias:
    """OpenAI's logit_bias of a step's rows, sparse: add ``values`` at (``rows``, ``token_ids``)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a step that samples at least one row, on the logits'
    device. A step whose rows are all greedy needs none (``sample(logits, None)``)."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 for no cut
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, index of the token being sampled in the request's output
    any_top_k_or_p: bool  # a host-side fact that lets a step skip the sort
    penalties: Penalties | None = None  # None when no row has one
    logit_bias: LogitBias | None = None  # None when no row has one


def sample(logits: torch.Tensor, params: SamplingTensors | None) -> torch.Tensor:
    """Token ids [B] (int64) from float32 logits [B, V]; ``params`` None: all rows greedy."""
    if params is None:
        return logits.argmax(dim=-1)
    if params.penalties is not None:
        logits = apply_penalties(logits, params.penalties)
    if params.logit_bias is not None:
        bias = params.logit_bias
        # A copy (index_put, not index_put_): the raw logits serve logprobs.
        logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
    greedy_tokens = logits.argmax(dim=-1)
    is_greedy = params.temperature == 0
    temperature = torch.where(is_greedy, torch.ones_like(params.temperature), params.temperature)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
    race = uniform_noise(params.seed, params.step, logits.shape[1]).log_().neg_()
    if params.any_top_k_or_p:
        probs = _apply_top_k_top_p(probs, params.top_k, params.top_p)
    sampled_tokens = (probs / race).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled_tokens)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """The logits less each row's presence penalty for every token it has generated and its
    frequency penalty times how often (new tensor: the raw logits serve logprobs)."""
    counts = penalties.counts
    return (
        logits
        - penalties.frequency.unsqueeze(1) * counts
        - penalties.presence.unsqueeze(1) * (counts > 0).float()
    )


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under the raw distribution of float32 ``logits`` [B, V] (no temperature, no cuts):
    the log-probability [B] of each row's token, and the ``num_top`` likeliest tokens'
    log-probabilities and ids [B, num_top], likeliest first."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_logprobs, top_ids


def _apply_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    # A token stays if the mass ranked above it is below top_p (so the top token always stays).
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p.unsqueeze(1)
    keep &= (top_k.unsqueeze(1) == 0) | (rank < top_k.unsqueeze(1))
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' two-round multiply-xorshift), on int64 lanes.

    The multiplier is under 2**27 and lanes under 2**32, so products never overflow int64.
    """
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 in (0, 1), determined by each row's (seed, step) and the column."""
    row_key = _mix32(seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32 ^ 0x5BD1E995)
    row_key = _mix32((row_key + _mix32(step & _MASK32)) & _MASK32)
    column = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    column_key = (column * 0x9E3779B1) & _MASK32
    bits = _mix32(_mix32(row_key.unsqueeze(1) ^ column_key.unsqueeze(0)))
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))
