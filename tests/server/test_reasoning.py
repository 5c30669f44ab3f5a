"""Qwen3's thinking comes back apart from the answer, as vLLM's qwen3 reasoning parser
returns it, read from what the real templates render."""

from __future__ import annotations

from typing import Any

import pytest

from server.chat_output import (
    ChatDelta,
    ChatOutput,
    ChatOutputParser,
    assemble_chat,
    chat_finish_reason,
)
from server.harmony import HarmonyReasoningParser
from server.reasoning import ThinkReasoningParser, prompt_opens_reasoning
from server.reasoning_parsers import REASONING_PARSERS, reasoning_parser_for_template
from server.tool_parsers import HermesToolParser, ToolCall
from tests.server.renderings import (
    MISTRAL_NEMO,
    QWEN3,
    QWEN25,
    QWQ,
    WEATHER_TOOLS,
    chat_template,
    chunkings,
    split_turn,
    template_source,
    tool_call,
)

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def numbered_ids() -> Any:
    count = iter(range(100))
    return lambda: f"call_{next(count)}"


def output_parser(prompt: str, tools: bool = True) -> ChatOutputParser:
    tool_parser = HermesToolParser(new_call_id=numbered_ids()) if tools else None
    return ChatOutputParser(ThinkReasoningParser(prompt), tool_parser)


def assert_streams_as_parsed(prompt: str, text: str, tools: bool = True) -> ChatOutput:
    whole = output_parser(prompt, tools).parse(text)
    for pieces in chunkings(text):
        parser = output_parser(prompt, tools)
        deltas: list[ChatDelta] = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert assemble_chat(deltas) == whole, pieces
    return whole


ANSWERS = {
    "reasoning and content": {
        "role": "assistant",
        "content": "It is sunny in Paris.",
        "reasoning_content": "The user asks about Paris.\n\nI know it is sunny.",
    },
    "reasoning, content and a call": {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "I need the weather tool.",
        "tool_calls": [tool_call("call_x", "get_weather", {"city": "Paris"})],
    },
    "reasoning and a call": {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Call get_weather; mention <tool_call> in passing.",
        "tool_calls": [tool_call("call_x", "get_weather", {"city": "Paris"})],
    },
}


@pytest.mark.parametrize("answer_name", list(ANSWERS))
def test_qwen3_thinking(answer_name: str) -> None:
    answer = ANSWERS[answer_name]
    template = chat_template(QWEN3)
    prompt, text = split_turn(template, QUESTION, answer, "<|im_end|>", tools=WEATHER_TOOLS)
    # Qwen3's template leaves the model to open its <think> block.
    assert not prompt_opens_reasoning(prompt)
    assert text.startswith("<think>\n")
    output = assert_streams_as_parsed(prompt, text)
    calls = [
        ToolCall(f"call_{n}", call["function"]["name"], call["function"]["arguments"])
        for n, call in enumerate(answer.get("tool_calls", []))
    ]
    assert output == ChatOutput(answer["content"], answer["reasoning_content"], calls)
    # Sent back as the next request's last assistant message, it renders as the original.
    message = output.message()
    assert template.render([*QUESTION, message], False, tools=WEATHER_TOOLS) == template.render(
        [*QUESTION, answer], False, tools=WEATHER_TOOLS
    )


def test_qwen3_without_thinking() -> None:
    """enable_thinking=False: the prompt holds the empty think block; the answer is content."""
    answer = {"role": "assistant", "content": "It is sunny."}
    options: dict[str, Any] = {"template_kwargs": {"enable_thinking": False}}
    prompt, text = split_turn(chat_template(QWEN3), QUESTION, answer, "<|im_end|>", **options)
    assert prompt.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(prompt)
    assert assert_streams_as_parsed(prompt, text) == ChatOutput("It is sunny.", None, [])


