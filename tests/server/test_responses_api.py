"""The Responses API without an engine: what it accepts and refuses, the chat request it
maps to, and its response object and stream events checked against the openai client's
own types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from protocol import FinishReason, Scheduling, TokenLogprobs
from server.answer import Answer
from server.errors import ApiError
from server.generation import TextDelta
from server.openai_schemas import parse_request
from server.prompts import chat_generation
from server.responses_output import ResponseEvents, ResponseObject
from server.responses_schemas import ResponsesRequest
from server.served_model import ServedModel
from server.tool_calling import ChatParsing, tool_use
from tests.server.renderings import CHATML_TOOLS
from tests.server.test_openai_schemas import CHATML, MAX_MODEL_LEN, MODEL, assert_error, handshake
from tests.server.test_openai_schemas import make_client as make_app_client


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    yield from make_app_client(CHATML)


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello", **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ],
)
def test_what_is_not_served_is_refused(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    response = client.post("/v1/responses", json=body(**fields))
    message = assert_error(response, 400, param, "unsupported_parameter")
    assert "not supported" in message


def test_an_unknown_previous_response_is_not_found(client: TestClient) -> None:
    response = client.post("/v1/responses", json=body(previous_response_id="resp_1"))
    assert_error(response, 404, "previous_response_id", "previous_response_not_found")
    assert_error(client.get("/v1/responses/resp_1"), 404, "response_id", "response_not_found")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"input": [{"role": {"user": 1}, "content": "hi"}]}, "input"),  # unhashable: was a 500
        ({"input": [{"role": ["user"], "content": "hi"}]}, "input"),
        ({"input": 5}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without include, it would show nothing
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        # As the chat request made from it takes its tools: a 400, not a 500 there.
        ({"tools": [{"type": "function", "name": ""}]}, "tools"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "f", "strict": "maybe"}]}, "tools"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": "[" * 100_000}}},
            "text.format",
        ),
        ({"priority": 2**63}, "priority"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
        ({"tools": [TOOL]}, "tool_choice"),  # "auto": plain ChatML names no parser
        ({"repetition_penalty": 0}, "repetition_penalty"),  # validated as chat's
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (
            {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
            "text.format",
        ),
    ],
)
def test_bad_fields(client: TestClient, fields: dict[str, Any], param: str) -> None:
    assert_error(client.post("/v1/responses", json=body(**fields)), 400, param)


def test_truncation_auto_finds_its_cut_in_few_renders(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Truncation auto drops the fewest oldest items that make the prompt fit, found by
    halves: each try renders and tokenizes the whole prompt, and trying one cut after another
    cost a long conversation quadratic time. (The prompt made, the request goes on to the
    engine, which this test has none of: a 503.)"""
    renders = []

    async def counted(*args: Any) -> Any:
        renders.append(len(args[1].messages))
        return await chat_generation(*args)

    monkeypatch.setattr("server.routes.responses.chat_generation", counted)
    items = [{"role": "user", "content": f"hello {index}"} for index in range(256)]
    response = client.post("/v1/responses", json=body(input=items, truncation="auto"))
    assert response.status_code == 503, response.text
    assert len(renders) <= 2 + 8, renders  # the whole, then a halving search over 255 cuts
    assert renders[0] == 256 and 1 < renders[-1] < MAX_MODEL_LEN


def test_missing_input_unknown_model_and_long_prompt(client: TestClient) -> None:
    response = client.post("/v1/responses", json={"model": MODEL})
    assert_error(response, 400, "input", "missing_required_parameter")
    assert_error(client.post("/v1/responses", json=body(model="gpt-5")), 404, "model")
    long = body(input="hello world " * MAX_MODEL_LEN)
    message = assert_error(
        client.post("/v1/responses", json=long), 400, "input", "context_length_exceeded"
    )
    assert "input" in message


