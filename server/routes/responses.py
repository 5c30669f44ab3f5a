"""POST /v1/responses: OpenAI's Responses API (server/responses_schemas.py says what it
serves), generated as the chat endpoint generates, whole or streamed as events; and GET and
DELETE /v1/responses/{id} for the responses this server stored (server/response_store.py)."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.answer import Answer, whole_answer
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest, ChatMessage, read_request
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
        body = await read_request(ResponsesRequest, request)
        self._model.check_name(body.model)
        history = self._history(body.previous_response_id)
        chat, prepared = await self._prepared(body, history, client_address(request))
        generation = prepared.generation
        # Unique, though it starts with the client's X-Request-Id: a response's id is the key
        # it is stored under and continued from, and a client may send one id twice.
        unique_id = f"{request_id(request)}-{uuid.uuid4().hex[:8]}"
        answer = Answer.new(
            "resp_", "response", self._model.name, unique_id, len(generation.prompt_ids)
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
        a prompt too long for the context loses its oldest items (after the instructions),
        the fewest that make it fit, the last one kept."""
        chat = body.chat_request(history)
        structured_output = body.structured_output()
        try:
            return chat, await chat_generation(self._model, chat, structured_output, peer)
        except ApiError as exc:
            if body.truncation != "auto" or exc.code != "context_length_exceeded":
                raise
            too_long = exc
        # Each cut an oldest item shorter than the one before; fewer items never make a longer
        # prompt. Searched by halves: a try renders and tokenizes the whole prompt, and trying
        # them one by one made a long conversation's cost quadratic in its items.
        kept = 1 if body.instructions else 0
        cuts = _oldest_item_cuts(chat.messages[kept:])
        fits: tuple[ChatCompletionRequest, ChatGeneration] | None = None
        low, high = 0, len(cuts) - 1
        while low <= high:
            middle = (low + high) // 2
            shorter = chat.model_copy(
                update={"messages": chat.messages[:kept] + chat.messages[kept + cuts[middle] :]}
            )
            try:
                prepared = await chat_generation(self._model, shorter, structured_output, peer)
            except ApiError as exc:
                if exc.code != "context_length_exceeded":
                    raise
                too_long, low = exc, middle + 1  # if none fits, the last tried is the shortest
                continue
            fits, high = (shorter, prepared), middle - 1
        if fits is None:
            raise too_long
        return fits


def _oldest_item_cuts(conversation: list[ChatMessage]) -> list[int]:
    """Where the conversation starts once its oldest item is dropped, then its two oldest,
    and so on while one is left: each drop also takes the tool results that would follow it
    with no call before them."""
    cuts = []
    start = 0
    while len(conversation) - start > 1:
        start += 1
        while len(conversation) - start > 1 and conversation[start].role == "tool":
            start += 1
        cuts.append(start)
    return cuts


def _not_found(response_id: str, param: str, code: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found. Responses are kept by the server that "
        "answered them, for a while (this server's --responses-store-max, "
        "--responses-store-max-bytes and --responses-store-ttl).",
        param=param,
        code=code,
    )
