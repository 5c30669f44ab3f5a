"""A step of the engine may bring a request several tokens (verified drafts; outputs merged
while a server falls behind). The answer must be the one that a token per step gives: its
text, reasoning and tool calls, finish reason, usage and log-probabilities. These drive
``generate_text`` and the chat parsers with a real tokenizer whose characters and markers
span tokens, the tokens cut into steps in several ways."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from protocol import FinishReason, RequestOutput, SamplingParams, Scheduling, TokenLogprobs
from server.chat_output import ChatOutputParser, assemble_chat, chat_finish_reason
from server.generation import TextDelta, generate_text
from server.logprobs import CompletionLogprobs, chat_logprobs
from server.reasoning import ThinkReasoningParser
from server.tool_parsers import HermesToolParser
from tests.protocol.test_detokenizer import byte_level_bpe, steps_of

TOKENIZER = byte_level_bpe()
# Markers the tokenizer was not trained on, so that each spans several tokens.
ANSWER = (
    "<think>\n思考中 🎉 then 😀😀\n</think>\n\nSure 👍🏽, 你好: "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🇨🇭"}}\n</tool_call>'
)
SIZES = ["1", "2", "3", "5", "random"]


class Model:
    """What log-probabilities take of a served model: how it names a token."""

    def decode(self, token_ids: list[int]) -> str:
        return TOKENIZER.decode(token_ids, skip_special_tokens=False)


MODEL = Model()


class Timer:
    def output(self, output: RequestOutput) -> None:
        pass

    def text_passed(self) -> None:
        pass

    def finish(self, reason: str) -> None:
        pass


class Metrics:
    def request(self) -> Timer:
        return Timer()


@dataclass
class Engine:
    """An engine pool that answers with ``ids`` in ``steps``, each token's log-probability
    told apart by its place, then ``finish_reason`` (with ``stop_token_id``)."""

    steps: list[list[int]]
    finish_reason: str = FinishReason.LENGTH
    stop_token_id: int | None = None
    metrics: Metrics = field(default_factory=Metrics)

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *args: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        done = 0
        for index, step in enumerate(self.steps):
            last = index == len(self.steps) - 1
            logprobs = [TokenLogprobs(-(done + i) / 8, [7], [-0.5]) for i in range(len(step))]
            done += len(step)
            yield RequestOutput(
                request_id,
                step,
                self.finish_reason if last else None,
                len(prompt_ids),
                # The stop token is generated, not among the new tokens.
                done + (1 if last and self.stop_token_id is not None else 0),
                logprobs if sampling.logprobs is not None else None,
                stop_token_id=self.stop_token_id if last else None,
            )


def deltas(
    engine: Engine,
    stop: tuple[str, ...] = (),
    include_stop: bool = False,
    min_tokens: int = 0,
) -> list[TextDelta]:
    sampling = SamplingParams(max_tokens=1000, logprobs=1, min_tokens=min_tokens)

    async def run() -> list[TextDelta]:
        generation = generate_text(
            engine, TOKENIZER, "r", [1, 2], sampling, Scheduling(), stop, include_stop
        )
        return [delta async for delta in generation]

    return asyncio.run(run())


def answer(deltas: list[TextDelta]) -> dict[str, Any]:
    """What a client makes of the deltas, log-probabilities in both endpoints' shapes."""
    token_ids = [token for delta in deltas for token in delta.token_ids]
    logprobs = [entry for delta in deltas for entry in delta.logprobs]
    completion = CompletionLogprobs(MODEL)
    rendered = [completion.render(delta.token_ids, delta.logprobs) for delta in deltas]
    return {
        "text": "".join(delta.text for delta in deltas),
        "finish_reason": deltas[-1].finish_reason,
        "completion_tokens": deltas[-1].completion_tokens,
        "chat_logprobs": chat_logprobs(MODEL, token_ids, logprobs),
        "completion_logprobs": {key: [v for r in rendered for v in r[key]] for key in rendered[0]},
    }


