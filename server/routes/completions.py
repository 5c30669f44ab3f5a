"""POST /v1/completions: a prompt (text or token ids) in, its continuation out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_response
from server.choices import PreparedGeneration
from server.engine_client import EngineClient
from server.generation import TextDelta
from server.logprobs import CompletionLogprobs, RenderLogprobs, logprobs_of, prompt_logprobs
from server.openai_schemas import CompletionRequest, parse_request
from server.prompts import completion_prompt_ids
from server.served_model import ServedModel
from server.sse import EventStreamResponse
from server.streaming import CompletionChunks, event_stream


class Completions:
    def __init__(self, client: EngineClient, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = parse_request(CompletionRequest, await request.body())
        self._model.check_name(body.model)
        prompt_ids = await completion_prompt_ids(self._model, body.prompt)
        sampling = body.sampling_params(len(prompt_ids), self._model)
        generation = PreparedGeneration(prompt_ids, sampling, body.stop, body.num_choices)
        answer = Answer.new("cmpl", "text_completion", self._model.name, len(prompt_ids))
        choices = generation.choices(self._client, self._model.tokenizer, answer.id)

        def renderer() -> RenderLogprobs | None:
            # Each choice's own: its text offsets run on from chunk to chunk.
            return None if sampling.logprobs is None else CompletionLogprobs(self._model).render

        if body.stream:
            chunks = CompletionChunks(answer, body.include_usage, [renderer() for _ in choices])
            return EventStreamResponse(event_stream(chunks, choices))

        def choice(index: int, whole: TextDelta) -> dict[str, Any]:
            rendered = {
                "index": index,
                "text": whole.text,
                "logprobs": logprobs_of(renderer(), whole),
                "finish_reason": whole.finish_reason,
            }
            if whole.prompt_logprobs is not None:
                rendered["prompt_logprobs"] = prompt_logprobs(
                    self._model, prompt_ids, whole.prompt_logprobs
                )
            return rendered

        return await whole_response(request, answer, choices, choice)
