"""Continuous batching: which requests run in the next step.

Every step decodes all running requests and prefills newly admitted ones in the
same forward pass, within a token budget: a long prompt is prefilled in chunks over
several steps while the others keep decoding. When the cache runs out mid-decode,
the newest running request is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed (prompt and output so far) once blocks free
up, from what of it prefix caching still holds. Which waiting request is admitted next is
the waiting queue's to say (engine/scheduling/waiting_queue.py: --scheduling-policy, users
taking turns).
"""

from __future__ import annotations

import time
from collections import deque
from operator import attrgetter

from engine.scheduling.block_manager import BlockManager
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.waiting_queue import WaitingQueue

_context_length = attrgetter("num_tokens")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        separate_prefill_steps: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.separate_prefill_steps = separate_prefill_steps
        self._decodes_waited = False  # the last step was one of prompts alone
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens scheduled (cached prefixes not)
        self._scored_positions_left = max_num_seqs  # this step's (schedule)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def schedule(self) -> list[Request]:
        """The requests of the next forward pass, each with ``num_scheduled_tokens`` set: how
        many of its uncomputed tokens it computes. Within the step's token budget, decodes
        come first (longest context first), then prefills under way, then newly admitted
        requests; a prompt longer than what is left of the budget is prefilled a chunk a
        step. When the cache runs out, the newest running requests are preempted for the
        older ones, and no one is admitted.
        With ``separate_prefill_steps``, a step that admits waiting requests computes prompts
        alone (theirs, with the whole budget, then those under way): the decodes wait for the
        next step, so that a new request's first token waits for no step of theirs. Never two
        such steps in a row: arrivals every step would starve the decodes until the batch
        filled; the step after one mixes as the default does.

        One pass over the running requests grows each one's blocks and schedules its decode:
        the host runs it for every request each step, a large batch's step bound by it among
        others (docs/internals.md)."""
        budget = self.max_num_batched_tokens
        # Prompt positions whose logits are all computed for their log-probabilities: at
        # most as many as the logits rows sizing the KV cache left room for (max_num_seqs).
        self._scored_positions_left = self.max_num_seqs
        batch: list[Request] = []
        prefilling: list[Request] = []
        kept: list[Request] = []
        num_preemptions = self.num_preemptions
        # Oldest first (with priorities, the most urgent): the newest requests give their
        # blocks up to the older ones, so a request kept is never preempted later in the pass.
        queue = deque(self.running)
        while queue:
            request = queue.popleft()
            if request.has_all_tokens:  # finishes when its last token is read: no block
                kept.append(request)
                continue
            if request.draft_token_ids and not self.block_manager.can_grow(request):
                request.draft_token_ids = []  # no one is preempted for a draft
            while not (fits := self.block_manager.try_grow(request)) and queue:
                self._preempt(queue.pop())
            if not fits:
                self._preempt(request)
                continue
            kept.append(request)
            if request.num_tokens - request.num_cached_tokens > 1:
                prefilling.append(request)
            elif budget:
                num_tokens = 1
                if request.draft_token_ids:
                    if len(request.draft_token_ids) < budget:
                        num_tokens += len(request.draft_token_ids)
                    else:  # its drafts wait for a later step
                        request.draft_token_ids = []
                request.num_scheduled_tokens = num_tokens
                batch.append(request)
                budget -= num_tokens
        # Decodes longest context first. At a large batch each (sequence, KV head) is one
        # attention program over its whole context, contexts differ tenfold, and the GPU
        # starts programs in batch order: a long context started last would keep every SM
        # but its own waiting (longest-processing-time-first). The running list keeps its
        # age order, which preemption follows.
        batch.sort(key=_context_length, reverse=True)
        self.running = kept
        admits = self.num_preemptions == num_preemptions  # none preempted: there may be room
        prompts_alone = admits and self.computes_prompts_alone_next()
        self._decodes_waited = False
        if prompts_alone:
            prompts: list[Request] = []
            budget_left = self._admit_waiting(prompts, self.max_num_batched_tokens)
            if prompts:  # a step of prompts alone: the decodes scheduled above wait for the next
                for request in batch:
                    request.draft_token_ids = []  # drafted for this step: drafted anew
                self._schedule_prefills(prefilling, budget_left, prompts)
                self._decodes_waited = True
                return prompts
            admits = False  # none admitted with the whole budget: none would be with less
        budget = self._schedule_prefills(prefilling, budget, batch)
        if admits:
            self._admit_waiting(batch, budget)
        return batch

    def computes_prompts_alone_next(self) -> bool:
        """Whether the next step, with ``separate_prefill_steps``, is likely one of prompts
        alone: requests wait, a place is free, and the last step was not one (the blocks may
        still refuse them, which ``schedule`` alone finds out)."""
        return (
            self.separate_prefill_steps
            and not self._decodes_waited
            and bool(self.waiting)
            and len(self.running) < self.max_num_seqs
        )

    def _schedule_prefills(self, requests: list[Request], budget: int, batch: list[Request]) -> int:
        """Schedule the prompts under way into ``batch`` as the budget allows; what is left."""
        for request in requests:
            if not budget:
                break
            if self._schedule_prefill(request, budget):
                budget -= request.num_scheduled_tokens
                batch.append(request)
        return budget

    def _schedule_prefill(self, request: Request, budget: int) -> bool:
        """Schedule as much of the request's prompt as the budget allows; whether any."""
        chunk = min(request.num_tokens - request.num_cached_tokens, budget)
        if request.needs_prompt_logprobs:
            chunk = min(chunk, self._scored_positions_left)
            self._scored_positions_left -= chunk
        request.num_scheduled_tokens = chunk
        self.num_prefill_tokens += chunk
        return chunk > 0

    def _admit_waiting(self, batch: list[Request], budget: int) -> int:
        """Admit waiting requests into ``batch`` (their prompts' first chunks) while the budget,
        the places and the blocks allow; the budget left."""
        # A waiting request has no pending token: one preempted with a token in flight was
        # preempted in this call, which admits no one, and the token is read before the next.
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.needs_prompt_logprobs and not self._scored_positions_left:
                break
            if not self.block_manager.admit(request):
                break
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.waiting.add_running(self.running, request)
            self._schedule_prefill(request, budget)
            budget -= request.num_scheduled_tokens
            batch.append(request)
        return budget

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        request.draft_token_ids = []
        self.block_manager.release(request)
        request.status = RequestStatus.WAITING
        self.waiting.push_front(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out and free its blocks (a request that was
        never added, its grammar still compiling, has none)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.block_manager.release(request)
