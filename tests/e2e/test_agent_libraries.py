"""Agent libraries, unmodified, against a real engine and server: openai-agents (its Chat
Completions model and its Responses model), pydantic-ai, instructor (TOOLS, JSON_SCHEMA,
``create_partial``, RESPONSES_TOOLS) and langchain-openai (``bind_tools``,
``with_structured_output``), each at the version pyproject's dev extra pins.

The model is the cluster's (SmolLM2-135M-Instruct), served by one more server started with
``--chat-template chatml_tools``. Where a test needs a tool call it forces one (``tool_choice``
required or named) and where it needs an object it asks for a schema, so the grammar holds the
answer's shape and the tiny model only fills in the values: every test checks what the library
hands back (the parsed object's fields and types, the tool it ran with typed arguments, the
result fed back, the final output's type), which is only there if the server spoke the API as
the library expects. Greedy decoding and short answers keep the module quick and its runs alike.
"""

from __future__ import annotations

import json

import httpx
import instructor
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import RunContext
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings as PydanticModelSettings

from tests.conftest import Cluster

QUESTION = "What is the weather like in Paris today?"
ANSWER_TOKENS = 96  # room for SmolLM2's tool call, object (indented) or answer after a result


class Forecast(BaseModel):
    city: str
    temperature: int


class Place(BaseModel):
    city: str
    country: str


class Report(BaseModel):
    """A nested model: its JSON schema names Place in ``$defs`` and points there with ``$ref``."""

    place: Place
    temperature: int


def weather_in(city: str) -> str:
    """What every library's weather tool answers, so a test can tell the result came back."""
    return f"Sunny and 21 degrees in {city}"


@pytest.fixture(scope="module")
def tools_url(tools_server_url: str) -> str:
    """The API of a server whose chat template lists tools (SmolLM2's has none)."""
    return f"{tools_server_url}/v1"


def async_client(base_url: str) -> openai.AsyncOpenAI:
    """A new client per test: an AsyncOpenAI keeps connections of the event loop it ran in."""
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


def sync_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


# openai-agents


def weather_agent(
    model_class: type[OpenAIChatCompletionsModel | OpenAIResponsesModel],
    base_url: str,
    model: str,
    cities: list[str],
    output_type: type | None = None,
    logit_bias: dict[str, int] | None = None,
) -> Agent:
    """An agent whose first turn must call its weather tool (the SDK then resets tool_choice
    to auto, as it does by default, so the next turn can answer)."""

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return weather_in(city)

    return Agent(
        name="forecaster",
        instructions="Answer questions about the weather. Use the get_weather tool.",
        model=model_class(model, async_client(base_url)),
        tools=[get_weather],
        output_type=output_type,
        model_settings=ModelSettings(
            tool_choice="required",
            temperature=0,
            max_tokens=ANSWER_TOKENS,
            extra_body={"logit_bias": logit_bias} if logit_bias else None,
        ),
    )


def run_agent(agent: Agent) -> RunResult:
    return Runner.run_sync(
        agent, QUESTION, max_turns=3, run_config=RunConfig(tracing_disabled=True)
    )


def assert_tool_ran_and_its_result_came_back(items: list[object], cities: list[str]) -> None:
    """The run's items: one call of get_weather with a string city, its result, then the
    answer (a second call would mean the SDK did not see the first as done)."""
    call, output, answer = items
    assert isinstance(call, ToolCallItem) and call.raw_item.name == "get_weather"
    [city] = cities
    assert isinstance(city, str) and city
    assert json.loads(call.raw_item.arguments) == {"city": city}
    assert isinstance(output, ToolCallOutputItem) and output.output == weather_in(city)
    assert output.call_id == call.raw_item.call_id
    assert isinstance(answer, MessageOutputItem)


AGENT_MODELS = pytest.mark.parametrize(
    "model_class", [OpenAIChatCompletionsModel, OpenAIResponsesModel], ids=["chat", "responses"]
)


@AGENT_MODELS
def test_openai_agents_calls_its_tool_then_answers(
    tools_url: str,
    cluster: Cluster,
    model_class: type[OpenAIChatCompletionsModel | OpenAIResponsesModel],
) -> None:
    cities: list[str] = []
    result = run_agent(weather_agent(model_class, tools_url, cluster.model, cities))
    assert_tool_ran_and_its_result_came_back(result.new_items, cities)
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # the call, then the answer after its result


