"""The chat endpoint's tool fields, checked before anything reaches the engine: which
templates take tools, which tool_choice values can be honoured, what the template options
may set; and the options that pick a template and parsers at start-up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from protocol import StructuredOutputKind
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest
from server.served_model import ChatOptions, ServedModel
from server.tool_calling import tool_use
from tests.server.renderings import CHATML_TOOLS
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


def test_tools_need_a_template_that_shows_them(plain_client: TestClient) -> None:
    response = plain_client.post("/v1/chat/completions", json=chat(tools=[WEATHER]))
    assert "does not support tools" in assert_error(response, 400, "tools")


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
    assert none.constraint is None and none.parser is None and none.tools == [WEATHER]
