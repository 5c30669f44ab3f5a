"""Admission control (``--max-queued-requests``): whether the engine takes a new request now,
and noticing the moment that answer changes.

Past the limit a new request is refused (``overloaded``; the servers answer HTTP 429), so that
the requests admitted keep their latency. The servers also refuse by themselves while the
engine's last stats say its queue is full (``EngineStats.queue_full``, server/admission_gate.py),
before they read a body, render a template or tokenize: such a refusal costs a server a
millisecond, where the engine's own answer waits for the step under way. So that the servers'
word is never staler than a step, the engine sends its stats to every server as soon as the
answer changes (``changed``), not only at its heartbeat: when a step frees places, and when
arrivals fill them.
"""

from __future__ import annotations

from engine.llm_engine import LLMEngine


class Admission:
    def __init__(self, engine: LLMEngine, max_queued_requests: int) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._announced_full = False  # what the servers were last told

    @property
    def full(self) -> bool:
        """Whether a request arriving now would be refused."""
        return self.engine.num_waiting_for_a_place(arriving=1) > self.max_queued_requests

    def refusal(self) -> str | None:
        """Why a request arriving now is refused, or None if it is taken."""
        if not self.full:
            return None
        return (
            f"{self.max_queued_requests} requests already wait for a place in the batch "
            "(--max-queued-requests)"
        )

    def changed(self) -> bool:
        """Whether ``full`` differs from what the servers were last told; from now on they
        count as told (the caller sends the stats)."""
        full = self.full
        if full == self._announced_full:
            return False
        self._announced_full = full
        return True
