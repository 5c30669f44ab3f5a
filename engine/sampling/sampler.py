"""Choosing the next token of every sequence in the batch at once.

Here the logits are processed (allowed tokens, bans, bias, penalties) and the cuts named;
the draw itself is the backend's (``StepOps.sample_rows``: the exponential race within
min-p, top-k and top-p, and ``StepOps.argmax_rows`` for an all-greedy step). Randomness is a
pure function of (request seed, output index, token id) (``engine/backends/sampling_draw.py``,
also the torch backend's draw), so a seeded request gives the same tokens whatever else
shares its batch, and the whole batch samples with no Python loop over rows. On CUDA the
Triton backend's kernels compute the random numbers in registers as they read the logits
and cut without sorting them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.penalties import Penalties
from engine.backends.sampling_draw import Cuts
from engine.backends.step_ops import StepOps


@dataclass
class LogitBias:
    """OpenAI's logit_bias of a step's rows, sparse: add ``values`` at (``rows``, ``token_ids``)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass
class AllowedTokens:
    """vLLM's allowed_token_ids of a step's rows, sparse: each ``restricted`` row may sample
    only the ``token_ids`` listed at its index in ``rows``."""

    restricted: torch.Tensor  # [B] bool
    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass
class BannedTokens:
    """Tokens some rows may not sample now, sparse: ``token_ids`` at ``rows``. The first
    ``num_unconditional`` are banned outright (EOS and stop tokens before min_tokens); each of
    the others (a bad word's last token) only right after the rest of its word, its prefix:
    the prefixes' tokens, flat, each with its word (counted from the first conditional entry)
    and the column of its row's ``recent`` where it must be. A word of one token has none."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    prefix_tokens: torch.Tensor  # [P] int64
    prefix_words: torch.Tensor  # [P] int64, in [0, N - num_unconditional)
    prefix_columns: torch.Tensor  # [P] int64, in [0, M)
    recent: torch.Tensor  # [B, M] int64: each row's last M output tokens, -2 where it has fewer
    num_unconditional: int


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a step that samples at least one row, on the logits'
    device. A step whose rows are all greedy needs none (``sample(logits, None, ops)``); every
    optional part is None when no row uses it, and then costs nothing."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 for no cut
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, index of the token being sampled in the request's output
    any_top_k_or_p: bool  # a host-side fact: some row cuts by top-k or top-p (else none is sought)
    penalties: Penalties | None = None
    logit_bias: LogitBias | None = None
    min_p: torch.Tensor | None = None  # [B] float32, 0 for none
    allowed: AllowedTokens | None = None
    banned: BannedTokens | None = None


def sample(logits: torch.Tensor, params: SamplingTensors | None, ops: StepOps) -> torch.Tensor:
    """Token ids [B] (int64) from float32 logits [B, V]; ``params`` None: all rows greedy.
    ``ops``: the backend's, whose ``sample_rows`` draws each row's token (the argmax of a
    greedy row); what the parameters change before it costs only where a row asks for it."""
    if params is None:
        return ops.argmax_rows(logits)
    logits = process_logits(logits, params, ops)
    cuts = None
    if params.min_p is not None or params.any_top_k_or_p:
        top = (params.top_p, params.top_k) if params.any_top_k_or_p else (None, None)
        cuts = Cuts(*top, params.min_p)
    return ops.sample_rows(logits, params.temperature, params.seed, params.step, cuts)


def process_logits(logits: torch.Tensor, params: SamplingTensors, ops: StepOps) -> torch.Tensor:
    """The logits that greedy rows take the argmax of, in vLLM's order: allowed tokens, bans,
    logit bias, penalties (``ops``': the backend's). Each step makes a new tensor: the raw
    logits serve logprobs."""
    if params.allowed is not None:
        logits = apply_allowed_tokens(logits, params.allowed)
    if params.banned is not None:
        logits = apply_bans(logits, params.banned)
    if params.logit_bias is not None:
        bias = params.logit_bias
        logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if params.penalties is not None:
        logits = ops.apply_penalties(logits, params.penalties)
    return logits


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """-inf for every token a restricted row does not allow."""
    banned = allowed.restricted.unsqueeze(1).repeat(1, logits.shape[1])
    banned.index_put_((allowed.rows, allowed.token_ids), torch.zeros_like(allowed.rows, dtype=bool))
    return logits.masked_fill(banned, float("-inf"))


def apply_bans(logits: torch.Tensor, banned: BannedTokens) -> torch.Tensor:
    """-inf for each banned token: outright, or where its prefix is what its row just
    generated. Each prefix token is compared once: the work is the words' total length, not
    their number times the longest."""
    word_rows = banned.rows[banned.num_unconditional :]
    seen = banned.recent[word_rows[banned.prefix_words], banned.prefix_columns]
    mismatches = torch.zeros_like(word_rows).index_add_(
        0, banned.prefix_words, (seen != banned.prefix_tokens).long()
    )
    unconditional = torch.ones(banned.num_unconditional, dtype=torch.bool, device=logits.device)
    penalty = torch.where(torch.cat([unconditional, mismatches == 0]), float("-inf"), 0.0)
    return logits.index_put((banned.rows, banned.token_ids), penalty, accumulate=True)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under the raw distribution of float32 ``logits`` [B, V] (no temperature, no cuts):
    the log-probability [B] of each row's token, and the ``num_top`` likeliest tokens'
    log-probabilities and ids [B, num_top], likeliest first."""
    return _chosen_and_top(torch.log_softmax(logits, dim=-1), tokens, num_top)


def prompt_token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs``'s three, and with them each token's rank [B] (int64): how many
    tokens are at least as likely, itself included, as vLLM counts."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen, top_logprobs, top_ids = _chosen_and_top(logprobs, tokens, num_top)
    rank = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
    return chosen, rank, top_logprobs, top_ids


def _chosen_and_top(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_logprobs, top_ids
