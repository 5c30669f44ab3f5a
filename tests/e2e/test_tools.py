"""Tool calling through real processes: a server started with ``--chat-template
chatml_tools`` (ChatML with tools) beside the cluster's, whose default model's own
template has none, on the same engine, and the official openai client.

The tiny model may or may not call a tool in "auto" mode, so those tests check that the
answer is well formed either way. "required" and a named tool_choice hold the output to
JSON through the engine's structured outputs, on any template: where the template cannot
show the tools, a generic tool prompt describes them.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import instructor
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import Cluster

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def tools_url(tools_server_url: str) -> str:
    return tools_server_url


@pytest.fixture(scope="module")
def client(tools_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    fields = {"messages": QUESTION, "tools": TOOLS, **GREEDY, **fields}
    return client.chat.completions.create(model=served_model(client), **fields)


def served_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def streamed_message(client: openai.OpenAI, **fields: Any) -> tuple[dict[str, Any], str]:
    """The message a client assembles from the streamed deltas, and the finish reason.

    Each chunk must carry at most one entry per call, as OpenAI's do (clients read a
    chunk's ``tool_calls[0]`` as the whole of its delta): a call's first entry has its
    id, type and name, the next ones only arguments."""
    content, calls, finish = [], {}, None
    for chunk in chat(client, stream=True, **fields):
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        entries = choice.delta.tool_calls or []
        assert len({entry.index for entry in entries}) == len(entries), chunk
        for entry in entries:
            if entry.index in calls:
                assert entry.id is None and entry.function.name is None, chunk
                calls[entry.index]["arguments"] += entry.function.arguments
            else:
                assert entry.id and entry.type == "function" and entry.function.name, chunk
                calls[entry.index] = {
                    "name": entry.function.name,
                    "arguments": entry.function.arguments or "",
                }
        finish = choice.finish_reason or finish
    return {"content": "".join(content) or None, "tool_calls": list(calls.values())}, finish


def assert_valid_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    return arguments


def assert_weather_arguments(arguments: Any) -> None:
    """Valid against WEATHER_PARAMETERS: one string city, nothing else."""
    assert isinstance(arguments, dict) and set(arguments) == {"city"}
    assert isinstance(arguments["city"], str)


def test_auto_answers_with_content_or_a_known_call(client: openai.OpenAI) -> None:
    reply = chat(client)
    choice = reply.choices[0]
    for call in choice.message.tool_calls or []:
        assert_valid_call(call)
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    # The tools are in the prompt: it is longer than without them.
    plain = client.chat.completions.create(model=served_model(client), messages=QUESTION, **GREEDY)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 20

    streamed, finish = streamed_message(client)
    assert finish == choice.finish_reason
    assert streamed["content"] == choice.message.content
    whole_calls = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or []
    ]
    assert streamed["tool_calls"] == whole_calls


def test_required_makes_a_valid_call_streamed_as_whole(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        assert_weather_arguments(assert_valid_call(call))
    streamed, finish = streamed_message(client, tool_choice="required")
    assert finish == "tool_calls"
    assert streamed["tool_calls"] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls
    ]


def test_named_function_makes_that_call(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tool_choice=named).choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
    [call] = choice.message.tool_calls
    assert_weather_arguments(assert_valid_call(call))


def test_a_tool_round_trip_renders(client: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = chat(client, messages=messages, tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.tool_calls is None
    question_only = chat(client, tool_choice="none", max_tokens=1)
    assert reply.usage.prompt_tokens > question_only.usage.prompt_tokens


def test_refusals(client: openai.OpenAI, cluster: Cluster) -> None:
    # "auto" reads the model's own call format; a template without tools teaches none.
    with pytest.raises(openai.BadRequestError, match="needs a tool-call parser") as error:
        chat(cluster.client())
    assert error.value.body["param"] == "tool_choice"
    unknown = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.BadRequestError, match="get_time") as error:
        chat(client, tool_choice=unknown)
    assert error.value.body["param"] == "tool_choice"


def test_template_options_change_the_prompt(client: openai.OpenAI, tools_url: str) -> None:
    conversation = [*QUESTION, {"role": "assistant", "content": "It is sunny"}]

    def prompt_tokens(**fields: Any) -> int:
        reply = client.chat.completions.create(
            model=served_model(client), messages=conversation, temperature=0, max_tokens=1, **fields
        )
        return reply.usage.prompt_tokens

    generation_prompt = prompt_tokens()
    closed = prompt_tokens(extra_body={"add_generation_prompt": False})
    continued = prompt_tokens(
        extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    # "<|im_start|>assistant\n" opens the next turn; continuing drops "<|im_end|>\n".
    assert generation_prompt > closed > continued
    # The packaged template reads no extra variables, so a kwarg reaches it and changes
    # nothing; what it may not set is refused.
    kwargs = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs == generation_prompt
    response = httpx.post(
        f"{tools_url}/v1/chat/completions",
        json={"messages": QUESTION, "chat_template_kwargs": {"messages": []}},
    )
    assert response.status_code == 400 and "chat_template_kwargs" in response.text


def test_tokenize_renders_tools_as_the_chat_endpoint(
    client: openai.OpenAI, tools_url: str, cluster: Cluster
) -> None:
    reply = chat(client, max_tokens=1)
    body = {"messages": QUESTION, "tools": TOOLS}
    tokenized = httpx.post(f"{tools_url}/tokenize", json=body, timeout=30).json()
    assert tokenized["count"] == reply.usage.prompt_tokens
    without = httpx.post(f"{tools_url}/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert without["count"] < tokenized["count"]
    # The default template shows no tools: as the chat endpoint renders them without a
    # forced call, they are left out.
    plain = chat(cluster.client(), tool_choice="none", max_tokens=1)
    untold = httpx.post(f"{cluster.urls[0]}/tokenize", json=body, timeout=30).json()
    assert untold["count"] == plain.usage.prompt_tokens


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def test_responses_with_function_tools(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": served_model(client),
        "input": QUESTION[0]["content"],
        "tools": RESPONSES_TOOLS,
        "temperature": 0,
        "max_output_tokens": 40,
    }
    response = client.responses.create(**fields)
    assert response.status in ("completed", "incomplete")
    for item in response.output:
        assert item.type in ("message", "function_call")
        if item.type == "function_call":
            assert item.name == "get_weather" and item.call_id.startswith("call_")
            json.loads(item.arguments)
    streamed = list(client.responses.create(stream=True, **fields))
    final = streamed[-1].response
    assert [item.type for item in final.output] == [item.type for item in response.output]
    # A call and its result as input items round-trip through the template.
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    result = {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}
    user = {"role": "user", "content": QUESTION[0]["content"]}
    answered = client.responses.create(
        **{**fields, "input": [user, call, result], "tool_choice": "none", "max_output_tokens": 4}
    )
    assert answered.usage.input_tokens > response.usage.input_tokens


def test_responses_required_streams_function_call_arguments(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=served_model(client),
            input=QUESTION[0]["content"],
            tools=RESPONSES_TOOLS,
            tool_choice="required",
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert_weather_arguments(json.loads(call.arguments))


# --- Streamed calls in OpenAI's chunk shape; nested models; templates without tools --------


class Address(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Trip(BaseModel):
    """A nested model: its JSON schema refers to Address through $defs."""

    destination: Address
    days: int = Field(ge=1, le=30)


TRIP_TOOL = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a trip",
        "parameters": Trip.model_json_schema(),
    },
}
PLAN_TRIP = {"type": "function", "function": {"name": "plan_trip"}}
TRIP_QUESTION = [{"role": "user", "content": "Plan me three days in Paris."}]


@pytest.fixture(scope="module")
def plain_client(cluster: Cluster) -> openai.OpenAI:
    """The default model's own template, which shows no tools."""
    return cluster.client()


