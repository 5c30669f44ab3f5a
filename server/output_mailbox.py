"""One request's engine outputs, on their way from the receive loop to the request's handler.

The engine sends every request an output per step. A server that streams hundreds of
requests can fall behind: each output costs it a detokenization, a JSON chunk and a
socket write. When it does, the outputs waiting for a handler merge into one (vLLM's
``RequestOutputCollector`` does the same), so a busy server does one chunk's work for
several tokens instead of one per token and keeps up with the engine; a server that keeps
up sees every output as it was sent.

Merging is only asked for where it changes nothing but the chunking: a handler that looks
for stop strings sees the tokens one step at a time, since where a stop string ends (and
with ``min_tokens``, whether it counts) is judged per step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from protocol import RequestOutput

T = TypeVar("T")


class OutputMailbox:
    def __init__(self, merge: bool, observe: Callable[[RequestOutput], None] | None = None) -> None:
        """``observe`` sees each output as it arrives, merged or not (the latency metrics
        measure the engine's steps, not this server's backlog)."""
        self._merge = merge
        self._observe = observe
        self._items: deque[RequestOutput | Exception] = deque()
        # The handler's wait for the next item, while it waits: a bare future, not an
        # asyncio.Event, whose wait builds a future and a list of waiters each time and whose
        # set walks that list: an item arrives per token.
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, RequestOutput):
            if self._observe is not None:
                self._observe(item)
            last = self._items[-1] if self._items else None
            if self._merge and isinstance(last, RequestOutput):
                self._items[-1] = merged(last, item)
                return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | Exception:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two successive outputs of one request as the one the engine would have sent for both
    steps together."""
    return RequestOutput(
        request_id=first.request_id,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        finish_reason=then.finish_reason,
        num_prompt_tokens=then.num_prompt_tokens,
        num_output_tokens=then.num_output_tokens,
        logprobs=_joined(first.logprobs, then.logprobs),
        prompt_logprobs=_joined(first.prompt_logprobs, then.prompt_logprobs),
        stop_token_id=then.stop_token_id,
        queue_time=first.queue_time if first.queue_time is not None else then.queue_time,
        prefill_time=first.prefill_time if first.prefill_time is not None else then.prefill_time,
    )


def _joined(first: list[T] | None, then: list[T] | None) -> list[T] | None:
    """Two outputs' log-probabilities, of successive tokens or prompt positions, as one's."""
    return None if first is None and then is None else (first or []) + (then or [])
