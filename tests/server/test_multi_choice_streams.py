"""The answers a client ends up with, through the HTTP routes, must not depend on how the
engine's steps group each choice's tokens (one a step, or several: verified drafts,
outputs merged while a server falls behind) nor on the order in which the choices' steps
arrive: for n > 1 streamed chat completions and completions (each choice's content,
reasoning, tool calls, finish reason, index, log-probabilities, and the usage), the same
answers not streamed, and the Responses API's events and final response object."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from protocol import (
    PROTOCOL_VERSION,
    FinishReason,
    HandshakeReply,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from server.app import create_app
from server.engine_pool import EnginePool
from server.served_model import ChatOptions
from tests.protocol.test_detokenizer import byte_level_bpe
from tests.server.renderings import CHATML_TOOLS
from tests.server.test_multi_token_steps import ANSWER, SIZES, steps_of

TOKENIZER = byte_level_bpe()
EOS = TOKENIZER.token_to_id("<|im_end|>")
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
# Each choice's answer and how it ends: on the stop token, or out of length (one inside
# its reasoning).
ANSWERS = [
    (ANSWER, FinishReason.STOP),
    ("Plain 😀 text 你好, then 🇨🇭 more", FinishReason.LENGTH),
    ("<think>\nonly thinking 🎉 你好", FinishReason.LENGTH),
]
ORDERS = [0, 1, 2]  # seeds of the choices' interleaving


class FakeEngine:
    """Answers choice ``i`` (the request id's last part) with ``ANSWERS[i]``, its tokens
    cut into steps by ``sizes``; between steps each choice yields to the others a number
    of times drawn from ``order``, so that the choices' steps interleave differently."""

    sizes = "1"
    order = 0

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *args: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        choice = int(request_id.rsplit("-", 1)[1])
        text, finish_reason = ANSWERS[choice]
        ids = TOKENIZER.encode(text).ids
        steps = steps_of(ids, self.sizes)
        rng = random.Random(self.order * 10 + choice)
        stop_token = EOS if finish_reason == FinishReason.STOP else None
        done = 0
        for index, step in enumerate(steps):
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            last = index == len(steps) - 1
            logprobs = [TokenLogprobs(-(done + i) / 8, [7], [-0.5]) for i in range(len(step))]
            done += len(step)
            yield RequestOutput(
                request_id,
                step,
                finish_reason if last else None,
                len(prompt_ids),
                done + (1 if last and stop_token is not None else 0),
                logprobs if sampling.logprobs is not None else None,
                stop_token_id=stop_token if last else None,
            )


ENGINE = FakeEngine()


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    handshake = HandshakeReply(
        protocol_version=PROTOCOL_VERSION,
        model_name="m",
        tokenizer_json=TOKENIZER.to_str(),
        chat_template=CHATML_TOOLS.read_text(),
        bos_token=None,
        eos_token="<|im_end|>",
        eos_token_ids=[EOS],
        max_model_len=4096,
        engine_pid=1,
        engine_started_at=0.0,
    )
    # Never connected: its requests go to the fake engine.
    pool = EnginePool(["tcp://127.0.0.1:9"])
    pool.generate = ENGINE.generate
    app = create_app(pool, handshake, chat_options=ChatOptions(reasoning_parser="qwen3"))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client
    asyncio.run(pool.close())


def post(client: TestClient, path: str, sizes: str, order: int, **body: Any) -> Any:
    ENGINE.sizes, ENGINE.order = sizes, order
    response = client.post(path, json={"model": "m", **body})
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()
    return [chunk for chunk in response.text.split("\n\n") if chunk]


def data(chunks: list[str]) -> list[dict[str, Any]]:
    assert chunks[-1] == "data: [DONE]"
    return [json.loads(chunk.removeprefix("data: ")) for chunk in chunks[:-1]]


def streamed_with_usage(
    client: TestClient, path: str, sizes: str, order: int, **body: Any
) -> list[dict[str, Any]]:
    """The data chunks of a stream whose last chunk is the usage."""
    options = {"stream_options": {"include_usage": True}}
    return data(post(client, path, sizes, order, **body, stream=True, **options))


def usage_of(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage chunk: last, once, with no choices; null usage in every other chunk."""
    assert chunks[-1]["choices"] == []
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    return chunks[-1]["usage"]


def choices_of(chunks: list[dict[str, Any]], joined: Any) -> dict[int, dict[str, Any]]:
    """Each choice, by index, as a client joins its chunks (``joined`` adds a chunk's choice
    to the choice so far): after its one finish chunk, nothing more of it comes."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            so_far = choices.setdefault(choice["index"], {"finish_reason": None, "logprobs": []})
            assert so_far["finish_reason"] is None, "a chunk after the choice's finish"
            joined(so_far, choice)
            so_far["finish_reason"] = choice["finish_reason"]
    assert all(choice["finish_reason"] is not None for choice in choices.values())
    return dict(sorted(choices.items()))


def join_chat(so_far: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice["delta"]
    for key in ("content", "reasoning_content"):
        so_far[key] = so_far.get(key, "") + (delta.get(key) or "")
    calls = so_far.setdefault("tool_calls", {})
    for call in delta.get("tool_calls", []):
        whole = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
        whole["id"] = whole["id"] or call.get("id")
        function = call.get("function", {})
        whole["name"] = whole["name"] or function.get("name")
        whole["arguments"] += function.get("arguments") or ""
    if choice["logprobs"] is not None:
        so_far["logprobs"] += choice["logprobs"]["content"]


def chat_message(choice: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat choice in the shape that joining chunks gives."""
    message = choice["message"]
    calls = message.get("tool_calls", [])
    return {
        "finish_reason": choice["finish_reason"],
        "logprobs": choice["logprobs"]["content"],
        "content": message["content"] or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": {
            index: {
                "id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
            for index, call in enumerate(calls)
        },
    }


def without_call_ids(choices: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Tool call ids are drawn at random: only that there is one matters."""
    for choice in choices.values():
        for call in choice["tool_calls"].values():
            assert call.pop("id").startswith("call_")
    return choices


CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "tools": [WEATHER],
    "n": 3,
    "logprobs": True,
    "max_tokens": 200,
}


def test_chat_choices_whatever_the_steps_and_their_order(client: TestClient) -> None:
    def streamed(sizes: str, order: int) -> tuple[dict[int, Any], dict[str, Any]]:
        chunks = streamed_with_usage(client, "/v1/chat/completions", sizes, order, **CHAT)
        return without_call_ids(choices_of(chunks, join_chat)), usage_of(chunks)

    expected, usage = streamed("1", 0)
    assert list(expected) == [0, 1, 2]
    assert expected[0]["tool_calls"][0]["name"] == "get_weather"
    assert [choice["finish_reason"] for choice in expected.values()] == [
        "tool_calls",
        "length",
        "length",
    ]
    completion_tokens = [len(TOKENIZER.encode(text).ids) for text, _ in ANSWERS]
    completion_tokens[0] += 1  # the stop token
    assert usage["completion_tokens"] == sum(completion_tokens)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for choice, tokens in zip(expected.values(), completion_tokens, strict=True):
        # Every generated token but the stop token has its log-probability.
        assert len(choice["logprobs"]) == tokens - (choice["finish_reason"] == "tool_calls")
    for sizes in SIZES:
        for order in ORDERS:
            assert streamed(sizes, order) == (expected, usage), (sizes, order)
            whole = post(client, "/v1/chat/completions", sizes, order, **CHAT)
            assert [choice["index"] for choice in whole["choices"]] == [0, 1, 2]
            messages = {c["index"]: chat_message(c) for c in whole["choices"]}
            assert without_call_ids(messages) == expected, (sizes, order)
            assert whole["usage"] == usage


def join_completion(so_far: dict[str, Any], choice: dict[str, Any]) -> None:
    so_far["text"] = so_far.get("text", "") + choice["text"]
    logprobs = choice["logprobs"]
    if logprobs is not None:
        joined = so_far.setdefault("offsets", {})
        for key, values in logprobs.items():
            joined[key] = joined.get(key, []) + values


@pytest.mark.parametrize(
    "fields", [{"logprobs": 1}, {"echo": True}, {"stop": ["你好"], "logprobs": 2}]
)
def test_completion_choices_whatever_the_steps_and_their_order(
    client: TestClient, fields: dict[str, Any]
) -> None:
    body = {"prompt": "hi", "n": 3, "max_tokens": 200, **fields}

    def streamed(sizes: str, order: int) -> tuple[dict[int, Any], dict[str, Any]]:
        chunks = streamed_with_usage(client, "/v1/completions", sizes, order, **body)
        return choices_of(chunks, join_completion), usage_of(chunks)

    expected, usage = streamed("1", 0)
    assert list(expected) == [0, 1, 2]
    echo = "hi" if fields.get("echo") else ""
    for choice, (text, _) in zip(expected.values(), ANSWERS, strict=True):
        assert choice["text"].startswith(echo)
        assert text.startswith(choice["text"].removeprefix(echo))
    for sizes in SIZES:
        for order in ORDERS:
            assert streamed(sizes, order) == (expected, usage), (sizes, order)
            whole = post(client, "/v1/completions", sizes, order, **body)
            assert whole["usage"] == usage
            assert [choice["index"] for choice in whole["choices"]] == [0, 1, 2]
            for choice in whole["choices"]:
                wanted = expected[choice["index"]]
                assert choice["text"] == wanted["text"]
                assert choice["finish_reason"] == wanted["finish_reason"]
                assert (choice["logprobs"] or None) == wanted.get("offsets")


def events_of(chunks: list[str]) -> list[dict[str, Any]]:
    """The Responses API's events, checked well-formed: each named by its type, numbered in
    order; every delta and done event in an item that was added and not yet done, its
    content part (for text) added and not yet done; each item done once, its id its own."""
    events = []
    for chunk in chunks:
        name, line = chunk.split("\n")
        event = json.loads(line.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    items: list[dict[str, Any]] = []  # each added item, its state
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items)
            # The message stays open until the answer ends; other items, until the next.
            assert all(item["done"] or item["id"].startswith("msg_") for item in items)
            items.append({"id": event["item"]["id"], "part": False, "done": False})
            continue
        item = items[event["output_index"]]
        assert not item["done"], kind
        item_id = event["item"]["id"] if "item" in event else event["item_id"]
        assert item_id == item["id"], kind
        if kind == "response.content_part.added":
            assert not item["part"]
            item["part"] = True
        elif kind in ("response.output_text.delta", "response.output_text.done"):
            assert item["part"] and event["content_index"] == 0, kind
        elif kind == "response.content_part.done":
            item["part"] = False
        elif kind == "response.output_item.done":
            assert not item["part"]
            item["done"] = True
    assert all(item["done"] for item in items)
    assert len({item["id"] for item in items}) == len(items)
    return events


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """The response object but for the ids drawn at random and its creation time."""
    drawn = ("id", "call_id", "created_at")
    response = {key: value for key, value in response.items() if key not in drawn}
    response["output"] = [
        {key: value for key, value in item.items() if key not in drawn}
        for item in response["output"]
    ]
    return response


# The Responses API's one choice: each answer above, and one with text after its tool call.
RESPONSE_ANSWERS = [*ANSWERS, (ANSWER + " Done 🎉", FinishReason.STOP)]


@pytest.mark.parametrize("answer", RESPONSE_ANSWERS)
def test_responses_whatever_the_steps(client: TestClient, answer: tuple[str, str]) -> None:
    body = {
        "input": "hi",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "top_logprobs": 1,
        "include": ["message.output_text.logprobs"],
        "max_output_tokens": 200,
    }
    first, ANSWERS[0] = ANSWERS[0], answer
    try:
        expected = None
        for sizes in SIZES:
            events = events_of(post(client, "/v1/responses", sizes, 0, **body, stream=True))
            final = without_ids(events[-1]["response"])
            assert events[-1]["type"] == f"response.{final['status']}"
            whole = without_ids(post(client, "/v1/responses", sizes, 0, **body))
            assert final == whole, sizes
            if expected is None:
                expected = final
            assert final == expected, sizes
            # The deltas join to the items done.
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            messages = [item for item in final["output"] if item["type"] == "message"]
            assert text == "".join(item["content"][0]["text"] for item in messages)
    finally:
        ANSWERS[0] = first