@AGENT_MODELS
def test_openai_agents_with_tools_and_an_output_type(
    tools_url: str,
    cluster: Cluster,
    model_class: type[OpenAIChatCompletionsModel | OpenAIResponsesModel],
) -> None:
    """Tools and a structured output together: the model may call a tool or answer in the
    format, each under its own grammar, so the tool runs first and the answer is a Forecast."""
    cities: list[str] = []
    # After the forced call the model may call again or answer; the tiny model, greedy, calls
    # again until max_turns. "<" starts a call (chatml_tools' <tool_call>) and nothing else
    # here, so with it never chosen the second turn answers. The choice itself, either way:
    # tests/e2e/test_answer_grammar.py.
    [angle] = httpx.post(
        f"{tools_url.removesuffix('/v1')}/tokenize",
        json={"model": cluster.model, "prompt": "<", "add_special_tokens": False},
    ).json()["tokens"]
    agent = weather_agent(
        model_class, tools_url, cluster.model, cities, Forecast, logit_bias={str(angle): -100}
    )
    result = run_agent(agent)
    assert_tool_ran_and_its_result_came_back(result.new_items, cities)
    forecast = result.final_output
    assert isinstance(forecast, Forecast)
    assert isinstance(forecast.city, str) and isinstance(forecast.temperature, int)


# pydantic-ai


def test_pydantic_ai_runs_its_tool_and_returns_a_nested_output(
    tools_url: str, cluster: Cluster
) -> None:
    """The first step may only call get_weather; later steps only the output tool pydantic-ai
    makes of Report (``$defs`` and all): both calls are forced, by name, by the grammar."""

    def settings(ctx: RunContext[None]) -> PydanticModelSettings:
        first_step = ctx.run_step <= 1
        return PydanticModelSettings(
            temperature=0,
            max_tokens=ANSWER_TOKENS,
            tool_choice=["get_weather"] if first_step else "none",
        )

    model = OpenAIChatModel(
        cluster.model, provider=OpenAIProvider(openai_client=async_client(tools_url))
    )
    agent = PydanticAgent(model, output_type=Report, model_settings=settings)
    cities: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return weather_in(city)

    result = agent.run_sync(QUESTION)
    report = result.output
    assert isinstance(report, Report) and isinstance(report.place, Place)
    assert isinstance(report.place.city, str) and isinstance(report.place.country, str)
    assert isinstance(report.temperature, int)
    [city] = cities
    parts = [part for message in result.all_messages() for part in message.parts]
    calls = [part for part in parts if isinstance(part, ToolCallPart)]
    assert [call.tool_name for call in calls] == ["get_weather", "final_result"]
    assert calls[0].args_as_dict() == {"city": city}
    [returned] = [
        p for p in parts if isinstance(p, ToolReturnPart) and p.tool_name == "get_weather"
    ]
    assert returned.content == weather_in(city) and returned.tool_call_id == calls[0].tool_call_id


def test_pydantic_ai_default_output_tool_is_required(tools_url: str, cluster: Cluster) -> None:
    """pydantic-ai's default: the output is a tool the model must call (``tool_choice``
    required), here of a nested model, whose schema has ``$defs``."""
    model = OpenAIChatModel(
        cluster.model, provider=OpenAIProvider(openai_client=async_client(tools_url))
    )
    settings = PydanticModelSettings(temperature=0, max_tokens=ANSWER_TOKENS)
    result = PydanticAgent(model, output_type=Report, model_settings=settings).run_sync(QUESTION)
    report = result.output
    assert isinstance(report, Report) and isinstance(report.place, Place)
    assert isinstance(report.place.city, str) and isinstance(report.temperature, int)
    [call] = [
        part
        for message in result.all_messages()
        for part in message.parts
        if isinstance(part, ToolCallPart)
    ]
    assert call.tool_name == "final_result" and call.args_as_dict() == report.model_dump()


# instructor


def instructor_create(mode: instructor.Mode, base_url: str, model: str, **fields: object) -> object:
    client = instructor.from_openai(sync_client(base_url), mode=mode)
    tokens = "max_output_tokens" if mode is instructor.Mode.RESPONSES_TOOLS else "max_tokens"
    return client.create_with_completion(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_retries=1,  # one attempt: a malformed answer fails the test instead of a retry
        **{tokens: ANSWER_TOKENS},
        **fields,
    )


