"""Penalties on the tokens a row has seen, the reference (``StepOps.apply_penalties``).

vLLM's and OpenAI's: a repetition penalty on every token of a request's prompt and output
(the logit divided by it if positive, multiplied if not), then a frequency penalty times how
often the request generated the token and a presence penalty for each token it did. A model's
generation config may ask them of every request (Qwen2.5's repetition penalty 1.05). The
torch backend computes them here as [B, V] tensor ops, about ten passes over the logits' bytes;
the Triton backend's kernel (``engine/backends/triton/penalties.py``) reads each input once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """The penalties of a step's rows on the tokens they have seen, on the logits' device."""

    # [N, V] float32: how often each row has generated each token, in row ``slots[i]`` for
    # row i (``engine/execution/seen_tokens.py`` keeps them from step to step).
    counts: torch.Tensor
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    # vLLM's repetition penalty [B] float32 (1 for none) and each row's prompt tokens
    # [N, V] bool, in its slot's row; both None when no row has one.
    repetition: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    slots: torch.Tensor | None = None  # [B] int64; None: row i's are row i


def penalized(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """The logits with each row's repetition penalty on every token of its prompt and output
    (divided if positive, multiplied if not), then less its frequency penalty times how often
    it generated each token and its presence penalty for every one it did."""
    slots = penalties.slots
    counts = penalties.counts if slots is None else penalties.counts[slots]
    generated = counts > 0
    if penalties.repetition is not None and penalties.prompt_tokens is not None:
        prompt_tokens = penalties.prompt_tokens
        seen = (prompt_tokens if slots is None else prompt_tokens[slots]) | generated
        repetition = penalties.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    return (
        logits
        - penalties.frequency.unsqueeze(1) * counts
        - penalties.presence.unsqueeze(1) * generated.float()
    )
