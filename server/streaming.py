"""Streamed answers: the choices' deltas merged as they come, and written as the SSE chunks
of chat completions (``ChatChunks``) or completions (``CompletionChunks``), or as the
events of another API (``StreamEvents``: server/responses_output.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer
from server.chat_output import ChatDelta, ChatOutputParser
from server.choices import ChoiceDeltas, taken
from server.errors import CLIENT_CLOSED_REQUEST, ApiError, internal_error
from server.generation import TextDelta
from server.logprobs import RenderLogprobs, RenderPromptLogprobs, logprobs_of
from server.sse import DONE, EventStreamResponse, event, to_json
from server.tool_calling import ChatParsing

logger = logging.getLogger(__name__)


class StreamEvents(Protocol):
    """What a streamed answer writes, as SSE text: ``start`` before any delta, ``render`` for
    each delta of each choice, ``finish`` after the last, ``error`` if the answer fails
    (the status is sent by then), and ``end`` last, whatever happened."""

    answer: Answer

    def start(self) -> list[str]: ...

    def render(self, index: int, delta: TextDelta) -> list[str]: ...

    def finish(self, completion_tokens: int) -> list[str]: ...

    def error(self, error: ApiError) -> list[str]: ...

    def end(self) -> list[str]: ...


class Chunks:
    """The events of one streamed answer: for each choice its content deltas, each with its
    tokens' log-probabilities when asked for, then its finish; last, the usage if asked
    (and with ``continuous_usage``, as vLLM's continuous_usage_stats, on every chunk too:
    its choice's prompt tokens and completion tokens so far). Subclasses give the
    endpoint's shape of a choice's body."""

    def __init__(
        self,
        answer: Answer,
        include_usage: bool,
        renderers: list[RenderLogprobs | None],
        *,
        continuous_usage: bool = False,
        prompt_tokens: list[int] | None = None,
    ) -> None:
        """``renderers`` holds each choice's renderer of log-probabilities (None: none);
        ``prompt_tokens`` each choice's prompt length (default: the answer's)."""
        self.answer = answer
        self._include_usage = include_usage
        self._continuous_usage = continuous_usage
        self._renderers = renderers
        self._prompt_tokens = prompt_tokens or [answer.prompt_tokens] * len(renderers)
        # A chunk goes out per token or so: what every chunk of a choice starts with (the
        # answer's header, then the choice's index) is encoded once, here.
        header = to_json(answer.header()).removesuffix("}")
        self._chunk_starts = [
            f'data: {header},"choices":[{{"index":{index},' for index in range(len(renderers))
        ]
        # As OpenAI does: only the usage chunk has usage, null in the others.
        self._no_usage = ',"usage":null' if include_usage else ""

    def start(self) -> list[str]:
        return []

    def render(self, index: int, delta: TextDelta) -> list[str]:
        events = []
        tokens = delta.completion_tokens
        if delta.text or delta.token_ids:
            logprobs = logprobs_of(self._renderers[index], delta)
            events.append(self._chunk(index, self._content(delta.text), tokens, logprobs=logprobs))
        if delta.finish_reason is not None:
            events.append(self._chunk(index, self._content(None), tokens, delta.finish_reason))
        return events

    def finish(self, completion_tokens: int) -> list[str]:
        """The usage chunk, if the request asked for it."""
        if not self._include_usage:
            return []
        usage = self.answer.usage(completion_tokens)
        return [event({**self.answer.header(), "choices": [], "usage": usage})]

    def error(self, error: ApiError) -> list[str]:
        # As OpenAI and vLLM do: the error body as a chunk.
        return [event(error.body())]

    def end(self) -> list[str]:
        return [DONE]

    def _content(self, text: str | None) -> str:
        """A choice's body holding ``text``, or the finish chunk's (None), as JSON members."""
        raise NotImplementedError

    def _chunk(
        self,
        index: int,
        body: str,
        completion_tokens: int,
        finish_reason: str | None = None,
        logprobs: Any = None,
    ) -> str:
        """A chunk of choice ``index``, which has generated ``completion_tokens`` so far;
        ``body`` holds its body's JSON members. The JSON is that of the whole chunk's dict,
        written in parts so that only what varies is encoded."""
        if self._continuous_usage:
            prompt_tokens = self._prompt_tokens[index]
            usage_of_choice = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            usage = f',"usage":{to_json(usage_of_choice)}'
        else:
            usage = self._no_usage
        return (
            f"{self._chunk_starts[index]}{body},"
            f'"logprobs":{"null" if logprobs is None else to_json(logprobs)},'
            f'"finish_reason":{"null" if finish_reason is None else to_json(finish_reason)}'
            f"}}]{usage}}}\n\n"
        )


class ChatChunks(Chunks):
    """``chat.completion.chunk`` events: a role delta for each choice first, then (with
    ``echo``) each choice's echoed content, then each choice's text split by its parser into
    reasoning, content and tool-call deltas."""

    def __init__(
        self,
        answer: Answer,
        include_usage: bool,
        renderers: list[RenderLogprobs | None],
        parsing: ChatParsing,
        parsers: list[ChatOutputParser],
        *,
        continuous_usage: bool = False,
        role: str = "assistant",
        echo: str = "",
    ) -> None:
        super().__init__(answer, include_usage, renderers, continuous_usage=continuous_usage)
        self._parsing = parsing
        self._parsers = parsers
        self._role = role
        self._echo = echo

    def start(self) -> list[str]:
        choices = range(len(self._renderers))
        role = f'"delta":{to_json({"role": self._role, "content": ""})}'
        events = [self._chunk(index, role, 0) for index in choices]
        if self._echo:
            events += [self._chunk(index, self._content(self._echo), 0) for index in choices]
        return events

    def render(self, index: int, delta: TextDelta) -> list[str]:
        parser = self._parsers[index]
        split = parser.feed(delta.text)
        if delta.finish_reason is not None:
            split.extend(parser.finish())
        events = []
        tokens = delta.completion_tokens
        if not split.is_empty() or delta.token_ids:
            logprobs = logprobs_of(self._renderers[index], delta)
            events.append(self._chunk(index, _chat_delta(split), tokens, logprobs=logprobs))
        if delta.finish_reason is not None:
            reason = self._parsing.finish_reason(delta.finish_reason, parser.called_tools)
            events.append(self._chunk(index, self._content(None), tokens, reason))
        return events

    def _content(self, text: str | None) -> str:
        return '"delta":{}' if text is None else f'"delta":{{"content":{to_json(text)}}}'


def _chat_delta(split: ChatDelta) -> str:
    """The delta's JSON member: its non-empty parts (encoded one by one: a string encodes
    with less work than a dict holding it)."""
    members = []
    if split.reasoning_content:
        members.append(f'"reasoning_content":{to_json(split.reasoning_content)}')
    if split.content:
        members.append(f'"content":{to_json(split.content)}')
    if split.tool_calls:
        members.append(f'"tool_calls":{to_json([call.to_openai() for call in split.tool_calls])}')
    return f'"delta":{{{",".join(members)}}}'


class CompletionChunks(Chunks):
    """``text_completion`` events; with ``echoes`` (each choice's prompt text, for
    ``echo``), a chunk of each choice's echo first. With ``echo_logprobs`` (each choice's
    prompt ids and renderer of their log-probabilities: echo with logprobs), that chunk
    waits for the choice's first delta, which brings the prompt's log-probabilities, and
    carries them, as vLLM's does."""

    def __init__(
        self,
        answer: Answer,
        include_usage: bool,
        renderers: list[RenderLogprobs | None],
        echoes: list[str] | None = None,
        *,
        continuous_usage: bool = False,
        prompt_tokens: list[int] | None = None,
        echo_logprobs: list[tuple[list[int], RenderPromptLogprobs]] | None = None,
    ) -> None:
        super().__init__(
            answer,
            include_usage,
            renderers,
            continuous_usage=continuous_usage,
            prompt_tokens=prompt_tokens,
        )
        self._echoes = echoes
        self._echo_logprobs = echo_logprobs

    def start(self) -> list[str]:
        if self._echoes is None or self._echo_logprobs is not None:
            return []
        echoes = enumerate(self._echoes)
        return [self._chunk(index, self._content(text), 0) for index, text in echoes]

    def render(self, index: int, delta: TextDelta) -> list[str]:
        if self._echo_logprobs is None or delta.prompt_logprobs is None:
            return super().render(index, delta)
        assert self._echoes is not None
        prompt_ids, render_prompt = self._echo_logprobs[index]
        logprobs = render_prompt(prompt_ids, delta.prompt_logprobs)
        echo = self._chunk(index, self._content(self._echoes[index]), 0, logprobs=logprobs)
        return [echo, *super().render(index, delta)]

    def _content(self, text: str | None) -> str:
        return f'"text":{to_json(text or "")}'


