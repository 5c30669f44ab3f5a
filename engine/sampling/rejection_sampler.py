"""Verifying drafts: which of the tokens proposed after a request's last one it keeps.

A verify step computes the target model's logits after the request's last token and after
each of its k drafts d_1..d_k (one forward pass, k + 1 positions), and samples a token at
every position j with the request's own sampler, as if j drafts had been accepted: the same
processing, temperature, top-k/top-p and random numbers (those of output index
``num_output_tokens + j``) as a step without speculation would use. Draft d_{j+1} is
accepted while the token sampled at position j equals it; the tokens emitted are the
sampled ones up to and including the first that differs from its draft (or the one after
the last draft, when all are accepted): between 1 and k + 1 tokens.

Why the output is exactly the target's: at each position the emitted token *is* a sample of
the target's distribution p given the tokens before it, which are all target samples too. So
greedy requests give exactly their greedy tokens, and a seeded request the very tokens it
gives without speculation. Seen as rejection sampling with a deterministic proposer (q puts
all its mass on d): d is accepted with probability p(d) = min(1, p(d) / q(d)), and when it
is not, the token sampled is distributed as p conditioned on not being d, which is
(p - q)+ normalized, the residual distribution the speculative sampling theorem asks for.
The exponential race the sampler uses (argmax p_i / E_i) couples the two: a rejection's
token is the race's winner among the others, so no second random number is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling.sampler import SamplingTensors
from engine.scheduling.request import Request


@dataclass
class VerifyLayout:
    """Where a verify step's sampled positions are: each row's last token and then its
    drafts, rows one after the other (``ForwardedStep.logits``' first rows). Built from the
    step's requests by ``engine.execution.batch.verify_layout``."""

    row_starts: list[int]  # [R] each row's first position
    row_starts_index: torch.Tensor  # the same [R] int64, on the device
    plain_index: torch.Tensor  # [R'] int64: the positions of the rows without drafts
    drafted_index: torch.Tensor  # [P'] int64: all positions of the rows with drafts
    # [P] int64: the draft each position's sampled token must equal to accept it; -1 at
    # each row's last position, whose token is emitted whatever it is.
    next_drafts: torch.Tensor
    width: int  # the most positions a row has


def position_sampling_tensors(rows: list[Request], device: torch.device) -> SamplingTensors | None:
    """The sampling parameters of every position of ``rows``, which all have drafts: each
    row's at its last token and each draft, position j sampling output index
    ``num_output_tokens + j``. Rows with drafts shape no logits (no penalties, bans or
    grammars: what those do at a position depends on the drafts before it), so temperature,
    top-k, top-p and the seed are all there is; None when every row is greedy."""
    if all(r.sampling.temperature == 0 for r in rows):
        return None
    counts = np.fromiter((1 + len(r.draft_token_ids) for r in rows), np.int64, len(rows))
    floats = np.repeat(
        np.array([(r.sampling.temperature, r.sampling.top_p) for r in rows], np.float32),
        counts,
        axis=0,
    )
    ints = np.repeat(
        np.array([(r.sampling.top_k, r.seed, r.num_output_tokens) for r in rows], np.int64),
        counts,
        axis=0,
    )
    ints[:, 2] += np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    floats_t = torch.from_numpy(floats).to(device, non_blocking=True)
    ints_t = torch.from_numpy(ints).to(device, non_blocking=True)
    return SamplingTensors(
        temperature=floats_t[:, 0],
        top_p=floats_t[:, 1],
        top_k=ints_t[:, 0],
        seed=ints_t[:, 1],
        step=ints_t[:, 2],
        any_top_k_or_p=any(r.sampling.top_k > 0 or r.sampling.top_p < 1 for r in rows),
    )
