"""Speculative decoding's proposers: they draft tokens that a request's next step verifies at
once (``ngram.py``: prompt lookup; ``draft_model.py``: a smaller model of the same tokenizer);
and its policies, which decide each step for whom and how many tokens to draft
(``adaptive.py``: from the measured acceptance and the measured step costs of
``step_costs.py``, the default; ``fixed.py``: k every step). The rule that accepts drafts is
sampling's (``engine.sampling.rejection_sampler``); a request's pauses and measured acceptance
are scheduling's (``engine.scheduling.draft_pause``, ``engine.scheduling.draft_acceptance``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.scheduling.request import Request


class Proposer(Protocol):
    def propose(
        self, requests: list[Request], max_drafts: list[int]
    ) -> tuple[list[list[int]], list[int]]:
        """Draft tokens to follow each request's tokens (all read by the host), at most
        ``max_drafts[i]`` for request i (and the proposer's own k): one list per request,
        empty for none; and each one's source, a key its acceptance is measured by."""
        ...

    def preview(self, request: Request) -> int | None:
        """The source (``propose``'s key) the request's drafts would come from, by the tokens
        the host has read (not the one in flight), at the cost of a host lookup: 0 where it
        would draft nothing; None where the proposer cannot tell without proposing."""
        ...


class DraftingPolicy(Protocol):
    def plan(self, candidates: list[Request], batch_size: int) -> tuple[list[Request], int]:
        """Before the step in flight is read: those of ``candidates`` (running requests that
        may be drafted for) to draft for, and the most drafts a request (0: none)."""
        ...

    def choose(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        keys: list[int],
        batch_size: int,
        width: int,
    ) -> list[list[int]]:
        """Of the proposed drafts (``Proposer.propose``'s), those to verify."""
        ...

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step accepted ``num_accepted`` of the request's ``num_drafts`` drafts."""
        ...
