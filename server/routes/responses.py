"""POST /v1/responses: OpenAI's Responses API, stateless (server/responses_schemas.py says
what it serves); generated as the chat endpoint generates, whole or streamed as events."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_answer
from server.engine_pool import EnginePool
from server.openai_schemas import parse_request
from server.prompts import chat_generation
from server.request_id import client_address, request_id
from server.responses_output import ResponseEvents, ResponseObject
from server.responses_schemas import ResponsesRequest
from server.served_model import ServedModel
from server.sse import EventStreamResponse
from server.streaming import event_stream


class Responses:
    def __init__(self, client: EnginePool, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = parse_request(ResponsesRequest, await request.body())
        self._model.check_name(body.model)
        prepared = await chat_generation(
            self._model, body.chat_request(), body.structured_output(), client_address(request)
        )
        generation = prepared.generation
        answer = Answer.new(
            "resp_", "response", self._model.name, request_id(request), len(generation.prompt_ids)
        )
        choices = generation.choices(self._client, self._model.tokenizer, answer.engine_id)
        response = ResponseObject(answer, body, self._model, prepared.parsing)
        if body.stream:
            return EventStreamResponse(event_stream(ResponseEvents(response), choices))
        return await whole_answer(request, choices, lambda wholes: response.final(wholes[0]))
