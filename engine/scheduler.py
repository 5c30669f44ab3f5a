"""Continuous batching: which requests run in the next step.

Every step decodes all running requests and prefills newly admitted ones in the
same forward pass. When the cache runs out mid-decode, the newest running request
is preempted: its blocks are freed and it goes back to the front of the queue, to
be recomputed (prompt and output so far) once blocks free up.
"""

from __future__ import annotations

from collections import deque

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens to compute at admission (cached prefixes not)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """The requests of the next forward pass; each computes tokens from its cached count on."""
        num_running = len(self.running)
        self.running = self._schedule_running()
        batch = list(self.running)
        if len(batch) == num_running:  # nothing was preempted, so there may be room for more
            self._admit_waiting(batch)
        return batch

    def _schedule_running(self) -> list[Request]:
        kept: list[Request] = []
        queue = deque(self.running)
        while queue:
            request = queue.popleft()
            # Oldest first: the newest requests give their blocks up to the older ones.
            while not (fits := self.block_manager.can_grow(request)) and queue:
                self._preempt(queue.pop())
            if fits:
                self.block_manager.grow(request)
                kept.append(request)
            else:
                self._preempt(request)
        return kept

    def _admit_waiting(self, batch: list[Request]) -> None:
        budget = self.max_num_batched_tokens - len(batch)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_tokens > budget and batch:
                break
            if not self.block_manager.admit(request):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.append(request)
            num_new = request.num_tokens - request.num_cached_tokens
            budget -= num_new
            self.num_prefill_tokens += num_new

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self.block_manager.release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.block_manager.release(request)