def test_a_named_nested_call_streams_on_a_template_without_tools(
    plain_client: openai.OpenAI,
) -> None:
    """A named function whose schema has $defs, on a template that shows no tools (the
    generic tool prompt), streamed one entry per call in a chunk as it is whole."""
    fields = {"messages": TRIP_QUESTION, "tools": [*TOOLS, TRIP_TOOL], "max_tokens": 60}
    whole = chat(plain_client, tool_choice=PLAN_TRIP, **fields).choices[0]
    [call] = whole.message.tool_calls
    assert call.function.name == "plan_trip" and whole.finish_reason == "stop"
    Trip.model_validate_json(call.function.arguments)
    streamed, finish = streamed_message(plain_client, tool_choice=PLAN_TRIP, **fields)
    assert streamed["tool_calls"] == [{"name": "plan_trip", "arguments": call.function.arguments}]
    assert finish == "stop"


def test_a_nested_model_schema_with_required(client: openai.OpenAI) -> None:
    """Pydantic writes a nested model's schema with $defs and $refs: "required" sets each
    tool's schema inside the array of calls, so the definitions move to its root."""
    fields = {"messages": TRIP_QUESTION, "tools": [TRIP_TOOL], "max_tokens": 60}
    [call] = chat(client, tool_choice="required", **fields).choices[0].message.tool_calls
    assert call.function.name == "plan_trip"
    Trip.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "plan_trip"}])
