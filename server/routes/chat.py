"""POST /v1/chat/completions: messages in, the assistant's message out, whole or streamed."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_response
from server.choices import PreparedGeneration
from server.engine_client import EngineClient
from server.generation import TextDelta
from server.logprobs import chat_logprobs, logprobs_of
from server.openai_schemas import ChatCompletionRequest, parse_request
from server.prompts import chat_prompt_ids
from server.served_model import ServedModel
from server.streaming import ChatChunks, streamed_response


class ChatCompletions:
    def __init__(self, client: EngineClient, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await request.body())
        self._model.check_name(body.model)
        prompt_ids = await chat_prompt_ids(self._model, body.messages, add_generation_prompt=True)
        sampling = body.sampling_params(len(prompt_ids), self._model)
        generation = PreparedGeneration(prompt_ids, sampling, body.stop, body.num_choices)
        object_type = "chat.completion.chunk" if body.stream else "chat.completion"
        answer = Answer.new("chatcmpl", object_type, self._model.name, len(prompt_ids))
        choices = generation.choices(self._client, self._model.tokenizer, answer.id)
        render = None if sampling.logprobs is None else partial(chat_logprobs, self._model)
        if body.stream:
            chunks = ChatChunks(answer, body.include_usage, [render] * len(choices))
            constrained = sampling.structured_output is not None
            return await streamed_response(request, chunks, choices, constrained)

        def choice(index: int, whole: TextDelta) -> dict[str, Any]:
            return {
                "index": index,
                "message": {"role": "assistant", "content": whole.text},
                "logprobs": logprobs_of(render, whole),
                "finish_reason": whole.finish_reason,
            }

        return await whole_response(request, answer, choices, choice)
