"""The grammar of an answer made of parts, through real processes and the openai client:
tools beside a response format (a call or an answer in the format, each under its own
grammar), the Responses API's ``text.format`` beside a named tool, and a format after the
reasoning of a model that thinks (the reasoning free, the format from its end marker on).

Servers with three templates share the cluster's engine (SmolLM2): ``chatml_tools``; QwQ's,
whose prompt opens ``<think>`` itself; Qwen3's, whose model may open one. Which way an answer
goes is made certain with ``logit_bias`` on the tokens that start each way: a large bias wins
the first token wherever the grammar allows it, and the grammar then holds the rest.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from functools import cache
from typing import Any

import httpx
import openai
import pytest

from tandem.testing.processes import REPO_ROOT, free_port, start_server, stop
from tests.conftest import Cluster, cluster_model

CITY = {"enum": ["Paris", "London"]}  # no "<" nor "{" in a call's arguments
WEATHER = {
    "type": "object",
    "properties": {"city": CITY},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]
REPORT = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}},
    "required": ["sunny"],
    "additionalProperties": False,
}
REPORT_FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT}}
QUESTION = [{"role": "user", "content": "Is it sunny in Paris today?"}]
TEMPLATES = REPO_ROOT / "tests/server/templates"


@pytest.fixture(scope="module")
def urls(cluster: Cluster) -> Iterator[dict[str, str]]:
    """A server per template, by name, on the cluster's engine."""
    templates = {
        "tools": "chatml_tools",
        "qwq": str(TEMPLATES / "Qwen-QwQ-32B.jinja"),
        "qwen3": str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja"),
    }
    servers, urls = [], {}
    try:
        for name, template in templates.items():
            port = free_port()
            servers.append(
                start_server(
                    cluster.engine_address, port, cluster.log_path, "--chat-template", template
                )
            )
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls
    finally:
        for server in servers:
            stop(server, signal.SIGTERM)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@cache
def model(url: str) -> str:
    return cluster_model(url)


def token_ids(url: str, *texts: str) -> list[int]:
    """The ids ``texts`` tokenize to, each apart, as the server tokenizes them."""
    ids: list[int] = []
    for text in texts:
        reply = httpx.post(
            f"{url}/tokenize",
            json={"model": model(url), "prompt": text, "add_special_tokens": False},
        ).json()
        ids += reply["tokens"]
    return ids


def favour(url: str, *texts: str, bias: int = 100) -> dict[str, int]:
    """A logit bias that makes the first of these texts' tokens the grammar allows win (a
    negative ``bias``: never chosen)."""
    return {str(token): bias for token in token_ids(url, *texts)}


def chat(url: str, **fields: Any) -> Any:
    fields = {"messages": QUESTION, "temperature": 0, "max_tokens": 60, **fields}
    return client(url).chat.completions.create(model=model(url), **fields).choices[0]


def assert_report(text: str | None) -> None:
    assert text is not None
    report = json.loads(text)
    assert set(report) == {"sunny"} and isinstance(report["sunny"], bool)


def assert_weather_call(calls: Any) -> None:
    assert [call.function.name for call in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"] in CITY["enum"]


def test_tools_and_a_response_format_answer_with_a_call_or_the_format(
    urls: dict[str, str],
) -> None:
    url = urls["tools"]
    both = {"tools": TOOLS, "response_format": REPORT_FORMAT, "parallel_tool_calls": False}
    # "<" starts only a call, "{" only an answer in the format.
    call = chat(url, **both, logit_bias=favour(url, "<"))
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert_weather_call(call.message.tool_calls)
    answer = chat(url, **both, logit_bias=favour(url, "{"))
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert_report(answer.message.content)

    # Streamed, the call's deltas make the same call.
    stream = client(url).chat.completions.create(
        model=model(url), messages=QUESTION, temperature=0, max_tokens=60, stream=True,
        logit_bias=favour(url, "<"), **both,
    )  # fmt: skip
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    names = [c.function.name for d in deltas for c in d.delta.tool_calls or [] if c.function.name]
    arguments = "".join(
        c.function.arguments or "" for d in deltas for c in d.delta.tool_calls or []
    )
    assert names == ["get_weather"] and arguments == call.message.tool_calls[0].function.arguments
    assert deltas[-1].finish_reason == "tool_calls"

    # "none": the format alone, even where a call would win; "required": the call alone.
    none = chat(url, **both, tool_choice="none", logit_bias=favour(url, "<"))
    assert none.finish_reason == "stop" and not none.message.tool_calls
    assert_report(none.message.content)
    required = chat(url, **both, tool_choice="required", logit_bias=favour(url, "{"))
    assert required.finish_reason == "tool_calls"
    assert_weather_call(required.message.tool_calls)


def test_responses_text_format_with_a_named_tool_makes_the_call(urls: dict[str, str]) -> None:
    url = urls["tools"]
    fields: dict[str, Any] = {
        "model": model(url),
        "input": "Is it sunny in Paris today?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "text": {"format": {"type": "json_schema", "name": "report", "schema": REPORT}},
        "temperature": 0,
        "max_output_tokens": 40,
    }
    named = client(url).responses.create(
        **fields, tool_choice={"type": "function", "name": "get_weather"}
    )
    assert named.status == "completed"
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in CITY["enum"]
    # With "auto", the answer may be text in the format.
    text = client(url).responses.create(
        **fields, parallel_tool_calls=False, extra_body={"logit_bias": favour(url, "{")}
    )
    assert [item.type for item in text.output] == ["message"]
    assert_report(text.output_text)


def test_the_format_starts_after_the_free_reasoning(urls: dict[str, str]) -> None:
    """QwQ's prompt opens the reasoning: it is free text, here the markers' favoured tokens
    (not JSON), and after its end the content follows the format. Cut short, it is all
    reasoning, free text still."""
    url = urls["qwq"]
    reply = chat(url, response_format=REPORT_FORMAT, logit_bias=favour(url, "<think>", "</think>"))
    assert reply.finish_reason == "stop"
    assert reply.message.model_extra["reasoning_content"]
    assert_report(reply.message.content)
    short = chat(url, response_format=REPORT_FORMAT, max_tokens=8)
    assert short.finish_reason == "length" and short.message.content is None
    assert not short.message.model_extra["reasoning_content"].lstrip().startswith("{")


def test_a_format_leaves_the_reasoning_block_optional(urls: dict[str, str]) -> None:
    """Qwen3's model may open a reasoning block before the format: "<" starts only that
    block, whose text is free (more "<"); without it, the answer is in the format at once
    (the model, left alone, opens the block here)."""
    url = urls["qwen3"]
    thinks = chat(url, response_format=REPORT_FORMAT, max_tokens=8, logit_bias=favour(url, "<"))
    assert thinks.finish_reason == "length" and thinks.message.content is None
    assert thinks.message.model_extra["reasoning_content"].startswith("<<")
    direct = chat(url, response_format=REPORT_FORMAT, logit_bias=favour(url, "<", bias=-100))
    assert direct.finish_reason == "stop"
    assert direct.message.model_extra.get("reasoning_content") is None
    assert_report(direct.message.content)
