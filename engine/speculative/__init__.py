"""Speculative decoding's proposers: they draft tokens that a request's next step verifies at
once (``ngram.py``: prompt lookup; ``draft_model.py``: a smaller model of the same tokenizer).
The rule that accepts drafts is sampling's (``engine.sampling.rejection_sampler``), and the
pause of requests whose drafts keep being rejected is scheduling's
(``engine.scheduling.draft_pause``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.scheduling.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Draft tokens to follow each request's tokens (all read by the host), at most
        ``max_drafts[i]`` for request i (and the proposer's own k): one list per request,
        empty for none."""
        ...