def test_prompt_that_opens_the_reasoning() -> None:
    """QwQ's template writes <think> into the prompt: the model only closes it."""
    prompt = chat_template(QWQ).render(QUESTION)
    assert prompt.endswith("<think>\n") and prompt_opens_reasoning(prompt)
    text = "Paris, in summer.\n</think>\n\nSunny, 25 °C."
    output = assert_streams_as_parsed(prompt, text, tools=False)
    assert output == ChatOutput("Sunny, 25 °C.", "Paris, in summer.", [])
    # The same answer after a prompt that does not open the block is all content.
    plain = chat_template(QWEN25).render(QUESTION)
    assert ThinkReasoningParser(plain).parse(text).reasoning_content is None


CASES = {
    # answer: (reasoning_content, content), after a prompt that does not open the block
    "cut off while thinking (max_tokens)": ("<think>\nStill thinking", ("Still thinking", None)),
    "no thinking at all": ("Just an answer.\n", (None, "Just an answer.\n")),
    "an empty block": ("<think>\n\n</think>\n\nHi", (None, "Hi")),
    "whitespace before <think>": ("\n <think>a</think>b", ("a", "b")),
    "a later <think> is content": ("x <think>y</think>", (None, "x <think>y</think>")),
    "tags split over deltas": ("<think>a</thin</think>k>", ("a</thin", "k>")),
    "only whitespace": (" \n", (None, " \n")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reasoning_cases(case: str) -> None:
    text, (reasoning, content) = CASES[case]
    output = assert_streams_as_parsed("<|im_start|>assistant\n", text, tools=False)
    assert (output.reasoning_content, output.content) == (reasoning, content)


def test_reasoning_streams_as_it_comes() -> None:
    parser = ThinkReasoningParser("")
    deltas = [parser.feed(char) for char in "<think>\nabc\n\ndef\n</think>\n\nxyz"]
    reasoning = [delta.reasoning_content for delta in deltas if delta.reasoning_content]
    assert reasoning == ["a", "b", "c", "\n\nd", "e", "f"]  # newlines wait for what follows
    assert "".join(delta.content for delta in deltas) == "xyz"


def test_parser_for_template() -> None:
    assert list(REASONING_PARSERS.items()) == [
        ("qwen3", ThinkReasoningParser),
        ("openai_gptoss", HarmonyReasoningParser),
    ]
    for name, parser in [(QWEN3, "qwen3"), (QWQ, "qwen3"), (QWEN25, None), (MISTRAL_NEMO, None)]:
        assert reasoning_parser_for_template(template_source(name)) == parser, name


def test_finish_reason_and_message() -> None:
    assert chat_finish_reason("stop", called_tools=True) == "tool_calls"
    assert chat_finish_reason("length", called_tools=True) == "length"
    assert chat_finish_reason("stop", called_tools=False) == "stop"
    output = ChatOutput(None, "why", [ToolCall("call_0", "f", "{}")])
    assert output.message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "why",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert ChatOutputParser().parse("plain").message() == {"role": "assistant", "content": "plain"}
    parser = ChatOutputParser(tools=HermesToolParser())
    parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parser.called_tools


def test_include_reasoning_false_leaves_the_reasoning_out() -> None:
    """vLLM's include_reasoning: the answer's content as before, without its reasoning,
    whole or streamed."""
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"

    def parser(include_reasoning: bool) -> ChatOutputParser:
        return ChatOutputParser(ThinkReasoningParser(""), include_reasoning=include_reasoning)

    assert parser(True).parse(text) == ChatOutput("Hello!", "The user greets me.", [])
    assert parser(False).parse(text) == ChatOutput("Hello!", None, [])
    streaming = parser(False)
    deltas = [streaming.feed(piece) for piece in (text[:9], text[9:30], text[30:])]
    deltas.append(streaming.finish())
    assert all(not delta.reasoning_content for delta in deltas)
    assert assemble_chat(deltas) == ChatOutput("Hello!", None, [])