async def merged(choices: list[ChoiceDeltas]) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """The choices' deltas as they come, each with its choice's index. Closing this
    generator, or an error in one choice, closes (and so aborts) every choice."""
    if len(choices) == 1:
        async with aclosing(choices[0]):
            async for delta in choices[0]:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TextDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, deltas: ChoiceDeltas) -> None:
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    await queue.put((index, delta, None))
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))  # this choice is done

    tasks = [asyncio.create_task(pump(i, d)) for i, d in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def streamed_response(
    request: Request, events: StreamEvents, choices: list[ChoiceDeltas]
) -> Response:
    """The SSE response of ``choices``, started once the engine has taken every choice (its
    first delta is in), so that a refusal is an HTTP error rather than an error event: the
    engine may refuse a request after every check here, when its queue is full (429) or
    its structured output's schema, regex or grammar is not one its grammar library takes
    (400)."""
    taken_choices = await taken(request, choices)
    if taken_choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return EventStreamResponse(event_stream(events, taken_choices))


async def event_stream(
    events: StreamEvents, choices: list[ChoiceDeltas]
) -> AsyncGenerator[str, None]:
    """The SSE body: ``events``' start, what they write of each delta, their finish, and
    their end (for chat completions and completions: the usage chunk if asked, then [DONE]).

    The response status is already sent when an error happens here, so the error
    goes into the stream as an event, as OpenAI and vLLM do.

    The events ready together go out as one piece (one socket write, one pass through the
    ASGI send chain): the start's, a delta's (its content and finish chunks), and the last.
    """
    completion_tokens = [0] * len(choices)
    ready: list[str] = []
    try:
        start = events.start()
        if start:
            yield "".join(start)
        deltas = merged(choices)
        async with aclosing(deltas):
            async for index, delta in deltas:
                completion_tokens[index] = delta.completion_tokens
                ready += events.render(index, delta)
                if ready:
                    yield "".join(ready)
                    ready = []
        ready += events.finish(sum(completion_tokens))
    except ApiError as exc:
        ready += events.error(exc)
    except Exception:
        logger.exception("streaming %s failed", events.answer.id)
        ready += events.error(internal_error())
    last = "".join(ready + events.end())
    if last:
        yield last