def test_responses_with_a_nested_model_schema(client: openai.OpenAI, tool_choice: Any) -> None:
    response = client.responses.create(
        model=served_model(client),
        input=TRIP_QUESTION[0]["content"],
        tools=[{"type": "function", **TRIP_TOOL["function"]}],
        tool_choice=tool_choice,
        temperature=0,
        max_output_tokens=60,
    )
    [item] = [item for item in response.output if item.type == "function_call"]
    assert item.name == "plan_trip"
    Trip.model_validate_json(item.arguments)


def test_forced_calls_on_a_template_without_tools(plain_client: openai.OpenAI) -> None:
    """The default model's template shows no tools: a generic tool prompt describes them
    and the grammar forces the call, parsed into tool_calls as on any template."""
    required = chat(plain_client, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    for call in required.message.tool_calls:
        assert_weather_arguments(assert_valid_call(call))
    [call, *_] = required.message.tool_calls
    # The call and its result go back as plain messages (the template would fail on the
    # assistant's null content): the answer after them is the model's text.
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answered = chat(plain_client, messages=messages, tool_choice="none", max_tokens=8)
    assert answered.choices[0].message.tool_calls is None
    assert answered.choices[0].message.content
    untold = chat(plain_client, tool_choice="none", max_tokens=1)
    # The answered prompt holds the call and its result; the forced one the tools.
    assert answered.usage.prompt_tokens > untold.usage.prompt_tokens
    told = chat(plain_client, tool_choice="required", max_tokens=1)
    assert told.usage.prompt_tokens > untold.usage.prompt_tokens + 20


def test_instructor_create_partial_streams_a_tool_call(tools_url: str) -> None:
    """instructor's TOOLS mode forces its model's function and reads each chunk's
    ``tool_calls[0]``: the partial objects must build up to a valid Trip."""
    patched = instructor.from_openai(
        openai.OpenAI(base_url=f"{tools_url}/v1", api_key="unused", max_retries=0),
        mode=instructor.Mode.TOOLS,
    )
    partials = list(
        patched.chat.completions.create_partial(
            model=served_model(patched.client),
            response_model=Trip,
            messages=TRIP_QUESTION,
            temperature=0,
            max_tokens=60,
            max_retries=1,
        )
    )
    assert len(partials) > 1  # built up as the arguments stream
    Trip.model_validate(partials[-1].model_dump())