def assert_as_one_token_per_step(
    ids: list[int], make_engine: Callable[[list[list[int]]], Engine], **options: Any
) -> dict[str, Any]:
    expected = answer(deltas(make_engine(steps_of(ids, "1")), **options))
    for sizes in SIZES[1:]:
        got = deltas(make_engine(steps_of(ids, sizes)), **options)
        assert not any("\ufffd" in delta.text for delta in got)
        assert answer(got) == expected, sizes
    return expected


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop", ["😀", "</think>", "你好", "<tool_call>", '🇨🇭"}'])
def test_stop_strings_cut_as_with_one_token_per_step(stop: str, include_stop: bool) -> None:
    ids = TOKENIZER.encode(ANSWER).ids
    for min_tokens in range(0, len(ids), 3):
        expected = assert_as_one_token_per_step(
            ids, Engine, stop=(stop,), include_stop=include_stop, min_tokens=min_tokens
        )
        text, taken = expected["text"], expected["completion_tokens"]
        # The tokens counted, and given log-probabilities, are those up to the stop string.
        assert len(expected["chat_logprobs"]["content"]) == taken
        if expected["finish_reason"] == FinishReason.STOP:
            # The text is cut before the stop string (after it, with include_stop), which
            # ends in the text of the last token counted.
            start = len(text) - len(stop) if include_stop else len(text)
            assert TOKENIZER.decode(ids[:taken])[start:].startswith(stop)
            assert stop not in TOKENIZER.decode(ids[: taken - 1])[start:]
        else:  # no stop string after min_tokens
            assert (text, taken) == (ANSWER, len(ids))


def test_stop_string_in_the_first_min_tokens_does_not_count() -> None:
    """'😀' ends in the text of a token among the first ``min_tokens``, then again later:
    read in steps of several tokens, the first one cut the answer when the step passed
    ``min_tokens``."""
    ids = TOKENIZER.encode("A 😀 b 😀 c").ids
    first = next(n for n in range(len(ids)) if "😀" in TOKENIZER.decode(ids[: n + 1]))
    expected = assert_as_one_token_per_step(ids, Engine, stop=("😀",), min_tokens=first + 1)
    assert expected["text"] == "A 😀 b "


@pytest.mark.parametrize("include_stop", [False, True])
def test_finish_on_a_stop_token(include_stop: bool) -> None:
    ids = TOKENIZER.encode(ANSWER).ids
    eos = TOKENIZER.token_to_id("<|im_end|>")

    def engine(steps: list[list[int]]) -> Engine:
        return Engine(steps, FinishReason.STOP, eos)

    expected = assert_as_one_token_per_step(ids, engine, include_stop=include_stop)
    assert expected["text"] == ANSWER
    assert expected["completion_tokens"] == len(ids) + 1


@pytest.mark.parametrize("sizes", SIZES)
def test_reasoning_and_tool_calls_as_with_one_token_per_step(sizes: str) -> None:
    ids = TOKENIZER.encode(ANSWER).ids
    got = deltas(Engine(steps_of(ids, sizes)))
    parser = ChatOutputParser(
        ThinkReasoningParser(""), HermesToolParser(new_call_id=lambda: "call_0")
    )
    chat = [parser.feed(delta.text) for delta in got] + [parser.finish()]
    output = assemble_chat(chat)
    assert output.reasoning_content == "思考中 🎉 then 😀😀"
    assert output.content == "Sure 👍🏽, 你好:"
    assert [(call.name, call.arguments) for call in output.tool_calls] == [
        ("get_weather", '{"city": "Zürich 🇨🇭"}')
    ]
    assert chat_finish_reason(FinishReason.STOP, parser.called_tools) == "tool_calls"
    assert not any("\ufffd" in piece.content + piece.reasoning_content for piece in chat)


def test_log_probabilities_of_partial_characters() -> None:
    """Each token is named by its own text, U+FFFD where it holds part of a character, and
    the completion's offsets run over those names, however the tokens were grouped."""
    ids = TOKENIZER.encode("😀🇯🇵 你好").ids
    expected = assert_as_one_token_per_step(ids, Engine)
    tokens = expected["chat_logprobs"]["content"]
    assert [entry["token"] for entry in tokens] == [TOKENIZER.decode([i]) for i in ids]
    assert any("\ufffd" in entry["token"] for entry in tokens)
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in tokens)
