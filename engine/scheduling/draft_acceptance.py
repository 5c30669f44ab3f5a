"""How often speculative drafts are accepted, measured: counts of drafts tried and accepted,
by where the drafts came from (a key: the n-gram's length for prompt lookup, 0 for a draft
model), the older ones weighing less.

A verify step of d drafts that accepted a of them tried a + 1 (the first rejected one ends
the run) or d when all were accepted: under the usual model of speculation, each draft is
accepted with probability alpha once those before it were, and accepted / tried estimates
alpha. ``rate`` blends the counts with a prior (the engine's counts for the same key, in
``engine/speculative/adaptive.py``), so that a few steps do not swing it to 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The prior's weight, in tried drafts: one verify step's worth, so that the request's own
# evidence dominates after a step or two.
PRIOR_WEIGHT = 2.0
# A request's counts keep 0.7 of their weight a verify step: about its last 3 steps count,
# as its text goes from copying its input to writing anew (a code edit's changed lines).
REQUEST_MEMORY = 0.7


@dataclass
class DraftAcceptance:
    """Decayed counts of drafts tried and accepted, by key; ``memory`` is the weight the
    counts keep at each new verify step (how fast older text is forgotten)."""

    memory: float = REQUEST_MEMORY
    tried: dict[int, float] = field(default_factory=dict)
    accepted: dict[int, float] = field(default_factory=dict)
    key: int = 0  # the key of its latest drafts

    def add(self, key: int, num_drafts: int, num_accepted: int) -> None:
        """A verify step of ``num_drafts`` drafts from ``key`` accepted ``num_accepted``."""
        tried = num_accepted + (num_accepted < num_drafts)
        self.tried[key] = self.tried.get(key, 0.0) * self.memory + tried
        self.accepted[key] = self.accepted.get(key, 0.0) * self.memory + num_accepted
        self.key = key

    def forget(self) -> None:
        """Drop the counts: they measured text the request no longer writes (after a pause),
        and ``rate`` is the prior's until new drafts are verified."""
        self.tried.clear()
        self.accepted.clear()

    def rate(self, key: int, prior: float) -> float:
        """The estimated acceptance of drafts from ``key``, ``prior`` where none were tried."""
        tried = self.tried.get(key, 0.0)
        return (self.accepted.get(key, 0.0) + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)
