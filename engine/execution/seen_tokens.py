"""The tokens each penalized request has seen, kept on the device from step to step.

Penalties (``engine/backends/penalties.py``) need, for each row of a step, how often its
request has generated each token and, with a repetition penalty, which tokens its prompt
holds. Made afresh every step, that is every row's whole output copied to the device and
counted again and every prompt's mask stacked: host work between steps that grows with the
outputs, where a small model's batch-256 step waits on its host. Here each penalized request
holds a slot, a row of two [slots, V] tables, while it is sampled: a step adds only its tokens
since the last (the one pending on the device among them), and the penalties read each row's
through the step's row-to-slot map.

A request keeps its slot until it is gone, or a step needs one for a request of its own
while the holder is not in it (the holder waits): nothing need tell this module. A request
that comes back to find its slot taken gets another, counted afresh from its output.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import torch

from engine.execution.host_to_device import pending_rows_and_sources, to_device
from engine.scheduling.request import Request

_COUNT_DTYPE = torch.float32
_PROMPT_DTYPE = torch.bool


def seen_token_table_bytes(num_slots: int, vocab_size: int) -> int:
    """What the tables take once made: the KV cache's sizing leaves room for them, as the
    first penalized request makes them while the engine serves."""
    per_entry = _COUNT_DTYPE.itemsize + _PROMPT_DTYPE.itemsize
    return num_slots * vocab_size * per_entry


class SeenTokens:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        """``num_slots``: the most requests a step samples (``max_num_seqs``)."""
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        # Made by the first step with a penalty: most deployments have none.
        self.counts: torch.Tensor | None = None  # [slots, V] float32
        self.prompt_tokens: torch.Tensor | None = None  # [slots, V] bool
        # Each slot's request, until another takes the slot or it is gone (weakly: a finished
        # request's slot is free without anything telling this module).
        self._holders: list[weakref.ref[Request] | None] = [None] * num_slots

    def slots_of(self, rows: list[Request], last_sampled: torch.Tensor) -> torch.Tensor:
        """Each row's slot [B] (int64, on the device), its counts brought up to the
        request's output so far, the token pending in ``last_sampled`` included, and its
        prompt marked where it has a repetition penalty. Some row must have a penalty."""
        if self.counts is None:
            shape = (self.num_slots, self.vocab_size)
            # Plain tensors, though a step makes them in inference mode: they are updated in
            # place from step to step, and an inference tensor only ever in that mode.
            with torch.inference_mode(False):
                self.counts = torch.zeros(shape, dtype=_COUNT_DTYPE, device=self.device)
                self.prompt_tokens = torch.zeros(shape, dtype=_PROMPT_DTYPE, device=self.device)
        assert self.prompt_tokens is not None
        free = self._free_slots(rows)
        slots = np.empty(len(rows), np.int64)
        fresh: list[int] = []
        # The tokens to count and to mark, as (slot, token) pairs: Python lists, as a row
        # adds a token or none a step (a fresh slot its whole output).
        count_slots: list[int] = []
        count_tokens: list[int] = []
        prompt_slots: list[int] = []
        prompt_tokens: list[int] = []
        neutral = []
        for row, request in enumerate(rows):
            if not request.penalized:
                neutral.append(row)
                continue
            slot = request.seen_tokens_slot
            outputs = request.output_token_ids
            held = slot is not None and self._holder(slot) is request
            # Counted past what the host knows (a pending token it never took): afresh.
            if not held or request.num_seen_tokens > len(outputs):
                if not held:
                    slot = next(free)
                assert slot is not None
                self._holders[slot] = weakref.ref(request)
                request.seen_tokens_slot = slot
                request.num_seen_tokens = 0
                fresh.append(slot)
                if request.sampling.repetition_penalty != 1:
                    prompt_slots += [slot] * len(request.prompt_token_ids)
                    prompt_tokens += request.prompt_token_ids
            slots[row] = slot
            new = outputs[request.num_seen_tokens :]
            count_slots += [slot] * len(new)
            count_tokens += new
            # The newest pending token is taken from the device. The engine keeps one step in
            # flight, so there is no other; were there more (steps launched back to back, none
            # read), the older ones are in no tensor of this step: the count is one past them,
            # so that once the host has read them the request is counted afresh.
            pending = request.num_pending_tokens
            request.num_seen_tokens = len(outputs) + pending + (pending > 1)
        assert len(neutral) < len(rows), "no row has a penalty"
        # A row without penalties changes nothing whatever counts it reads: any slot's.
        counted = np.ones(len(rows), bool)
        counted[neutral] = False
        slots[neutral] = slots[counted.argmax()]
        pending_rows, sources = pending_rows_and_sources(rows)
        keep = counted[pending_rows]
        pending_rows, sources = pending_rows[keep], sources[keep]
        pairs = (fresh, count_slots, count_tokens, prompt_slots, prompt_tokens)
        parts = [slots, *(np.array(items, np.int64) for items in pairs), pending_rows, sources]
        slots_t, fresh_t, count_slots_t, count_tokens_t, *rest = to_device(parts, self.device)
        prompt_slots_t, prompt_tokens_t, pending_t, sources_t = rest
        if fresh:
            self.counts.index_fill_(0, fresh_t, 0.0)
            self.prompt_tokens.index_fill_(0, fresh_t, False)
        if prompt_slots_t.numel():
            marks = torch.ones_like(prompt_slots_t, dtype=torch.bool)
            self.prompt_tokens.index_put_((prompt_slots_t, prompt_tokens_t), marks)
        if count_slots_t.numel():
            ones = torch.ones_like(count_slots_t, dtype=_COUNT_DTYPE)
            self.counts.index_put_((count_slots_t, count_tokens_t), ones, True)
        if pending_t.numel():
            pending_slots = slots_t[pending_t]
            ones = torch.ones_like(pending_slots, dtype=_COUNT_DTYPE)
            self.counts.index_put_((pending_slots, last_sampled[sources_t]), ones, True)
        return slots_t

    def _holder(self, slot: int) -> Request | None:
        holder = self._holders[slot]
        return None if holder is None else holder()

    def _free_slots(self, rows: list[Request]) -> Iterator[int]:
        """Slots a request of ``rows`` may take: those no request holds first, then those
        whose holder is not in the step."""
        in_step = {id(request) for request in rows}
        holders = [self._holder(slot) for slot in range(self.num_slots)]
        yield from (slot for slot, holder in enumerate(holders) if holder is None)
        for slot, holder in enumerate(holders):
            if holder is not None and id(holder) not in in_step:
                yield slot
