"""The answers of the generating endpoints: the envelope that every response and every
chunk carries (id, object type, creation time, model, usage), and the non-streamed
response; server/streaming.py writes the streamed one."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.choices import ChoiceDeltas, collect
from server.errors import CLIENT_CLOSED_REQUEST
from server.generation import TextDelta


def engine_request_prefix(answer_id: str) -> str:
    """What the ids of an answer's engine requests start with: its id and a part of its own,
    since two requests may come with one X-Request-Id and an engine request id must be unique
    on a server."""
    return f"{answer_id}-{uuid.uuid4().hex[:8]}"


@dataclass(slots=True)
class Answer:
    """What every response carries about one request, streamed or not."""

    id: str
    object: str  # the OpenAI object type of the response or of its chunks
    created: int
    model: str
    prompt_tokens: int
    engine_id: str  # what its engine requests' ids start with (engine_request_prefix)

    @classmethod
    def new(
        cls, id_prefix: str, object_type: str, model: str, request_id: str, prompt_tokens: int
    ) -> Answer:
        """An answer created now to the request ``request_id`` (server/request_id.py), under
        the id ``id_prefix`` + ``request_id``."""
        answer_id = id_prefix + request_id
        engine_id = engine_request_prefix(answer_id)
        return cls(answer_id, object_type, int(time.time()), model, prompt_tokens, engine_id)

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }


async def whole_response(
    request: Request,
    answer: Answer,
    choices: list[ChoiceDeltas],
    render_choice: Callable[[int, TextDelta], dict[str, Any]],
    render_extra: Callable[[TextDelta], dict[str, Any]] | None = None,
) -> Response:
    """The non-streamed answer: every choice whole, as ``render_choice`` writes it (from its
    index and its collected text), the usage of them all, and what ``render_extra`` makes
    of the first choice."""

    def body(wholes: list[TextDelta]) -> dict[str, Any]:
        return {
            **answer.header(),
            "choices": [render_choice(index, whole) for index, whole in enumerate(wholes)],
            "usage": answer.usage(sum(whole.completion_tokens for whole in wholes)),
            **(render_extra(wholes[0]) if render_extra is not None else {}),
        }

    return await whole_answer(request, choices, body)


async def whole_answer(
    request: Request,
    choices: list[ChoiceDeltas],
    render: Callable[[list[TextDelta]], dict[str, Any]],
) -> Response:
    """The non-streamed answer as ``render`` writes it from every choice whole; nothing
    (status 499, never sent) if the client goes away first."""
    wholes = await collect(request, choices)
    if wholes is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(render(wholes))
