"""A request's ``n`` choices: prepared once, generated as ``n`` engine requests, collected.

Every generating endpoint runs its choices through here: whole answers collect them
(``collect``), streamed ones merge their deltas as they come (server/streaming.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.requests import Request
from tokenizers import Tokenizer

from protocol import SamplingParams, Scheduling
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.generation import TextDelta, generate_text

logger = logging.getLogger(__name__)

T = TypeVar("T")
# One choice's text as it is generated (server/generation.py); closing it aborts the choice.
ChoiceDeltas = AsyncGenerator[TextDelta, None]


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedGeneration:
    """A request made ready for the engine: what to generate, ``num_choices`` times."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]  # stop strings: each choice ends before the first it generates
    num_choices: int
    include_stop_str_in_output: bool = False  # ... or end with it, if this is set
    # None: special tokens' text is left out; else it is kept, but for these tokens'.
    hidden_token_ids: frozenset[int] | None = None
    # Its place in the engine's queue: priority and user, shared by its choices.
    scheduling: Scheduling = dataclasses.field(default_factory=Scheduling)
    # The answer shows the prompt's log-probabilities once, the first choice's (chat's, as
    # vLLM's): the other choices' engine requests do not compute them.
    prompt_logprobs_once: bool = False

    def choices(
        self, client: EnginePool, tokenizer: Tokenizer, request_id: str
    ) -> list[ChoiceDeltas]:
        """Each choice's deltas; iterating one runs it in the engine as ``request_id-index``."""
        return [
            generate_text(
                client,
                tokenizer,
                f"{request_id}-{index}",
                self.prompt_ids,
                self.sampling.for_choice(index, prompt_logprobs_once=self.prompt_logprobs_once),
                self.scheduling,
                self.stop,
                self.include_stop_str_in_output,
                self.hidden_token_ids,
            )
            for index in range(self.num_choices)
        ]


async def collect(request: Request, choices: list[ChoiceDeltas]) -> list[TextDelta] | None:
    """Each choice whole, generated at once; None (and every choice aborted) if the client
    goes away first. The first error ends (and aborts) all of them."""
    return await unless_disconnected(request, _collect_all(choices))


async def _collect_all(choices: list[ChoiceDeltas]) -> list[TextDelta]:
    if len(choices) == 1:
        return [await _collect(choices[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_collect(deltas)) for deltas in choices]
    except* ApiError as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def _collect(deltas: ChoiceDeltas) -> TextDelta:
    """All the deltas as one: the whole text, every token with log-probabilities, the
    prompt's log-probabilities, the finish reason and the completion token count."""
    whole = TextDelta("", None, 0)
    pieces: list[str] = []
    async with aclosing(deltas):
        async for delta in deltas:
            pieces.append(delta.text)
            whole.token_ids += delta.token_ids
            whole.logprobs += delta.logprobs
            if delta.prompt_logprobs is not None:
                whole.prompt_logprobs = delta.prompt_logprobs
            whole.finish_reason, whole.completion_tokens = (
                delta.finish_reason,
                delta.completion_tokens,
            )
    whole.text = "".join(pieces)
    return whole


async def taken(request: Request, choices: list[ChoiceDeltas]) -> list[ChoiceDeltas] | None:
    """``choices`` once the engine has taken them: each one's first delta is in, so that a
    refusal raises its ApiError here, before a streamed response commits to a status. None
    (and every choice aborted) if the client goes away first."""
    return await unless_disconnected(request, _first_deltas(choices))


async def _first_deltas(choices: list[ChoiceDeltas]) -> list[ChoiceDeltas]:
    try:
        async with asyncio.TaskGroup() as group:
            firsts = [group.create_task(anext(deltas)) for deltas in choices]
    except* Exception as errors:
        for deltas in choices:
            await deltas.aclose()  # aborts the choices that were taken
        raise errors.exceptions[0] from None
    return [_resumed(first.result(), deltas) for first, deltas in zip(firsts, choices, strict=True)]


async def _resumed(first: TextDelta, rest: ChoiceDeltas) -> ChoiceDeltas:
    async with aclosing(rest):
        yield first
        async for delta in rest:
            yield delta


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (and ``work`` cancelled) if the client goes away first.

    Nothing else reads from the connection once the body is in, so waiting for its
    next message costs nothing and tells us at once when the client disconnects.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its cleanup aborts the request in the engine
    if not task.done():
        logger.info("client went away before the answer to %s", request.url.path)
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
