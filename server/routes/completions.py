"""POST /v1/completions: a prompt (text or token ids) in, its continuation out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_response
from server.choices import PreparedGeneration
from server.engine_client import EngineClient
from server.generation import TextDelta
from server.logprobs import CompletionLogprobs, RenderLogprobs, logprobs_of
from server.openai_schemas import CompletionRequest, parse_request
from server.prompts import completion_prompt_ids
from server.served_model import ServedModel
from server.streaming import CompletionChunks, streamed_response


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
            constrained = sampling.structured_output is not None
            return await streamed_response(request, chunks, choices, constrained)

        def choice(index: int, whole: TextDelta) -> dict[str, Any]:
            return {
                "index": index,
                "text": whole.text,
                "logprobs": logprobs_of(renderer(), whole),
                "finish_reason": whole.finish_reason,
            }

        return await whole_response(request, answer, choices, choice)
