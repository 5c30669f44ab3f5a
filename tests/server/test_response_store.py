"""The Responses API's store of responses: bounded in count and in bytes, the oldest
forgotten first."""

from __future__ import annotations

from typing import Any

from server.openai_schemas import ChatMessage
from server.response_store import ResponseStore, stored_size

MAX_BYTES = 10_000_000
# A response's ``user`` is stored but never reaches the prompt: a request body's worth of
# memory held per response, whatever the context.
LARGE_USER = "u" * 1_000_000


def response(index: int, **fields: Any) -> dict[str, Any]:
    return {"id": f"resp_{index}", "object": "response", "output": [], **fields}


def test_large_responses_are_held_to_the_bound_in_bytes() -> None:
    store = ResponseStore(max_responses=1_000, ttl_s=60, max_bytes=MAX_BYTES)
    conversation = [ChatMessage(role="user", content="hi")]
    for index in range(100):
        store.put(response(index, user=LARGE_USER), conversation)
    size = stored_size(response(0, user=LARGE_USER), conversation)
    kept = MAX_BYTES // size
    assert kept < 100
    assert [store.get(f"resp_{index}") is not None for index in range(100)] == (
        [False] * (100 - kept) + [True] * kept
    )


def test_a_conversation_of_many_short_messages_counts_what_its_messages_hold() -> None:
    # Each message holds some 550 bytes in memory, where its JSON is about 30.
    messages = [ChatMessage(role="user", content="") for _ in range(1_000)]
    assert stored_size(response(0), messages) > 500 * len(messages)


def test_one_larger_than_the_bound_is_not_kept_and_the_rest_stay() -> None:
    store = ResponseStore(max_responses=1_000, ttl_s=60, max_bytes=MAX_BYTES)
    store.put(response(0), [])
    store.put(response(1, user="u" * MAX_BYTES), [])
    assert store.get("resp_1") is None
    assert store.get("resp_0") is not None


def test_forgetting_frees_its_bytes_for_others() -> None:
    fits = stored_size(response(0, user=LARGE_USER), [])
    store = ResponseStore(max_responses=1_000, ttl_s=60, max_bytes=2 * fits)
    store.put(response(0, user=LARGE_USER), [])
    store.put(response(1, user=LARGE_USER), [])
    assert store.delete("resp_0")
    store.put(response(2, user=LARGE_USER), [])
    assert store.get("resp_1") is not None and store.get("resp_2") is not None
    store.put(response(2, user=LARGE_USER), [])  # an id stored again counts once
    assert store.get("resp_1") is not None


def test_the_bound_in_count_still_holds() -> None:
    store = ResponseStore(max_responses=3, ttl_s=60, max_bytes=MAX_BYTES)
    for index in range(5):
        store.put(response(index), [])
    assert [store.get(f"resp_{index}") is not None for index in range(5)] == [
        False, False, True, True, True,
    ]  # fmt: skip
