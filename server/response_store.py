"""The Responses API's stored responses (``store``, true by default), kept in this server's
memory: the response object (GET /v1/responses/{id}) and its conversation, which a request's
``previous_response_id`` goes on from. At most ``max_responses`` of them, the oldest forgotten
first, each for ``ttl_s`` seconds.

Servers are stateless replicas, and a response lives only in the server that answered it: a
``previous_response_id`` that this server does not hold (another server's, forgotten, or from
before a restart) is a 404 ``previous_response_not_found``, never a guess. A client that
continues conversations through several servers sends the whole input instead, or routes a
conversation to one server (sticky sessions); docs/openai-api.md says so.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.openai_schemas import ChatMessage

# The defaults of --responses-store-max and --responses-store-ttl.
DEFAULT_MAX_RESPONSES = 1_000
DEFAULT_TTL_S = 3_600.0


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[ChatMessage]  # its input after the earlier turns', then its output
    expires_at: float  # time.monotonic()


class ResponseStore:
    def __init__(self, max_responses: int, ttl_s: float) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def put(self, body: dict[str, Any], conversation: list[ChatMessage]) -> None:
        self._forget_expired()
        expires_at = time.monotonic() + self.ttl_s
        self._responses[body["id"]] = StoredResponse(body, conversation, expires_at)
        self._responses.move_to_end(body["id"])  # an id given again: the newest now
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._forget_expired()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._forget_expired()
        return self._responses.pop(response_id, None) is not None

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if oldest.expires_at > now:
                return
            self._responses.popitem(last=False)
