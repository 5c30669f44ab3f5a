"""POST /v1/responses: OpenAI's Responses API (server/responses_schemas.py says what it
serves), generated as the chat endpoint generates, whole or streamed as events; and GET and
DELETE /v1/responses/{id} for the responses this server stored (server/response_store.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.answer import Answer, whole_answer
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest, ChatMessage, parse_request
from server.prompts import ChatGeneration, chat_generation
from server.request_id import client_address, request_id
from server.response_store import ResponseStore
from server.responses_output import ResponseEvents, ResponseObject
from server.responses_schemas import ResponsesRequest, output_messages
from server.served_model import ServedModel
from server.sse import EventStreamResponse
from server.streaming import event_stream


class Responses:
    def __init__(self, client: EnginePool, model: ServedModel, store: ResponseStore) -> None:
        self._client = client
        self._model = model
        self._store = store

    async def create(self, request: Request) -> Response:
        body = parse_request(ResponsesRequest, await request.body())
        self._model.check_name(body.model)
        history = self._history(body.previous_response_id)
        chat, prepared = await self._prepared(body, history, client_address(request))
        generation = prepared.generation
        answer = Answer.new(
            "resp_", "response", self._model.name, request_id(request), len(generation.prompt_ids)
        )
        choices = generation.choices(self._client, self._model.tokenizer, answer.engine_id)
        store = None
        if body.store and self._store.enabled:
            # The conversation the next turn goes on from: this one's, instructions aside
            # (OpenAI does not carry them over), then its output.
            conversation = chat.messages[1:] if body.instructions else chat.messages

            def store(final: dict[str, Any]) -> None:
                self._store.put(final, conversation + output_messages(final["output"]))

        response = ResponseObject(answer, body, self._model, prepared.parsing, store)
        if body.stream:
            return EventStreamResponse(event_stream(ResponseEvents(response), choices))
        return await whole_answer(request, choices, lambda wholes: response.final(wholes[0]))

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self._store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id", "response_not_found")
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self._store.delete(response_id):
            raise _not_found(response_id, "response_id", "response_not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _history(self, previous_response_id: str | None) -> list[ChatMessage]:
        if previous_response_id is None:
            return []
        stored = self._store.get(previous_response_id)
        if stored is None:
            raise _not_found(
                previous_response_id, "previous_response_id", "previous_response_not_found"
            )
        return stored.conversation

    async def _prepared(
        self, body: ResponsesRequest, history: list[ChatMessage], peer: str
    ) -> tuple[ChatCompletionRequest, ChatGeneration]:
        """The chat request of ``body`` after ``history``, made ready. With truncation auto,
        a prompt too long for the context loses its oldest items (after the instructions)
        until it fits, the last one kept."""
        chat = body.chat_request(history)
        while True:
            try:
                prepared = await chat_generation(self._model, chat, body.structured_output(), peer)
                return chat, prepared
            except ApiError as exc:
                shorter = _without_oldest_item(chat, bool(body.instructions))
                if (
                    body.truncation != "auto"
                    or exc.code != "context_length_exceeded"
                    or shorter is None
                ):
                    raise
                chat = shorter


def _without_oldest_item(
    chat: ChatCompletionRequest, has_instructions: bool
) -> ChatCompletionRequest | None:
    """``chat`` without its oldest conversation message (and the tool results that would
    follow it with no call before them); None if only one is left."""
    start = 1 if has_instructions else 0
    conversation = chat.messages[start:]
    if len(conversation) <= 1:
        return None
    rest = conversation[1:]
    while len(rest) > 1 and rest[0].role == "tool":
        rest = rest[1:]
    return chat.model_copy(update={"messages": chat.messages[:start] + rest})


def _not_found(response_id: str, param: str, code: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found. Responses are kept by the server that "
        "answered them, for a while (this server's --responses-store-max and "
        "--responses-store-ttl).",
        param=param,
        code=code,
    )
