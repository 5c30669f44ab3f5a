"""The OpenAI-compatible endpoints: requests in, engine requests out, answers back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from protocol import SamplingParams, TokenLogprobs
from server.chat_template import ChatTemplateError
from server.engine_client import EngineClient
from server.errors import ApiError, internal_error
from server.generation import TextDelta, generate_text
from server.logprobs import CompletionLogprobs, chat_logprobs
from server.metrics import render_metrics
from server.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationBody,
    TokenizeRequest,
    parse_request,
)
from server.served_model import ServedModel
from server.sse import DONE, EventStreamResponse, event

logger = logging.getLogger(__name__)

# /health waits this long for the engine's stats before calling it unavailable.
_HEALTH_TIMEOUT_S = 2.0
# The status nginx logs for a client that went away before the answer (never sent).
_CLIENT_CLOSED_REQUEST = 499

T = TypeVar("T")
# Log-probabilities of some tokens in an endpoint's shape (server/logprobs.py), and what
# makes one such renderer per choice (completions' carry the choice's text offset).
RenderLogprobs = Callable[[list[int], list[TokenLogprobs]], dict[str, Any]]
LogprobsRenderer = Callable[[], RenderLogprobs]
# An endpoint's choice object: (index, text, finish reason, log-probabilities).
Choice = Callable[[int, str, str | None, Any], dict[str, Any]]


@dataclasses.dataclass(slots=True)
class _Answer:
    """What every response carries about one request, streamed or not."""

    id: str
    object: str  # the OpenAI object type of the response or of its chunks
    created: int
    model: str
    prompt_tokens: int

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }


class OpenAIApi:
    """Route handlers for one engine connection and the model it serves."""

    def __init__(self, client: EngineClient, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def chat_completions(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await request.body())
        self._check_model(body.model)
        prompt_ids = await self._chat_prompt_ids(body.messages, add_generation_prompt=True)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = self._sampling(body, len(prompt_ids), max_tokens, "messages", num_logprobs)

        def chat_renderer() -> RenderLogprobs:
            return partial(chat_logprobs, self._model)

        logprobs_renderer = None if num_logprobs is None else chat_renderer

        def choice(index: int, text: str, finish_reason: str | None, logprobs: Any) -> dict:
            message = {"role": "assistant", "content": text}
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }

        kind = ("chatcmpl", "chat.completion.chunk" if body.stream else "chat.completion")
        return await self._respond(
            request, body, kind, prompt_ids, sampling, _ChatChunks, choice, logprobs_renderer
        )

    async def completions(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await request.body())
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await self._model.encode(body.prompt, add_special_tokens=True)
            if not prompt_ids:
                raise ApiError(400, "The prompt is empty.", param="prompt")
        else:
            prompt_ids = body.prompt
            self._check_token_ids(prompt_ids, "prompt")
        sampling = self._sampling(body, len(prompt_ids), body.max_tokens, "prompt", body.logprobs)

        def completion_renderer() -> RenderLogprobs:
            return CompletionLogprobs(self._model).render  # a text offset of its own

        logprobs_renderer = None if body.logprobs is None else completion_renderer

        def choice(index: int, text: str, finish_reason: str | None, logprobs: Any) -> dict:
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }

        kind = ("cmpl", "text_completion")
        return await self._respond(
            request, body, kind, prompt_ids, sampling, _CompletionChunks, choice, logprobs_renderer
        )

    async def _respond(
        self,
        request: Request,
        body: GenerationBody,
        kind: tuple[str, str],
        prompt_ids: list[int],
        sampling: SamplingParams,
        chunks: type[_Chunks],
        choice: Choice,
        logprobs_renderer: LogprobsRenderer | None,
    ) -> Response:
        """Run the request's ``n`` choices in the engine; answer as a stream or all at once.

        ``kind`` is the response id's prefix and the OpenAI object type;
        ``logprobs_renderer`` makes each choice's renderer of log-probabilities, and is None
        when the request asked for none.
        """
        id_prefix, object_type = kind
        answer = _Answer(
            f"{id_prefix}-{uuid.uuid4().hex}",
            object_type,
            int(time.time()),
            self._model.name,
            len(prompt_ids),
        )
        deltas = [
            generate_text(
                self._client,
                self._model.tokenizer,
                f"{answer.id}-{index}",
                prompt_ids,
                # A seeded request's choices each take a seed of their own, in turn.
                sampling
                if sampling.seed is None
                else dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63),
                body.stop,
            )
            for index in range(body.num_choices)
        ]
        renderers = [logprobs_renderer() if logprobs_renderer else None for _ in deltas]
        if body.stream:
            stream_chunks = chunks(answer, body.include_usage, renderers)
            return EventStreamResponse(_event_stream(answer, deltas, stream_chunks, body))
        return await _complete(request, answer, deltas, choice, renderers)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the token ids of a prompt, or of messages through the template."""
        body = parse_request(TokenizeRequest, await request.body())
        self._check_model(body.model)
        if body.messages is not None:
            ids = await self._chat_prompt_ids(body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None  # the schema wants exactly one of the two
            ids = await self._model.encode(body.prompt, body.add_special_tokens)
        return JSONResponse(
            {"count": len(ids), "max_model_len": self._model.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        body = parse_request(DetokenizeRequest, await request.body())
        self._check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": self._model.decode(body.tokens)})

    async def _chat_prompt_ids(
        self, messages: list[ChatMessage], add_generation_prompt: bool
    ) -> list[int]:
        template = self._model.chat_template
        if template is None:
            assert self._model.chat_template_problem is not None
            raise ApiError(400, self._model.chat_template_problem, param="messages")
        dumped = [message.model_dump(exclude_unset=True) for message in messages]
        try:
            prompt = template.render(dumped, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        # The template already holds the special tokens (as apply_chat_template does).
        return await self._model.encode(prompt, add_special_tokens=False)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        stats = await self._client.stats(_HEALTH_TIMEOUT_S)
        if stats is None:
            error = ApiError(503, "The engine is not answering.", code="engine_unavailable").body()
            return JSONResponse({"status": "unavailable", **error}, status_code=503)
        return JSONResponse({"status": "ok", "engine": dataclasses.asdict(stats)})

    async def metrics(self, request: Request) -> Response:
        stats = await self._client.stats(_HEALTH_TIMEOUT_S)
        return PlainTextResponse(
            render_metrics(stats), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self._model.name,
            "object": "model",
            "created": self._model.created,
            "owned_by": "tandem",
            "max_model_len": self._model.max_model_len,
        }

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self._model.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. This server serves `{self._model.name}`.",
                param="model",
                code="model_not_found",
            )

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        # Non-negative is checked by the schema; the upper bound depends on the model.
        if token_ids and max(token_ids) >= self._model.vocab_size:
            raise ApiError(
                400,
                f"Token id {max(token_ids)} is out of range: the vocabulary has "
                f"{self._model.vocab_size} tokens.",
                param=param,
            )

    def _sampling(
        self,
        body: GenerationBody,
        prompt_tokens: int,
        max_tokens: int | None,
        prompt_param: str,
        logprobs: int | None,
    ) -> SamplingParams:
        limit = self._model.max_model_len
        if max_tokens is None and prompt_tokens >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{prompt_param} resulted in {prompt_tokens} tokens. Please reduce the "
                f"length of the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"{prompt_param}, {max_tokens} in the completion). Please reduce the length "
                f"of the {prompt_param} or completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        self._check_token_ids(body.stop_token_ids, "stop_token_ids")
        logit_bias = body.logit_bias or {}
        self._check_token_ids(list(logit_bias), "logit_bias")
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limit - prompt_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),  # vLLM's -1 and OpenAI's absence: no cut
            # The engine takes seeds in [0, 2**63); this maps OpenAI's signed ones there.
            seed=None if body.seed is None else body.seed % 2**63,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias_token_ids=list(logit_bias),
            logit_bias_values=list(logit_bias.values()),
        )


