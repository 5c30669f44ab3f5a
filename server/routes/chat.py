"""POST /v1/chat/completions: messages in, the assistant's message out, whole or streamed."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_response
from server.engine_pool import EnginePool
from server.generation import TextDelta
from server.logprobs import chat_logprobs, logprobs_of, prompt_logprobs
from server.openai_schemas import ChatCompletionRequest, read_request
from server.prompts import chat_generation
from server.request_id import client_address, request_id
from server.served_model import ServedModel
from server.streaming import ChatChunks, streamed_response


class ChatCompletions:
    def __init__(self, client: EnginePool, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = await read_request(ChatCompletionRequest, request)
        self._model.check_name(body.model)
        prepared = await chat_generation(self._model, body, peer=client_address(request))
        generation, parsing = prepared.generation, prepared.parsing
        object_type = "chat.completion.chunk" if body.stream else "chat.completion"
        answer = Answer.new(
            "chatcmpl-",
            object_type,
            self._model.name,
            request_id(request),
            len(generation.prompt_ids),
        )
        choices = generation.choices(self._client, self._model.tokenizer, answer.engine_id)
        wants_logprobs = generation.sampling.logprobs is not None
        render = (
            partial(chat_logprobs, self._model, as_token_ids=body.return_tokens_as_token_ids)
            if wants_logprobs
            else None
        )
        echo = body.echoed_content()
        if body.stream:
            parsers = [parsing.parser() for _ in choices]
            renderers = [render] * len(choices)
            chunks = ChatChunks(
                answer,
                body.include_usage,
                renderers,
                parsing,
                parsers,
                continuous_usage=body.continuous_usage,
                role=body.response_role,
                echo=echo,
            )
            return await streamed_response(request, chunks, choices)

        def choice(index: int, whole: TextDelta) -> dict[str, Any]:
            output = parsing.parser().parse(whole.text)
            assert whole.finish_reason is not None
            message = {**output.message(), "role": body.response_role}
            if echo:  # as vLLM: before the content, whatever the parsers made of the rest
                message["content"] = echo + (message["content"] or "")
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs_of(render, whole),
                "finish_reason": parsing.finish_reason(
                    whole.finish_reason, called_tools=bool(output.tool_calls)
                ),
            }

        def extra(first: TextDelta) -> dict[str, Any]:
            # vLLM gives the prompt's log-probabilities once, beside the choices.
            if first.prompt_logprobs is None:
                return {}
            return {
                "prompt_logprobs": prompt_logprobs(
                    self._model, generation.prompt_ids, first.prompt_logprobs
                )
            }

        return await whole_response(request, answer, choices, choice, extra)
