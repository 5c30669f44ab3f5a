"""Admission control: whether the engine takes a new request now (``--max-queued-requests``,
``--max-queued-prompt-tokens``, ``--max-compiling-grammars``), and noticing the moment that
answer changes.

Past any limit a new request is refused (``overloaded``; the servers answer HTTP 429), so
that the requests admitted keep their latency: the count bounds how long an admitted request
waits for a place; the prompt tokens bound how much prefill the steps must do before the
first tokens of the requests admitted next (a burst of long prompts would slow every step);
the grammars compiling bound how many compiles a new structured output's waits behind (the
grammar threads' queue has no bound of its own, and a client sending many large distinct
schemas would fill it for minutes). That last bound refuses only a request whose constraint
would start a compile, so it is no part of ``full``: a request of a grammar compiled already
is taken.
The servers also refuse by themselves while the engine's last stats say its queue is full
(``EngineStats.queue_full``, server/admission_gate.py), before they read a body, render a
template or tokenize: such a refusal costs a server a millisecond, where the engine's own
answer waits for the step under way. So that the servers' word is never staler than a step,
the engine sends its stats to every server as soon as the answer changes (``changed``), not
only at its heartbeat: when a step frees places, and when arrivals fill them.
"""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from protocol import StructuredOutput


class Admission:
    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int,
        max_queued_prompt_tokens: int | None,
        max_compiling_grammars: int,
    ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.max_compiling_grammars = max_compiling_grammars
        self._announced_full = False  # what the servers were last told

    @property
    def max_requests_at_once(self) -> int:
        """The most requests an idle engine takes at once, the places of a step and the
        queue beyond them, of generations and of embeddings alike: a request arriving among
        more of its own HTTP request's (its choices, its inputs) is refused however long
        they wait."""
        places = min(self.engine.scheduler.max_num_seqs, self.engine.pooler.max_num_seqs)
        return places + self.max_queued_requests

    @property
    def full(self) -> bool:
        """Whether any request arriving now would be refused: one of the least prompt, a
        token (the servers that ask know no prompt yet)."""
        return self.refusal(num_prompt_tokens=1) is not None

    def refusal(
        self, num_prompt_tokens: int | None = None, constraint: StructuredOutput | None = None
    ) -> str | None:
        """Why a request arriving now is refused, or None if it is taken. A request with
        ``num_prompt_tokens`` (a generation's) counts against the bound in prompt tokens too;
        one with None (an embedding's, pooled in steps of its own) counts in its own queue
        too, against the same bound in requests (a full generation queue refuses it as well,
        as the servers' gate does, which knows only that the engine is full). One with a
        ``constraint`` whose grammar would start compiling counts against the bound in
        grammars compiling."""
        if self.engine.num_waiting_for_a_place(arriving=1) > self.max_queued_requests:
            return (
                f"{self.max_queued_requests} requests already wait for a place in the batch "
                "(--max-queued-requests)"
            )
        grammars = self.max_compiling_grammars
        if constraint is not None and self.engine.num_grammar_compiles(constraint) > grammars:
            return (
                f"{grammars} grammars are compiling already, and this request's structured output "
                "would start another (--max-compiling-grammars; one compiled already is taken)"
            )
        if num_prompt_tokens is None:
            if self.engine.num_embeddings_waiting(arriving=1) > self.max_queued_requests:
                return (
                    f"{self.max_queued_requests} embedding requests already wait for a pooling "
                    "step (--max-queued-requests)"
                )
            return None
        bound = self.max_queued_prompt_tokens
        if bound is None:
            return None
        waiting = self.engine.num_prompt_tokens_to_compute()
        if waiting and waiting + num_prompt_tokens > bound:
            return (
                f"{waiting} prompt tokens already wait to be computed, and this request's "
                f"{num_prompt_tokens} would make more than {bound} (--max-queued-prompt-tokens)"
            )
        return None

    def changed(self) -> bool:
        """Whether ``full`` differs from what the servers were last told; from now on they
        count as told (the caller sends the stats)."""
        full = self.full
        if full == self._announced_full:
            return False
        self._announced_full = full
        return True