async def _complete(
    request: Request,
    answer: _Answer,
    deltas: list[AsyncGenerator[TextDelta, None]],
    choice: Choice,
    renderers: list[RenderLogprobs | None],
) -> Response:
    """The non-streamed answer: all of every choice's text in one response."""
    wholes = await _unless_disconnected(request, _collect_all(deltas))
    if wholes is None:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    choices = []
    for index, (whole, render) in enumerate(zip(wholes, renderers, strict=True)):
        logprobs = None if render is None else render(whole.token_ids, whole.logprobs)
        choices.append(choice(index, whole.text, whole.finish_reason, logprobs))
    return JSONResponse(
        {
            **answer.header(),
            "choices": choices,
            "usage": answer.usage(sum(whole.completion_tokens for whole in wholes)),
        }
    )


async def _collect_all(deltas: list[AsyncGenerator[TextDelta, None]]) -> list[TextDelta]:
    """Every choice collected at once; the first error ends (and aborts) all of them."""
    if len(deltas) == 1:
        return [await _collect(deltas[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_collect(d)) for d in deltas]
    except* ApiError as errors:
        raise errors.exceptions[0] from None
    return [task.result() for task in tasks]


async def _collect(deltas: AsyncGenerator[TextDelta, None]) -> TextDelta:
    """All the deltas as one: the whole text, every token with log-probabilities, the
    finish reason and the completion token count."""
    whole = TextDelta("", None, 0)
    pieces: list[str] = []
    async with aclosing(deltas):
        async for delta in deltas:
            pieces.append(delta.text)
            whole.token_ids += delta.token_ids
            whole.logprobs += delta.logprobs
            whole.finish_reason, whole.completion_tokens = (
                delta.finish_reason,
                delta.completion_tokens,
            )
    whole.text = "".join(pieces)
    return whole


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
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


class _Chunks:
    """The events of one streamed answer: for each choice its content deltas, each with its
    tokens' log-probabilities when asked for, then its finish. Subclasses give the
    endpoint's shape of a choice's body."""

    def __init__(
        self, answer: _Answer, include_usage: bool, renderers: list[RenderLogprobs | None]
    ) -> None:
        self._header = answer.header()
        self._include_usage = include_usage
        self._renderers = renderers

    def start(self) -> list[str]:
        return []

    def render(self, index: int, delta: TextDelta) -> list[str]:
        events = []
        if delta.text or delta.token_ids:
            render = self._renderers[index]
            logprobs = None if render is None else render(delta.token_ids, delta.logprobs)
            events.append(self._chunk(index, self._content(delta.text), logprobs=logprobs))
        if delta.finish_reason is not None:
            events.append(self._chunk(index, self._content(None), delta.finish_reason))
        return events

    def _content(self, text: str | None) -> dict[str, Any]:
        """A choice's body holding ``text``, or the finish chunk's (None)."""
        raise NotImplementedError

    def _chunk(
        self,
        index: int,
        body: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: Any = None,
    ) -> str:
        choice = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}
        data: dict[str, Any] = {**self._header, "choices": [choice]}
        if self._include_usage:
            data["usage"] = None  # as OpenAI does: only the usage chunk has usage
        return event(data)