def test_what_is_served_passes_validation(client: TestClient) -> None:
    accepted = body(
        input=[
            {"role": "developer", "content": "x"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        ],
        instructions="y",
        store=True,  # accepted, though nothing is stored
        metadata={"k": "v"},
        user="u",
        parallel_tool_calls=False,
        tools=[],
        tool_choice="auto",
        text={"format": {"type": "text"}, "verbosity": "medium"},
        reasoning={"effort": None, "summary": None},
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        truncation="disabled",
        background=False,
        max_output_tokens=4,
        top_k=5,
        logit_bias={"3": 1.5},
    )
    # No engine behind this app: a 503 means the request was valid and was sent.
    assert_error(client.post("/v1/responses", json=accepted), 503, None, "engine_unavailable")


def test_its_place_in_the_queue_is_a_chat_requests() -> None:
    """vLLM's priority and the user whose requests take turns reach the engine's queue."""
    request = parse_request(ResponsesRequest, json.dumps(body(priority=-2, user="ada")))
    assert request.chat_request().scheduling("10.0.0.1") == Scheduling(-2, "ada")
    anonymous = parse_request(ResponsesRequest, json.dumps(body()))
    assert anonymous.chat_request().scheduling("10.0.0.1") == Scheduling(0, "10.0.0.1")


def test_the_chat_request_it_maps_to() -> None:
    request = parse_request(
        ResponsesRequest,
        json.dumps(
            body(
                input=[
                    {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                ],
                instructions="You are terse.",
                max_output_tokens=7,
                temperature=0.5,
                include=["message.output_text.logprobs"],
                top_logprobs=2,
                # vLLM's extra sampling fields, which chat has too.
                top_k=3,
                seed=-1,
                stop="END",
                ignore_eos=True,
                repetition_penalty=1.2,
                skip_special_tokens=False,
                include_stop_str_in_output=True,
                structured_outputs={"regex": "[a-z]+"},
                reasoning={"effort": "low"},
            )
        ).encode(),
    )
    chat = request.chat_request()
    assert chat.template_kwargs() == {"reasoning_effort": "low"}  # as vLLM gives it
    shared = {
        "top_k": 3,
        "seed": -1,
        "stop": ["END"],
        "ignore_eos": True,
        "repetition_penalty": 1.2,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "structured_outputs": {"regex": "[a-z]+"},
    }
    assert {name: getattr(chat, name) for name in shared} == shared
    model = ServedModel.from_handshake(handshake(CHATML))
    sampling = chat.sampling_params(10, model)
    assert (sampling.top_k, sampling.seed, sampling.ignore_eos) == (3, 2**63 - 1, True)
    assert sampling.repetition_penalty == 1.2 and sampling.structured_output is not None
    assert chat.hidden_token_ids(model) == frozenset()  # skip_special_tokens false
    assert [message.model_dump(exclude_unset=True) for message in chat.messages] == [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert chat.requested_max_tokens() == 7 and chat.temperature == 0.5
    assert chat.requested_logprobs() == 2
    assert chat.prompt_param == "input"
    plain = parse_request(ResponsesRequest, b'{"input": "hi"}').chat_request()
    assert plain.requested_logprobs() is None
    assert [m.model_dump(exclude_unset=True) for m in plain.messages] == [
        {"role": "user", "content": "hi"}
    ]


# The response object and the stream's events


def response_object(**fields: Any) -> ResponseObject:
    request = parse_request(ResponsesRequest, json.dumps(body(**fields)).encode())
    answer = Answer.new("resp_", "response", MODEL, "abc", 4)
    model = ServedModel.from_handshake(handshake(CHATML))
    prepared = asyncio.run(chat_generation(model, request.chat_request()))
    return ResponseObject(answer, request, model, prepared.parsing)


def deltas(finish_reason: str) -> list[TextDelta]:
    def logprobs(token_id: int) -> TokenLogprobs:
        return TokenLogprobs(-0.5, [token_id, 9], [-0.5, -1.5])

    return [
        TextDelta("hel", None, 1, [5], [logprobs(5)]),
        TextDelta("", None, 2, [6], [logprobs(6)]),  # a token held back: no text yet
        TextDelta("lo", finish_reason, 3, [7], [logprobs(7)]),
    ]


def parse_events(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    return events


def stream(response: ResponseObject, finish_reason: str) -> list[dict[str, Any]]:
    events = ResponseEvents(response)
    written = events.start()
    for delta in deltas(finish_reason):
        written += events.render(0, delta)
    written += events.finish(3) + events.end()
    return parse_events("".join(written))


def test_streamed_events_parse_as_the_openai_client_types_them() -> None:
    response = response_object(include=["message.output_text.logprobs"], top_logprobs=1)
    events = stream(response, FinishReason.STOP)
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(event) for event in events]
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "hello"
    final = parsed[-1].response
    assert final.id == "resp_abc" and final.status == "completed"
    assert final.output_text == "hello"
    assert final.usage.input_tokens == 4 and final.usage.output_tokens == 3
    logprobs = final.output[0].content[0].logprobs
    assert [entry.logprob for entry in logprobs] == [-0.5] * 3
    assert [len(entry.top_logprobs) for entry in logprobs] == [2] * 3
    # The whole response is the stream's last one.
    pieces = deltas(FinishReason.STOP)
    whole = TextDelta(
        "hello",
        FinishReason.STOP,
        3,
        [token for piece in pieces for token in piece.token_ids],
        [token for piece in pieces for token in piece.logprobs],
    )
    assert response.final(whole) == events[-1]["response"]
    assert Response.model_validate(response.final(whole)).output_text == "hello"


def test_length_makes_an_incomplete_response() -> None:
    response = response_object(max_output_tokens=3)
    events = stream(response, FinishReason.LENGTH)
    final = TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
    assert final.type == "response.incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.max_output_tokens == 3
    assert final.response.output[0].status == "incomplete"
    whole = Response.model_validate(response.final(TextDelta("hel", FinishReason.LENGTH, 3)))
    assert whole.status == "incomplete" and whole.output_text == "hel"


def test_an_error_mid_stream_fails_the_response() -> None:
    events = ResponseEvents(response_object())
    written = events.start() + events.error(ApiError(503, "gone", code="engine_unavailable"))
    error, failed = parse_events("".join(written))[-2:]
    assert TypeAdapter(ResponseStreamEvent).validate_python(error).message == "gone"
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "engine_unavailable", "message": "gone"}


def tool_response_object() -> ResponseObject:
    """A response to a request with function ``f`` on the tool-calling template."""
    request = parse_request(
        ResponsesRequest, json.dumps(body(tools=[TOOL], tool_choice="auto")).encode()
    )
    model = ServedModel.from_handshake(handshake(CHATML_TOOLS.read_text()))
    # The prompt with the tools is beyond the tiny model's context: only the parsing is made.
    parsing = ChatParsing("", None, tool_use(model, request.chat_request()))
    return ResponseObject(Answer.new("resp_", "response", MODEL, "t", 4), request, model, parsing)


def test_a_function_call_streams_as_its_events_and_ends_as_the_whole() -> None:
    response = tool_response_object()
    text = 'Let me see.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    events = ResponseEvents(response)
    written = events.start()
    for index in range(0, len(text), 7):
        piece = text[index : index + 7]
        last = index + 7 >= len(text)
        written += events.render(0, TextDelta(piece, FinishReason.STOP if last else None, 1))
    parsed = [
        TypeAdapter(ResponseStreamEvent).validate_python(e)
        for e in parse_events("".join(written + events.finish(9)))
    ]
    kinds = [event.type for event in parsed]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_item.added") == 2
    assert "response.function_call_arguments.delta" in kinds
    arguments = "".join(
        e.delta for e in parsed if e.type == "response.function_call_arguments.delta"
    )
    done = next(e for e in parsed if e.type == "response.function_call_arguments.done")
    assert json.loads(arguments) == json.loads(done.arguments) == {"a": 1}
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me see."
    call = final.output[1]
    assert call.name == "f" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    whole = response.final(TextDelta(text, FinishReason.STOP, 9))
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    assert whole["output"][1]["arguments"] == call.arguments
    assert whole["output"][0]["content"][0]["text"] == "Let me see."


def test_function_call_items_in_the_input_become_chat_tool_messages() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    second = {**call, "call_id": "call_2"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    request = parse_request(
        ResponsesRequest,
        json.dumps(body(input=[{"role": "user", "content": "hi"}, call, second, result])).encode(),
    )
    messages = [m.model_dump(exclude_unset=True) for m in request.chat_request().messages]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert request.structured_output() is None
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
    request = parse_request(ResponsesRequest, json.dumps(body(text={"format": schema})).encode())
    assert json.loads(request.structured_output().spec) == {"type": "object"}


@pytest.mark.parametrize("before", ["Hi ", ""])
def test_text_after_a_function_call_in_its_last_step_stays_in_the_message(before: str) -> None:
    """A step that ends a call's arguments and brings text after it: the arguments went to
    the message reopened for the text (its id again, its earlier text again, or, with no
    text before the call, to the message the text opened) and were lost from the call."""
    response = tool_response_object()
    events = ResponseEvents(response)
    pieces = [before + '<tool_call>\n{"name": "f", "arguments": {"a": 1', "}}\n</tool_call> Done"]
    written = events.start()
    written += events.render(0, TextDelta(pieces[0], None, 1))
    written += events.render(0, TextDelta(pieces[1], FinishReason.STOP, 2))
    parsed = parse_events("".join(written + events.finish(2)))
    for event in parsed:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    added = [e["item"] for e in parsed if e["type"] == "response.output_item.added"]
    kinds = ["message", "function_call"] if before else ["function_call", "message"]
    assert [item["type"] for item in added] == kinds
    call_index = kinds.index("function_call")
    call_deltas = [e for e in parsed if e["type"] == "response.function_call_arguments.delta"]
    assert {e["output_index"] for e in call_deltas} == {call_index}
    final = parsed[-1]["response"]["output"]
    assert final[1 - call_index]["content"][0]["text"] == before + "Done"
    assert json.loads(final[call_index]["arguments"]) == {"a": 1}
    whole = response.final(TextDelta("".join(pieces), FinishReason.STOP, 2))
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == before + "Done"
