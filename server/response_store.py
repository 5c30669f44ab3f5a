"""The Responses API's stored responses (``store``, true by default), kept in this server's
memory: the response object (GET /v1/responses/{id}) and its conversation, which a request's
``previous_response_id`` goes on from. At most ``max_responses`` of them and ``max_bytes`` in
all, the oldest forgotten first, each for ``ttl_s`` seconds.

The bound in bytes is what holds one client's memory: a response may carry a request body's
worth of fields that are stored but never reach the prompt (``user``, ``metadata``, tool
schemas a template leaves out), so the bound in count alone let a thousand cheap requests
hold a thousand request bodies (4 GB at the default --max-request-bytes).

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

from pydantic_core import to_json

from server.openai_schemas import ChatMessage

# The defaults of --responses-store-max, --responses-store-max-bytes and --responses-store-ttl.
DEFAULT_MAX_RESPONSES = 1_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TTL_S = 3_600.0
# An allowance per conversation message for the Python objects around its text (a pydantic
# model and its dicts), which its JSON does not count: without it, a conversation of many
# short messages would count for a small part of the memory it holds, and the byte bound
# would let the store grow far past it.
_MESSAGE_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    conversation: list[ChatMessage]  # its input after the earlier turns', then its output
    expires_at: float  # time.monotonic()
    size: int  # bytes it counts for against max_bytes (stored_size)


def stored_size(body: dict[str, Any], conversation: list[ChatMessage]) -> int:
    """The bytes a stored response counts for: its JSON and its conversation's, each message
    with its overhead. A conversation shares its earlier turns' messages with theirs, but
    each turn counts them again: a bound, never less than what the store holds. Serializing
    the conversation costs as much as the chat template's rendering of it did (it dumps each
    message too)."""
    return (
        len(to_json(body))
        + len(to_json(conversation))
        + _MESSAGE_OVERHEAD_BYTES * len(conversation)
    )


class ResponseStore:
    def __init__(
        self, max_responses: int, ttl_s: float, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0  # the sizes of those in _responses

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0 and self.max_bytes > 0

    def put(self, body: dict[str, Any], conversation: list[ChatMessage]) -> None:
        """Keeps the response, forgetting the oldest ones it leaves no room for; one larger
        than ``max_bytes`` on its own is not kept."""
        self._forget_expired()
        size = stored_size(body, conversation)
        if size > self.max_bytes:
            return
        self._forget(body["id"])  # an id given again: the newest now
        expires_at = time.monotonic() + self.ttl_s
        self._responses[body["id"]] = StoredResponse(body, conversation, expires_at, size)
        self._bytes += size
        while len(self._responses) > self.max_responses or self._bytes > self.max_bytes:
            self._forget(next(iter(self._responses)))

    def get(self, response_id: str) -> StoredResponse | None:
        self._forget_expired()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._forget_expired()
        return self._forget(response_id)

    def _forget(self, response_id: str) -> bool:
        forgotten = self._responses.pop(response_id, None)
        if forgotten is None:
            return False
        self._bytes -= forgotten.size
        return True

    def _forget_expired(self) -> None:
        now = time.monotonic()
        while self._responses:
            oldest_id, oldest = next(iter(self._responses.items()))
            if oldest.expires_at > now:
                return
            self._forget(oldest_id)
