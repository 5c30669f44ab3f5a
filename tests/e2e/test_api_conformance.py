"""API conformance: every parameter the openai SDK documents for chat completions,
completions, the Responses API and embeddings, sent through the SDK to a real engine and
server, gets vLLM's behaviour (checked on the answer) or a clear 400 naming it. The tables
must cover the SDK's parameters: one it adds fails ``test_the_tables_cover_the_sdk`` until
it has a row here.

And the endpoints vLLM answers beyond those: CORS preflights (its --allowed-origins and
friends), /ping, /v1/models' vLLM fields, echo with logprobs, and stored responses
(previous_response_id, GET and DELETE, truncation auto).

One server of its own (ChatML with tools, one allowed origin, a store of 3 responses)
beside the session's two, on the session's engine."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from engine.config import ServiceConfig, default_max_num_seqs
from tandem.testing.processes import free_port, start_server, stop
from tests.conftest import Cluster

ORIGIN = "https://app.example"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
YES_OR_NO = {"type": "string", "enum": ["yes", "no"]}
PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Server:
    url: str
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def server(cluster: Cluster) -> Iterator[Server]:
    port = free_port()
    process = start_server(
        cluster.engine_address,
        port,
        cluster.log_path,
        "--chat-template",
        "chatml_tools",
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--allow-credentials",
        "--responses-store-max",
        "3",
    )
    try:
        yield Server(f"http://127.0.0.1:{port}", cluster.model)
    finally:
        stop(process)


# What a parameter's row expects: ``Refused`` (a 400 naming the parameter; 404 for an unknown
# previous response), or a check of the answer (None: the request succeeding is the check).
@dataclass(frozen=True)
class Refused:
    param: str


Check = Callable[[Any], None] | Refused | None


@dataclass(frozen=True)
class Row:
    """A parameter's value (None: not sent) and what the answer must show. The rows of an
    endpoint go in one request, each checked on its answer, but for those ``alone``
    (refusals, streams, and fields that need others: ``with_fields``)."""

    value: Any
    expect: Check = None
    alone: bool = False
    with_fields: dict[str, Any] | None = None


def _all(*checks: Callable[[Any], bool]) -> Callable[[Any], None]:
    def check(answer: Any) -> None:
        for one in checks:
            assert one(answer), answer

    return check


def _alone(value: Any, expect: Check = None, **with_fields: Any) -> Row:
    return Row(value, expect, alone=True, with_fields=with_fields)


# vLLM takes OpenAI fields it does not know and ignores them (a warning in its log): so does
# this server. Those it knows and does not serve are refused.
CHAT: dict[str, Row] = {
    "messages": Row(MESSAGES),
    "model": Row(None),  # the server's model, in every request
    "audio": Row({"voice": "alloy", "format": "wav"}),
    "frequency_penalty": Row(0.5),
    "function_call": Row("none"),
    "functions": Row([WEATHER_TOOL["function"]]),
    "logit_bias": Row({"0": -100}),
    "logprobs": Row(True, _all(lambda a: a.choices[0].logprobs.content)),
    "max_completion_tokens": Row(3, _all(lambda a: a.usage.completion_tokens <= 2 * 3)),
    "max_tokens": _alone(1, _all(lambda a: a.usage.completion_tokens == 1)),
    "metadata": Row({"k": "v"}),
    "modalities": Row(["text"]),
    "moderation": Row(None),
    "n": Row(2, _all(lambda a: [c.index for c in a.choices] == [0, 1])),
    "parallel_tool_calls": Row(False),
    "prediction": Row({"type": "content", "content": "Paris"}),
    "presence_penalty": Row(0.5),
    "prompt_cache_key": Row("k"),
    "prompt_cache_options": Row(None),
    "prompt_cache_retention": Row("in_memory"),
    "reasoning_effort": Row("low"),
    "response_format": _alone(
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": YES_OR_NO}},
        _all(lambda a: json.loads(a.choices[0].message.content) in ("yes", "no")),
        max_tokens=8,
    ),
    "safety_identifier": Row("user-1"),
    "seed": Row(7),
    "service_tier": Row("auto"),
    "stop": Row(["Paris"], _all(lambda a: "Paris" not in a.choices[0].message.content)),
    "store": Row(False),
    "stream": _alone(True, max_tokens=2),
    "stream_options": _alone({"include_usage": True}, stream=True, max_tokens=2),
    "temperature": Row(0.0),
    "tool_choice": _alone(
        "required",
        _all(lambda a: a.choices[0].message.tool_calls[0].function.name == "get_weather"),
        tools=[WEATHER_TOOL],
        max_tokens=30,
    ),
    "tools": _alone(
        [WEATHER_TOOL], _all(lambda a: not a.choices[0].message.tool_calls), tool_choice="none"
    ),
    "top_logprobs": Row(2, _all(lambda a: len(a.choices[0].logprobs.content[0].top_logprobs) == 2)),
    "top_p": Row(0.9),
    "user": Row("user-1"),
    "verbosity": Row("low"),
    "web_search_options": Row({}),  # not vLLM's: ignored, as vLLM ignores it
}

COMPLETIONS: dict[str, Row] = {
    "model": Row(None),
    "prompt": Row(PROMPT),
    "best_of": _alone(2, _all(lambda a: len(a.choices) == 1)),
    "echo": _alone(True, _all(lambda a: a.choices[0].text.startswith(PROMPT))),
    "frequency_penalty": Row(0.5),
    "logit_bias": Row({"0": -100}),
    "logprobs": Row(2, _all(lambda a: len(a.choices[0].logprobs.top_logprobs[0]) == 2)),
    "max_tokens": Row(3, _all(lambda a: a.usage.completion_tokens <= 2 * 3)),
    "n": Row(2, _all(lambda a: len(a.choices) == 2)),
    "presence_penalty": Row(0.5),
    "seed": Row(7),
    "stop": Row(["\n"], _all(lambda a: "\n" not in a.choices[0].text)),
    "stream": _alone(True),
    "stream_options": _alone({"include_usage": True}, stream=True),
    # SmolLM2's tokenizer has no fill-in-the-middle tokens (vLLM refuses it then too).
    "suffix": _alone("!", Refused("suffix")),
    "temperature": Row(0.0),
    "top_p": Row(0.9),
    "user": Row("user-1"),
}

RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
RESPONSES: dict[str, Row] = {
    "access_programs": Row(None),
    "background": _alone(True, Refused("background")),
    "background_options": Row(None),
    "context_management": Row(None),
    "conversation": _alone("conv_1", Refused("conversation")),
    "image": Row(None),
    "include": Row(
        ["message.output_text.logprobs", "reasoning.encrypted_content"],
        _all(lambda a: a.output[0].content[0].logprobs),
    ),
    "input": Row("What is the capital of France?"),
    "instructions": Row("Answer in one word.", _all(lambda a: a.instructions)),
    "max_output_tokens": Row(3, _all(lambda a: a.usage.output_tokens <= 3)),
    "max_tool_calls": Row(1),
    "metadata": Row({"k": "v"}, _all(lambda a: a.metadata == {"k": "v"})),
    "model": Row(None),
    "moderation": Row(None),
    "parallel_tool_calls": Row(False),
    "previous_response_id": _alone("resp_unknown", Refused("previous_response_id")),
    "prompt": _alone({"id": "pmpt_1"}, Refused("prompt")),
    "prompt_cache_key": Row("k"),
    "prompt_cache_options": Row(None),
    "prompt_cache_retention": Row("in_memory"),
    "reasoning": Row({"effort": "low"}),
    "safety_identifier": Row("user-1"),
    "service_tier": Row("auto"),
    "store": Row(False, _all(lambda a: a.store is False)),
    "stream": _alone(True, max_output_tokens=2),
    "stream_options": _alone({"include_obfuscation": False}, stream=True, max_output_tokens=2),
    "temperature": Row(0.0),
    "text": _alone(
        {"format": {"type": "json_schema", "name": "answer", "schema": YES_OR_NO}},
        _all(lambda a: json.loads(a.output_text) in ("yes", "no")),
        max_output_tokens=8,
    ),
    "tool_choice": _alone(
        "required",
        _all(lambda a: [item.type for item in a.output] == ["function_call"]),
        tools=[RESPONSES_TOOL],
        max_output_tokens=30,
    ),
    "tools": _alone(
        [RESPONSES_TOOL],
        _all(lambda a: [item.type for item in a.output] == ["message"]),
        tool_choice="none",
        max_output_tokens=2,
    ),
    "top_logprobs": Row(
        2, _all(lambda a: len(a.output[0].content[0].logprobs[0].top_logprobs) == 2)
    ),
    "top_p": Row(0.9),
    "truncation": Row("auto", _all(lambda a: a.truncation == "auto")),
    "user": Row("user-1"),
}

EMBEDDINGS: dict[str, Row] = {
    "input": Row(["Paris", "London"], _all(lambda a: len(a.data) == 2)),
    "model": Row(None),
    "dimensions": _alone(8, Refused("dimensions")),
    "encoding_format": Row("float", _all(lambda a: len(a.data[0].embedding) > 8)),
    "user": Row("user-1"),
}

# Each endpoint's table, and what a request alone sends besides its row.
ENDPOINTS: dict[str, tuple[dict[str, Row], dict[str, Any]]] = {
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}),
    "completions": (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}),
    "responses": (RESPONSES, {"input": "Hi", "max_output_tokens": 4, "temperature": 0}),
    "embeddings": (EMBEDDINGS, {"input": "Paris"}),
}


def _create(client: openai.OpenAI, endpoint: str) -> Callable[..., Any]:
    return {
        "chat": client.chat.completions.create,
        "completions": client.completions.create,
        "responses": client.responses.create,
        "embeddings": client.embeddings.create,
    }[endpoint]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_tables_cover_the_sdk(endpoint: str) -> None:
    parameters = inspect.signature(
        _create(openai.OpenAI(api_key="unused", base_url="http://unused"), endpoint)
    ).parameters
    documented = {name for name in parameters if not name.startswith("extra_")} - {"timeout"}
    table = ENDPOINTS[endpoint][0]
    assert documented <= set(table), f"rows to add: {sorted(documented - set(table))}"
    # Rows of a newer SDK's parameters (the dev extra pins an older one for instructor) are
    # never sent by this one.
    newer = {name for name in set(table) - documented if table[name].value is not None}
    assert not newer, f"rows this SDK cannot send: {sorted(newer)}"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_parameters_together(server: Server, endpoint: str) -> None:
    table, _ = ENDPOINTS[endpoint]
    together = {f: row for f, row in table.items() if not row.alone and row.value is not None}
    request = {"model": server.model, **{field: row.value for field, row in together.items()}}
    answer = _create(server.client(), endpoint)(**request)
    for row in together.values():
        if row.expect is not None:
            assert not isinstance(row.expect, Refused)
            row.expect(answer)


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [(e, f) for e, (table, _) in ENDPOINTS.items() for f, row in table.items() if row.alone],
)
def test_the_parameters_alone(server: Server, endpoint: str, field: str) -> None:
    table, base = ENDPOINTS[endpoint]
    row = table[field]
    request = {"model": server.model, **base, field: row.value, **(row.with_fields or {})}
    create = _create(server.client(), endpoint)
    if isinstance(row.expect, Refused):
        with pytest.raises(openai.APIStatusError) as refused:
            create(**request)
        assert refused.value.status_code in (400, 404), refused.value
        assert refused.value.body["param"] == row.expect.param
        assert refused.value.body["message"]
        return
    answer = create(**request)
    if request.get("stream"):
        chunks = list(answer)
        assert chunks
        if field == "stream_options" and endpoint != "responses":
            assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
        return
    if row.expect is not None:
        row.expect(answer)


def test_cors_preflights_and_headers(server: Server, cluster: Cluster) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    allowed = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = httpx.options(
        f"{server.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert other.status_code == 400  # Starlette's answer to an origin not allowed
    simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    # vLLM's defaults (the session's servers): every origin, no credentials.
    default = httpx.options(
        f"{cluster.urls[0]}/v1/chat/completions",
        headers={**preflight, "Origin": "https://anyone.example"},
    )
    assert default.status_code == 200
    assert default.headers["access-control-allow-origin"] == "*"


def test_ping_and_model_cards(server: Server) -> None:
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["root"] == card["id"] == server.model and card["parent"] is None
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"]
    assert httpx.get(f"{server.url}/v1/models/{server.model}").json() == card


def test_echo_with_logprobs_scores_the_prompt_first(server: Server) -> None:
    client = server.client()
    prompt = "The capital of France is"
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    request = dict(model=server.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    plain = client.completions.create(**request).choices[0]
    echoed = client.completions.create(echo=True, **request).choices[0]
    logprobs = echoed.logprobs
    assert echoed.text == prompt + plain.text
    assert len(logprobs.tokens) == len(prompt_ids) + len(plain.logprobs.tokens)
    # The first prompt token has nothing before it; the others their log-probabilities.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1 : len(prompt_ids)])
    # The same tokens' (the prompt's positions computed beside them: not bit for bit).
    assert logprobs.token_logprobs[len(prompt_ids) :] == pytest.approx(
        plain.logprobs.token_logprobs, abs=1e-4
    )
    assert "".join(logprobs.tokens) == echoed.text
    assert logprobs.text_offset[len(prompt_ids)] == len(prompt)
    streamed = list(client.completions.create(echo=True, stream=True, **request))
    assert "".join(chunk.choices[0].text for chunk in streamed) == echoed.text
    assert streamed[0].choices[0].text == prompt
    assert (
        streamed[0].choices[0].logprobs.token_logprobs == logprobs.token_logprobs[: len(prompt_ids)]
    )


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server: Server) -> None:
    """OpenAI's and vLLM's way to score a prompt: echo, logprobs and max_tokens 0 answer
    the prompt and its log-probabilities, and no completion, streamed or not."""
    client = server.client()
    request = dict(model=server.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    answer = client.completions.create(**request)
    (choice,) = answer.choices
    assert choice.text == PROMPT and "".join(choice.logprobs.tokens) == PROMPT
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 0
    stream = client.completions.create(
        stream=True, stream_options={"include_usage": True}, **request
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == PROMPT
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{**request, "echo": False})
    assert refused.value.body["param"] == "max_tokens"


def test_stored_responses_go_on_and_are_forgotten(server: Server, cluster: Cluster) -> None:
    client = server.client()
    request = dict(model=server.model, temperature=0, max_output_tokens=8)
    first = client.responses.create(input="My name is Ada.", **request)
    assert first.store is True
    again = client.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.id == first.id
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, **request
    )
    assert second.previous_response_id == first.id
    # Its prompt holds the first turn, question and answer, then the new question.
    alone = client.responses.create(input="What is my name?", **request)
    whole = client.responses.create(
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        store=False,
        **request,
    )
    assert second.usage.input_tokens == whole.usage.input_tokens > alone.usage.input_tokens
    assert second.output_text == whole.output_text
    # Not stored: not found; nor in another server (each keeps its own).
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    with pytest.raises(openai.NotFoundError) as elsewhere:
        cluster.client().responses.create(
            input="Hi", previous_response_id=first.id, model=server.model
        )
    assert elsewhere.value.body["code"] == "previous_response_not_found"
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    # A store of 3: the oldest is forgotten first.
    for _ in range(3):
        client.responses.create(input="Hi", **request)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_truncation_auto_drops_the_oldest_items(server: Server) -> None:
    client = server.client()
    context = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    long_turn = "Paris " * context  # more tokens than the context holds
    items = [
        {"role": "user", "content": long_turn},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "Thanks!"},
    ]
    request = dict(model=server.model, input=items, temperature=0, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**request)
    assert refused.value.body["code"] == "context_length_exceeded"
    truncated = client.responses.create(truncation="auto", **request)
    kept = client.responses.create(
        model=server.model, input=items[1:], temperature=0, max_output_tokens=4
    )
    assert truncated.truncation == "auto"
    assert truncated.usage.input_tokens == kept.usage.input_tokens
    assert truncated.output_text == kept.output_text


def test_a_request_no_idle_engine_takes_is_a_400(server: Server) -> None:
    """A request of more engine requests (choices, embedding inputs) than an idle engine takes
    at once (--max-num-seqs plus --max-queued-requests, the session engine's defaults) can
    never be admitted: a 400 naming the field, not a 429 whose retries all fail."""
    places = default_max_num_seqs(1) + ServiceConfig().max_queued_requests
    client = server.client()
    with pytest.raises(openai.BadRequestError) as completions:
        client.completions.create(
            model=server.model, prompt=["a"] * (places // 128 + 1), n=128, max_tokens=1
        )
    assert completions.value.body["param"] == "prompt"
    assert str(places) in completions.value.body["message"]
    with pytest.raises(openai.BadRequestError) as embeddings:
        client.embeddings.create(model=server.model, input=["a"] * (places + 1))
    assert embeddings.value.body["param"] == "input"
