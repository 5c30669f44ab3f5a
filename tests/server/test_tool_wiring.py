"""The chat endpoint's tool fields, checked before anything reaches the engine: which
templates take tools, which tool_choice values can be honoured, what the template options
may set; and the options that pick a template and parsers at start-up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk
from starlette.testclient import TestClient

from protocol import StructuredOutput, StructuredOutputKind
from server.answer import Answer
from server.answer_grammar import answer_constraint
from server.errors import ApiError
from server.generation import TextDelta
from server.openai_schemas import ChatCompletionRequest
from server.served_model import ChatOptions, ServedModel
from server.streaming import ChatChunks
from server.tool_calling import ChatParsing, tool_use
from tests.server.renderings import CHATML_TOOLS, MISTRAL_NEMO, template_source
from tests.server.test_openai_schemas import CHATML, assert_error, chat, handshake, make_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tools_client() -> Iterator[TestClient]:
    yield from make_client(CHATML_TOOLS.read_text())


@pytest.fixture(scope="module")
def plain_client() -> Iterator[TestClient]:
    yield from make_client(CHATML)


def test_auto_needs_a_template_that_shows_tools(plain_client: TestClient) -> None:
    response = plain_client.post("/v1/chat/completions", json=chat(tools=[WEATHER]))
    message = assert_error(response, 400, "tool_choice")
    assert "needs a tool-call parser" in message and '"required"' in message


def test_a_template_without_tools_gets_them_in_plain_messages() -> None:
    """SmolLM2's template reads only roles and contents: a forced call's tools and answer
    format come in a system message, and the conversation's calls and results as text."""
    model = served(CHATML)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]

    def rendered(**fields: Any) -> str:
        body = request(messages=messages, tools=[WEATHER], **fields)
        prompt = tool_use(model, body).prompt
        assert prompt.template_tools is None
        assert model.chat_template is not None
        dumped = [m.model_dump(exclude_unset=True) for m in prompt.messages(body.messages)]
        return model.chat_template.render(dumped)

    required = rendered(tool_choice="required")
    system = required.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER) in system and system.endswith("Be brief.")
    assert "answer with only a JSON array of calls" in system
    assert (
        '<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        "<|im_end|>" in required
    )
    response = {"tool_call_id": "call_1", "name": "get_weather", "content": "21 degrees"}
    assert f"<|im_start|>user\n{json.dumps({'tool_response': response})}<|im_end|>" in required
    named = rendered(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "Call the function get_weather now" in named
    # Without a forced call the tools are not described; the calls and results still
    # render (the template would fail on the assistant's null content).
    none = rendered(tool_choice="none")
    assert "# Tools" not in none and "tool_response" in none


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", ""),
        ({"chat_template_kwargs": {"tools": []}}, "messages", "chat_template_kwargs"),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "messages",
            "cannot both be true",
        ),
    ],
)
def test_tool_choice_and_template_refusals(
    tools_client: TestClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = tools_client.post("/v1/chat/completions", json=chat(**fields))
    assert words in assert_error(response, 400, param)


def served(template: str | None, **options: Any) -> ServedModel:
    return ServedModel.from_handshake(handshake(template), ChatOptions(**options))


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(chat(**fields))


def test_parsers_follow_the_template_unless_named() -> None:
    assert served(CHATML_TOOLS.read_text()).tool_parser == "hermes"
    assert served(CHATML).tool_parser is None
    assert served(CHATML, chat_template="chatml_tools").tool_parser == "hermes"
    assert served(CHATML, chat_template="chatml_tools").chat_template.supports_tools
    assert served(CHATML, tool_call_parser="mistral").tool_parser == "mistral"
    assert served(CHATML, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="not a packaged template"):
        served(CHATML, chat_template="no_such_template")


def test_auto_needs_a_parser() -> None:
    model = served(CHATML_TOOLS.read_text(), tool_call_parser=None)
    assert tool_use(model, request(tools=[WEATHER])).parser is not None
    model = served(CHATML_TOOLS.read_text().replace("tool_call", "x"))
    with pytest.raises(ApiError, match="needs a tool-call parser"):
        tool_use(model, request(tools=[WEATHER]))


def test_required_and_named_choices_constrain_the_output() -> None:
    model = served(CHATML_TOOLS.read_text())
    auto = tool_use(model, request(tools=[WEATHER]))
    assert auto.constraint is None and not auto.named
    required = tool_use(model, request(tools=[WEATHER], tool_choice="required"))
    assert required.constraint is not None
    assert required.constraint.kind == StructuredOutputKind.JSON_SCHEMA
    schema = json.loads(required.constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    single = tool_use(
        model, request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    )
    assert json.loads(single.constraint.spec)["maxItems"] == 1
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = tool_use(model, request(tools=[WEATHER], tool_choice=choice))
    assert named.named
    assert json.loads(named.constraint.spec) == WEATHER["function"]["parameters"]
    none = tool_use(model, request(tools=[WEATHER], tool_choice="none"))
    assert none.constraint is None and none.parser is None
    assert none.prompt.template_tools == [WEATHER] and none.prompt.generic_prompt is None


def test_streamed_chunks_assemble_to_the_whole_message() -> None:
    model = served(CHATML_TOOLS.read_text())
    parsing = ChatParsing("", None, tool_use(model, request(tools=[WEATHER], n=2)))
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
        "</tool_call>"
    )
    answer = Answer.new("chatcmpl-", "chat.completion.chunk", "m", "r", 3)
    parsers = [parsing.parser(), parsing.parser()]
    chunks = ChatChunks(answer, False, [None, None], parsing, parsers)
    written = chunks.start()
    for start in range(0, len(text), 5):
        last = start + 5 >= len(text)
        for index in (0, 1):
            piece = TextDelta(text[start : start + 5], "stop" if last else None, 1)
            written += chunks.render(index, piece)
    events = [json.loads(e.removeprefix("data: ")) for e in "".join(written).split("\n\n") if e]
    for index in (0, 1):
        typed = [
            ChatCompletionChunk.model_validate(e)
            for e in events
            if e["choices"][0]["index"] == index
        ]
        content = "".join(c.choices[0].delta.content or "" for c in typed)
        calls: dict[int, list[str]] = {}
        for chunk in typed:
            for call in chunk.choices[0].delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments
        whole = parsing.parser().parse(text)
        assert content == whole.content == "Checking."
        assert list(calls.values()) == [[c.name, c.arguments] for c in whole.tool_calls]
        assert [json.loads(args)["city"] for _, args in calls.values()] == ["Paris", "Lyon"]
        assert typed[-1].choices[0].finish_reason == "tool_calls"


def test_tools_and_a_response_format_need_calls_a_grammar_can_hold() -> None:
    """Mistral's calls start with [TOOL_CALLS], a special token no grammar allows: tools the
    model may call ("auto") beside a response format are refused."""
    model = served(template_source(MISTRAL_NEMO))
    assert model.tool_parser == "mistral"
    with pytest.raises(ApiError, match="mistral tool-call parser") as refused:
        body = request(tools=[WEATHER])
        answer_constraint(
            model, body, tool_use(model, body), StructuredOutput("json_object"), prompt=""
        )
    assert refused.value.param == "response_format"