def test_instructor_tools_mode_fills_a_nested_model(tools_url: str, cluster: Cluster) -> None:
    report, completion = instructor_create(
        instructor.Mode.TOOLS, tools_url, cluster.model, response_model=Report
    )
    assert isinstance(report, Report) and isinstance(report.place, Place)
    assert isinstance(report.place.city, str) and isinstance(report.temperature, int)
    [call] = completion.choices[0].message.tool_calls  # instructor named its Report tool
    assert call.function.name == "Report"
    assert json.loads(call.function.arguments) == report.model_dump()


def test_instructor_tools_mode_on_a_template_without_tools(cluster: Cluster) -> None:
    """The cluster's own servers render SmolLM2's template, which has no tools: a named
    tool_choice is still answered, the call forced by the grammar, as vLLM does."""
    forecast, completion = instructor_create(
        instructor.Mode.TOOLS, f"{cluster.urls[0]}/v1", cluster.model, response_model=Forecast
    )
    assert isinstance(forecast.city, str) and isinstance(forecast.temperature, int)
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "Forecast"
    assert json.loads(call.function.arguments) == forecast.model_dump()


def test_instructor_json_schema_mode(tools_url: str, cluster: Cluster) -> None:
    forecast, completion = instructor_create(
        instructor.Mode.JSON_SCHEMA, tools_url, cluster.model, response_model=Forecast
    )
    assert isinstance(forecast, Forecast)
    assert isinstance(forecast.city, str) and isinstance(forecast.temperature, int)
    message = completion.choices[0].message
    assert message.tool_calls is None
    assert json.loads(message.content) == forecast.model_dump()


def test_instructor_create_partial_streams_the_object_as_it_grows(
    tools_url: str, cluster: Cluster
) -> None:
    """Streamed tool-call arguments, as instructor reads them (the first ``tool_calls`` entry
    of each chunk): partial Forecasts that fill in, ending in the whole call's object."""
    client = instructor.from_openai(sync_client(tools_url), mode=instructor.Mode.TOOLS)
    request = dict(
        model=cluster.model,
        messages=[{"role": "user", "content": QUESTION}],
        response_model=Forecast,
        temperature=0,
        max_tokens=ANSWER_TOKENS,
        max_retries=1,
    )
    partials = list(client.create_partial(**request))
    whole = client.create(**request)
    assert len(partials) > 2 and all(isinstance(partial, Forecast) for partial in partials)
    assert partials[0].city is None and partials[0].temperature is None
    assert partials[-1].model_dump() == whole.model_dump()
    assert isinstance(whole.city, str) and isinstance(whole.temperature, int)


def test_instructor_responses_tools_mode(tools_url: str, cluster: Cluster) -> None:
    forecast, response = instructor_create(
        instructor.Mode.RESPONSES_TOOLS, tools_url, cluster.model, response_model=Forecast
    )
    assert isinstance(forecast, Forecast)
    assert isinstance(forecast.city, str) and isinstance(forecast.temperature, int)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "Forecast"
    assert json.loads(call.arguments) == forecast.model_dump()


# langchain-openai


def chat_openai(base_url: str, model: str) -> ChatOpenAI:
    return ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key="unused",
        temperature=0,
        max_tokens=ANSWER_TOKENS,
        max_retries=0,
    )


def test_langchain_bind_tools_calls_and_reads_the_result(tools_url: str, cluster: Cluster) -> None:
    @langchain_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return weather_in(city)

    llm = chat_openai(tools_url, cluster.model)
    question = HumanMessage(QUESTION)
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert isinstance(called, AIMessage)
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert isinstance(call["args"]["city"], str)
    result = get_weather.invoke(call)  # a ToolMessage answering the call by its id
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    assert result.content == weather_in(call["args"]["city"])
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([question, called, result])
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert isinstance(answer.content, str) and answer.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(tools_url: str, cluster: Cluster, method: str) -> None:
    llm = chat_openai(tools_url, cluster.model)
    structured = llm.with_structured_output(Report, method=method, include_raw=True)
    reply = structured.invoke(QUESTION)
    assert reply["parsing_error"] is None
    report = reply["parsed"]
    assert isinstance(report, Report) and isinstance(report.place, Place)
    assert isinstance(report.place.city, str) and isinstance(report.temperature, int)
    raw = reply["raw"]
    if method == "function_calling":
        [call] = raw.tool_calls
        assert call["name"] == "Report" and call["args"] == report.model_dump()
    else:
        assert not raw.tool_calls and json.loads(raw.content) == report.model_dump()
