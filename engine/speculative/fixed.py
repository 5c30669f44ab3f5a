"""Speculation at a fixed k (``--no-speculative-adaptive``): every request that may be
drafted for gets up to ``--num-speculative-tokens`` drafts every step, unless its drafts keep
being rejected (``engine/scheduling/draft_pause.py``, by ``--speculative-pause-acceptance``).
What speculation did before it adapted; benchmarks compare the two."""

from __future__ import annotations

from engine.scheduling.request import Request


class FixedDrafting:
    def __init__(self, num_drafts: int, pause_acceptance: float) -> None:
        self.num_drafts = num_drafts
        self.pause_acceptance = pause_acceptance

    def plan(self, candidates: list[Request], batch_size: int) -> tuple[list[Request], int]:
        """Those of ``candidates`` not paused, and k."""
        drafting = [r for r in candidates if r.draft_pause.may_draft()]
        return drafting, self.num_drafts if drafting else 0

    def choose(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        keys: list[int],
        batch_size: int,
        width: int,
    ) -> list[list[int]]:
        """Every draft proposed."""
        return drafts

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.draft_pause.record(num_drafts, num_accepted, self.pause_acceptance)
