"""The answers of chat completions and completions: the envelope that every response and
every chunk carries (id, object type, creation time, model, usage), and the non-streamed
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
from server.generation import TextDelta

# The status nginx logs for a client that went away before the answer (never sent).
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True)
class Answer:
    """What every response carries about one request, streamed or not."""

    id: str
    object: str  # the OpenAI object type of the response or of its chunks
    created: int
    model: str
    prompt_tokens: int

    @classmethod
    def new(cls, id_prefix: str, object_type: str, model: str, prompt_tokens: int) -> Answer:
        """An answer created now, under a new id that starts with ``id_prefix``."""
        return cls(
            f"{id_prefix}-{uuid.uuid4().hex}", object_type, int(time.time()), model, prompt_tokens
        )

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
) -> Response:
    """The non-streamed answer: every choice whole, as ``render_choice`` writes it (from its
    index and its collected text), and the usage of them all."""
    wholes = await collect(request, choices)
    if wholes is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(
        {
            **answer.header(),
            "choices": [render_choice(index, whole) for index, whole in enumerate(wholes)],
            "usage": answer.usage(sum(whole.completion_tokens for whole in wholes)),
        }
    )
