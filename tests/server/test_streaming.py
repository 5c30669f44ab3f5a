"""The SSE chunks of streamed answers: written in parts (server/streaming.py), each must be
the JSON of the whole chunk as one dict would encode, byte for byte."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import TokenLogprobs
from server.answer import Answer
from server.generation import TextDelta
from server.sse import event
from server.streaming import ChatChunks, Chunks, CompletionChunks
from server.tool_calling import ChatParsing, tool_use
from tests.server.renderings import CHATML_TOOLS
from tests.server.test_tool_wiring import WEATHER, request, served

# Whatever JSON escapes: quotes, backslashes, control characters, non-ASCII (kept as it is),
# a character outside the BMP, and the line separators that JavaScript does not allow.
TRICKY = ' "quoted" \\ back\tslash\n\x00\x1f é 中文 🙂 \u2028\u2029 </script>'


def _render_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    return {"tokens": [str(t) for t in token_ids], "token_logprobs": [p.logprob for p in logprobs]}


def _parsed(chunks: list[str]) -> list[dict[str, Any]]:
    """Each chunk's data, after checking that it is exactly what encoding that data writes."""
    parsed = []
    for chunk in chunks:
        data = json.loads(chunk.removeprefix("data: "))
        assert chunk == event(data)
        parsed.append(data)
    return parsed


def _header(answer: Answer) -> dict[str, Any]:
    return {"id": answer.id, "object": answer.object, "created": answer.created, "model": "m"}


def _written(chunks: Chunks, deltas: list[TextDelta], indexes: int) -> list[str]:
    written = chunks.start()
    for delta in deltas:
        for index in range(indexes):
            written += chunks.render(index, delta)
    return [*written, *chunks.finish(deltas[-1].completion_tokens * indexes)]


@pytest.mark.parametrize(
    ("include_usage", "continuous"), [(False, False), (True, False), (True, True)]
)
def test_completion_chunks_are_the_whole_chunks_json(include_usage: bool, continuous: bool) -> None:
    answer = Answer.new("cmpl-", "text_completion", "m", "r", 7)
    logprobs = TokenLogprobs(-0.125, [3], [-0.125])
    deltas = [
        TextDelta(TRICKY, None, 1, [3], [logprobs]),
        TextDelta("", None, 2, [4], [TokenLogprobs(-1e-7, [], [])]),
        TextDelta("end", "length", 3, [5], [logprobs]),
    ]
    chunks = CompletionChunks(
        answer,
        include_usage,
        [_render_logprobs, None],
        ["echo " + TRICKY, ""],
        continuous_usage=continuous,
        prompt_tokens=[7, 9],
    )
    parsed = _parsed(_written(chunks, deltas, 2))

    def chunk(index: int, text: str, tokens: int, reason: str | None, ids: list[int]) -> Any:
        rendered = None
        if index == 0 and ids:
            rendered = _render_logprobs(ids, [d.logprobs[0] for d in deltas if d.token_ids == ids])
        choice = {"index": index, "text": text, "logprobs": rendered, "finish_reason": reason}
        data: dict[str, Any] = {**_header(answer), "choices": [choice]}
        if continuous:
            prompt = [7, 9][index]
            data["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": tokens,
                "total_tokens": prompt + tokens,
            }
        elif include_usage:
            data["usage"] = None
        return data

    expected = [chunk(0, "echo " + TRICKY, 0, None, []), chunk(1, "", 0, None, [])]
    for delta in deltas:
        for index in (0, 1):
            expected.append(
                chunk(index, delta.text, delta.completion_tokens, None, delta.token_ids)
            )
            if delta.finish_reason is not None:
                expected.append(chunk(index, "", delta.completion_tokens, delta.finish_reason, []))
    if include_usage:
        usage = {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
        expected.append({**_header(answer), "choices": [], "usage": usage})
    assert parsed == expected


def test_chat_chunks_are_the_whole_chunks_json() -> None:
    model = served(CHATML_TOOLS.read_text())
    parsing = ChatParsing("", "qwen3", tool_use(model, request(tools=[WEATHER])))
    answer = Answer.new("chatcmpl-", "chat.completion.chunk", "m", "r", 3)
    chunks = ChatChunks(answer, True, [None], parsing, [parsing.parser()], echo=TRICKY)
    text = (
        f"<think>{TRICKY}</think>{TRICKY}\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {{"city": {json.dumps(TRICKY)}}}}}\n</tool_call>'
    )
    pieces = [text[start : start + 7] for start in range(0, len(text), 7)]
    deltas = [TextDelta(piece, None, i + 1) for i, piece in enumerate(pieces)]
    deltas[-1].finish_reason = "stop"
    parsed = _parsed(_written(chunks, deltas, 1))

    assert all(data["usage"] is None for data in parsed[:-1])
    tokens = len(deltas)
    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    assert parsed[-1]["usage"] == usage
    choices = [data["choices"][0] for data in parsed[:-1]]
    assert all(c["index"] == 0 and c["logprobs"] is None for c in choices)
    assert [c["finish_reason"] for c in choices[-2:]] == [None, "tool_calls"]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert choices[-1]["delta"] == {}
    deltas_sent = [c["delta"] for c in choices[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas_sent) == TRICKY
    # The echo, then the content.
    assert "".join(d.get("content", "") for d in deltas_sent) == TRICKY + TRICKY
    calls = [call for d in deltas_sent for call in d.get("tool_calls", [])]
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(arguments) == {"city": TRICKY}
