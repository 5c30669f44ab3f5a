"""gpt-oss's answers in harmony (server/harmony.py, server/tool_parsers/harmony.py): the
analysis channel as ``reasoning_content``, the final channel as ``content``, commentary
messages to functions as OpenAI ``tool_calls``; token by token as a stream delivers them and
whole, to the same message.

The answers are token sequences of the harmony tokenizer (tandem/testing/harmony.py), decoded
as the server decodes an answer that a parser reads: special tokens' text kept, but the
stop tokens' (``<|return|>``, ``<|call|>``) left out.
"""

from __future__ import annotations

from typing import SupportsIndex

import pytest

from server.chat_output import ChatDelta, ChatOutput, ChatOutputParser, assemble_chat
from server.harmony import HarmonyReasoningParser
from server.reasoning import ReasoningDelta
from server.reasoning_parsers import reasoning_parser_for_template
from server.tool_parsers import HarmonyToolParser, tool_parser_for_template
from tandem.testing.harmony import HARMONY_TEMPLATE, harmony_tokenizer

TOKENIZER = harmony_tokenizer()
STOP_TOKENS = {TOKENIZER.token_to_id(token) for token in ("<|return|>", "<|call|>")}


def answer_ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


def token_texts(ids: list[int]) -> list[str]:
    """Each token's text as the server streams it, the stop tokens' left out."""
    kept = [token for token in ids if token not in STOP_TOKENS]
    texts, previous = [], ""
    for end in range(1, len(kept) + 1):
        text = TOKENIZER.decode(kept[:end], skip_special_tokens=False)
        texts.append(text[len(previous) :])
        previous = text
    return texts


def parser(tools: bool) -> ChatOutputParser:
    calls = iter(f"call_{i}" for i in range(9))
    tool_parser = HarmonyToolParser(new_call_id=lambda: next(calls)) if tools else None
    return ChatOutputParser(HarmonyReasoningParser("<|start|>assistant"), tool_parser)


def streamed_and_whole(text: str, tools: bool = True) -> ChatOutput:
    """The answer token by token, and whole: the same message, which is returned."""
    texts = token_texts(answer_ids(text))
    stream = parser(tools)
    deltas: list[ChatDelta] = [stream.feed(piece) for piece in texts] + [stream.finish()]
    assert parser(tools).parse("".join(texts)) == assemble_chat(deltas)
    return assemble_chat(deltas)


def test_analysis_then_final() -> None:
    answer = streamed_and_whole(
        "<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
    )
    assert answer.reasoning_content == "The user greets. Reply briefly."
    assert answer.content == "Hello! How can I help?"
    assert answer.tool_calls == []


@pytest.mark.parametrize(
    "header",
    [
        # as gpt-oss's template renders a call: the recipient before the channel
        " to=functions.get_weather<|channel|>commentary json<|message|>",
        # as the harmony guide shows one: after it, with <|constrain|>
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    ],
)
def test_a_commentary_call_is_a_tool_call(header: str) -> None:
    arguments = '{"location": "Tokyo", "unit": "celsius"}'
    answer = streamed_and_whole(
        "<|channel|>analysis<|message|>Need the weather: call the tool.<|end|>"
        f"<|start|>assistant{header}{arguments}<|call|>"
        if header.startswith("<")
        else f"{header}{arguments}<|call|>"
    )
    assert len(answer.tool_calls) == 1
    call = answer.tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_0", "get_weather", arguments)
    assert answer.content is None  # only a call, as OpenAI sends it
    if header.startswith("<"):
        assert answer.reasoning_content == "Need the weather: call the tool."


def test_a_preamble_then_two_calls() -> None:
    """Commentary to no recipient (a preamble) is content; each call its own."""
    answer = streamed_and_whole(
        "<|channel|>commentary<|message|>Checking both cities.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"location": "Paris"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"city": "Oslo"}<|call|>'
    )
    assert answer.content == "Checking both cities."
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [
        ("get_weather", '{"location": "Paris"}'),
        ("get_time", '{"city": "Oslo"}'),
    ]


def test_without_tools_the_final_channel_is_still_split_from_the_analysis() -> None:
    answer = streamed_and_whole(
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        tools=False,
    )
    assert (answer.reasoning_content, answer.content) == ("Think.", "Done.")


def test_an_answer_cut_off_in_its_analysis_is_all_reasoning() -> None:
    answer = streamed_and_whole("<|channel|>analysis<|message|>Let me think about th")
    assert (answer.reasoning_content, answer.content) == ("Let me think about th", None)


def test_text_that_is_not_harmony_is_content() -> None:
    answer = streamed_and_whole("Plain words, no channel.")
    assert (answer.reasoning_content, answer.content) == (None, "Plain words, no channel.")


def test_the_template_picks_the_harmony_parsers() -> None:
    assert reasoning_parser_for_template(HARMONY_TEMPLATE) == HarmonyReasoningParser.name
    assert tool_parser_for_template(HARMONY_TEMPLATE) == HarmonyToolParser.name


def header_search_length(deltas: int) -> int:
    """The characters the parser's searches read while a header that never ends streams in
    ``deltas`` deltas. The text fed is a str that counts the span each ``find`` of it reads,
    and stays one as the parser adds the deltas to it."""
    searched = 0

    class SearchCountingText(str):
        def __add__(self, other: str) -> SearchCountingText:
            return SearchCountingText(str.__add__(self, other))

        def __radd__(self, other: str) -> SearchCountingText:
            return SearchCountingText(str.__add__(other, self))

        def find(
            self,
            sub: str,
            start: SupportsIndex | None = None,
            end: SupportsIndex | None = None,
        ) -> int:
            nonlocal searched
            searched += len(range(len(self))[start:end])
            return str.find(self, sub, start, end)

    parser = HarmonyReasoningParser("")
    assert parser.feed(SearchCountingText("<|channel|>analysis")) == ReasoningDelta()
    for _ in range(deltas):
        assert parser.feed("a<") == ReasoningDelta()
    assert parser.finish().content == "<|channel|>analysis" + "a<" * deltas
    return searched


def test_a_header_that_never_ends_streams_in_linear_time() -> None:
    """A model can be made to write a header and never its ``<|message|>``; each token's
    delta searched the whole header so far for it: quadratic, seconds of a server's event
    loop at 100,000 deltas. Each searches only what came since now. Counted, not timed: four
    times the deltas search about four times the characters, where searching the whole
    header searches sixteen times."""
    once = header_search_length(2_000)
    assert 0 < header_search_length(8_000) < 5 * once