class _ChatChunks(_Chunks):
    """``chat.completion.chunk`` events: a role delta for each choice first."""

    def start(self) -> list[str]:
        role = {"delta": {"role": "assistant", "content": ""}}
        return [self._chunk(index, role) for index in range(len(self._renderers))]

    def _content(self, text: str | None) -> dict[str, Any]:
        return {"delta": {} if text is None else {"content": text}}


class _CompletionChunks(_Chunks):
    """``text_completion`` events."""

    def _content(self, text: str | None) -> dict[str, Any]:
        return {"text": text or ""}


async def _merged(
    deltas: list[AsyncGenerator[TextDelta, None]],
) -> AsyncGenerator[tuple[int, TextDelta], None]:
    """The choices' deltas as they come, each with its choice's index. Closing this
    generator, or an error in one choice, closes (and so aborts) every choice."""
    if len(deltas) == 1:
        async with aclosing(deltas[0]):
            async for delta in deltas[0]:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TextDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, choice_deltas: AsyncGenerator[TextDelta, None]) -> None:
        try:
            async with aclosing(choice_deltas):
                async for delta in choice_deltas:
                    await queue.put((index, delta, None))
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))  # this choice is done

    tasks = [asyncio.create_task(pump(i, d)) for i, d in enumerate(deltas)]
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


async def _event_stream(
    answer: _Answer,
    deltas: list[AsyncGenerator[TextDelta, None]],
    chunks: _Chunks,
    body: GenerationBody,
) -> AsyncGenerator[str, None]:
    """The SSE body: the chunks of each delta, the usage chunk if asked, then [DONE].

    The response status is already sent when an error happens here, so the error
    goes into the stream as an event, as OpenAI and vLLM do.
    """
    completion_tokens = [0] * len(deltas)
    try:
        for item in chunks.start():
            yield item
        merged = _merged(deltas)
        async with aclosing(merged):
            async for index, delta in merged:
                completion_tokens[index] = delta.completion_tokens
                for item in chunks.render(index, delta):
                    yield item
        if body.include_usage:
            yield event(
                {**answer.header(), "choices": [], "usage": answer.usage(sum(completion_tokens))}
            )
    except ApiError as exc:
        yield event(exc.body())
    except Exception:
        logger.exception("streaming %s failed", answer.id)
        yield event(internal_error().body())
    yield DONE
