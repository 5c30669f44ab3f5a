"""Request validation: bad requests get OpenAI's error bodies before any engine call.

The app runs with a real EnginePool that has no engine behind it, so only the
paths that answer without the engine are exercised here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from protocol import PROTOCOL_VERSION, HandshakeReply, SamplingDefaults
from server.app import create_app
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest, CompletionRequest, parse_request
from server.prompts import chat_generation
from server.request_id import MAX_REQUEST_ID_CHARS
from server.served_model import ChatOptions, ServedModel

MODEL = "tiny-test-model"
MAX_MODEL_LEN = 64
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
STRICT = (
    "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
)


def tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox"] * 5, trainer)
    return tokenizer.to_str()


TOKENIZER_JSON = tokenizer_json()
VOCAB_SIZE = Tokenizer.from_str(TOKENIZER_JSON).get_vocab_size(with_added_tokens=True)


def handshake(chat_template: str | None) -> HandshakeReply:
    return HandshakeReply(
        protocol_version=PROTOCOL_VERSION,
        model_name=MODEL,
        tokenizer_json=TOKENIZER_JSON,
        chat_template=chat_template,
        bos_token=None,
        eos_token="<|im_end|>",
        eos_token_ids=[1],
        max_model_len=MAX_MODEL_LEN,
        engine_pid=1,
        engine_started_at=time.time(),
    )


def make_client(chat_template: str | None) -> Iterator[TestClient]:
    # Never connected: there is no engine, and these tests must not need one.
    engine = EnginePool(["tcp://127.0.0.1:9"])
    app = create_app(engine, handshake(chat_template))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    yield from make_client(CHATML)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **fields}


def assert_error(
    response: Any, status: int, param: str | None = None, code: str | None = None
) -> str:
    """Checks the OpenAI error body; returns its message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error["message"]


# The body itself


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_invalid_json(client: TestClient, path: str) -> None:
    response = client.post(path, content=b'{"messages": [')
    assert "JSON" in assert_error(response, 400)


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"3"])
def test_body_must_be_an_object(client: TestClient, body: bytes) -> None:
    assert "object" in assert_error(client.post("/v1/chat/completions", content=body), 400)


# Chat fields


def test_missing_messages(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": MODEL})
    message = assert_error(response, 400, "messages", "missing_required_parameter")
    assert "messages" in message


def test_empty_messages(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json=chat(messages=[]))
    assert_error(response, 400, "messages")


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": []}, "messages[0].content"),
        ({"role": "user", "content": "hi", "name": 5}, "messages[0].name"),
    ],
)
def test_a_message_of_no_parts_or_a_name_not_text_is_refused(
    client: TestClient, message: dict[str, Any], param: str
) -> None:
    """As OpenAI: content is a string or one part at least, and a name is a string."""
    assert_error(client.post("/v1/chat/completions", json=chat(messages=[message])), 400, param)


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_message_without_content_is_refused_by_its_place(client: TestClient, role: str) -> None:
    """Only an assistant's message (its tool calls) may leave content out, as OpenAI says; a
    chat template failed on others, with an error that named neither the message nor the
    field."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": role}]
    message = assert_error(
        client.post("/v1/chat/completions", json=chat(messages=messages)), 400, "messages[2]"
    )
    assert f"a {role} message needs its content" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 0),
        ("max_tokens", "many"),
        ("max_completion_tokens", 0),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        # Past a signed 64-bit integer, which the engine's tensors hold (its wire refuses it).
        ("top_k", 2**63),
        ("priority", 2**63),
        ("seed", 2**64),
        ("stream", "sometimes"),
    ],
)
def test_out_of_range_sampling(client: TestClient, field: str, value: Any) -> None:
    response = client.post("/v1/chat/completions", json=chat(**{field: value}))
    assert field in assert_error(response, 400, field)


@pytest.mark.parametrize(
    "stop", [["a", "b", "c", "d", "e"], 7, [1, 2], ["ok", ""]], ids=["five", "int", "ints", "empty"]
)
def test_bad_stop(client: TestClient, stop: Any) -> None:
    assert_error(client.post("/v1/chat/completions", json=chat(stop=stop)), 400, "stop")


def test_honest_refusals(client: TestClient) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    messages = [{"role": "user", "content": [image]}]
    response = client.post("/v1/chat/completions", json=chat(messages=messages))
    message = assert_error(response, 400, "messages[0].content", "unsupported_parameter")
    assert "not supported" in message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_json"),
        ({"guided_json": "[" * 100_000}, "guided_json"),  # nested past Python's stack
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_structured_outputs(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    """Both endpoints read the structured-output fields; their form is checked here, the
    schema, regex or grammar itself by the engine."""
    body = chat(**fields) if "chat" in path else {"prompt": "hi", **fields}
    assert_error(client.post(path, json=body), 400, param)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
        ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias.x.[key]"),
        ("/v1/completions", {"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", {"logprobs": [1]}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"stream_options": {}, "stream": False}, "stream_options"),
    ],
)
def test_bad_choices_penalties_or_logprobs(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    body = chat(**fields) if "chat" in path else {"prompt": "hi", **fields}
    assert_error(client.post(path, json=body), 400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"prompt_logprobs": 20}, "prompt_logprobs"), ({"echo": True, "logprobs": 20}, "logprobs")],
)
def test_prompt_logprobs_past_one_answer_are_refused(fields: dict[str, Any], param: str) -> None:
    """A long context's prompt log-probabilities (20 alternatives at 250,000 positions: about
    70 MB) are more than the one engine message that carries them may be: a 400 before the
    engine, which would send a frame the server drops, with the step's other outputs."""
    engine = EnginePool(["tcp://127.0.0.1:9"])
    app = create_app(engine, dataclasses.replace(handshake(CHATML), max_model_len=300_000))
    try:
        with TestClient(app, raise_server_exceptions=False) as long_context:
            body = {"prompt": [5] * 250_000, "max_tokens": 1, **fields}
            message = assert_error(long_context.post("/v1/completions", json=body), 400, param)
    finally:
        asyncio.run(engine.close())
    assert "250000 tokens" in message


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
        ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ("/v1/chat/completions", {"bad_words": [""]}, "bad_words[0]"),
        ("/v1/chat/completions", {"bad_words": ["  "]}, "bad_words"),  # no token
        ("/v1/chat/completions", {"bad_words": ["the"] * 65}, "bad_words"),  # 130 sequences
        ("/v1/chat/completions", {"bad_words": "the"}, "bad_words"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": [VOCAB_SIZE]}, "allowed_token_ids"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_vllm_sampling_fields(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    body = chat(**fields) if "chat" in path else {"prompt": "hi", **fields}
    assert_error(client.post(path, json=body), 400, param)


def test_message_fields(client: TestClient) -> None:
    no_role = chat(messages=[{"content": "hi"}])
    assert_error(client.post("/v1/chat/completions", json=no_role), 400, "messages[0].role")
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with_image = chat(
        messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": image}]
    )
    response = client.post("/v1/chat/completions", json=with_image)
    assert_error(response, 400, "messages[1].content", "unsupported_parameter")


def test_malformed_tool_calls_and_tool_schemas_are_400s(client: TestClient) -> None:
    """Tool calls in the conversation and tool schemas that pass the body's validation but
    would break the prompt or the call grammar: each a 400 naming its field, none a 500."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    nested = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    calls_of = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    # The chat template's way (it shows the calls): arguments nested past Python's stack.
    calls_of[1]["tool_calls"] = [nested]
    assert_error(client.post("/v1/chat/completions", json=chat(messages=calls_of)), 400, "messages")
    # A template that does not show tools gets them in a system message of the server's.
    for calls in (5, [{"id": [1], "type": "function", "function": {"name": "f"}}]):
        calls_of[1]["tool_calls"] = calls
        body = chat(messages=calls_of, tools=[tool], tool_choice="required")
        assert_error(client.post("/v1/chat/completions", json=body), 400, "messages")
    defs = {"type": "object", "$defs": [1]}
    body = chat(
        tools=[{**tool, "function": {"name": "f", "parameters": defs}}], tool_choice="required"
    )
    assert_error(
        client.post("/v1/chat/completions", json=body), 400, "tools[0].function.parameters"
    )


def test_unknown_model(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json=chat(model="gpt-4o"))
    assert "gpt-4o" in assert_error(response, 404, "model", "model_not_found")


def test_prompt_longer_than_the_context(client: TestClient) -> None:
    long = chat(messages=[{"role": "user", "content": "hello world " * MAX_MODEL_LEN}])
    response = client.post("/v1/chat/completions", json=long)
    message = assert_error(response, 400, "messages", "context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message


def test_prompt_plus_max_tokens_longer_than_the_context(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json=chat(max_tokens=MAX_MODEL_LEN))
    message = assert_error(response, 400, "messages", "context_length_exceeded")
    assert f"{MAX_MODEL_LEN} in the completion" in message


def test_template_refusal_is_a_400() -> None:
    for client in make_client(STRICT):
        response = client.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "system", "content": "x"}])
        )
        assert "first must be user" in assert_error(response, 400, "messages")


def test_no_chat_template() -> None:
    for client in make_client(None):
        response = client.post("/v1/chat/completions", json=chat())
        message = assert_error(response, 400, "messages")
        assert "no chat template" in message and "/v1/completions" in message


# Completion fields


@pytest.mark.parametrize(
    "prompt", [[], [1, "a"], [[]], [[1, -1]], [["a"]], ["a", [1, "b"]], None, [True]], ids=str
)
def test_bad_prompt(client: TestClient, prompt: Any) -> None:
    response = client.post("/v1/completions", json={"prompt": prompt})
    assert_error(response, 400, "prompt")


def test_missing_prompt(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": MODEL})
    assert_error(response, 400, "prompt", "missing_required_parameter")


@pytest.mark.parametrize("token_ids", [[1, -1], [VOCAB_SIZE]])
def test_token_ids_out_of_range(client: TestClient, token_ids: list[int]) -> None:
    response = client.post("/v1/completions", json={"prompt": token_ids})
    assert_error(response, 400, "prompt")
    response = client.post("/v1/completions", json={"prompt": [1], "stop_token_ids": token_ids})
    assert_error(response, 400, "stop_token_ids" if token_ids[-1] >= 0 else "stop_token_ids[1]")


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"best_of": 1, "n": 2}, "best_of", None),
        ({"best_of": 2, "stream": True}, "best_of", None),
        ({"best_of": 129}, "best_of", None),
        # The test tokenizer has no fill-in-the-middle tokens.
        ({"suffix": "end"}, "suffix", "unsupported_parameter"),
        ({"suffix": "end", "prompt": [1, 2]}, "suffix", None),
        ({"suffix": "end", "truncate_prompt_tokens": 2}, "suffix", None),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", None),
        ({"truncation_side": "middle"}, "truncation_side", None),
    ],
)
def test_completion_combinations(
    client: TestClient, fields: dict[str, Any], param: str, code: str | None
) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert_error(response, 400, param, code)


def test_completion_extensions_pass_validation(client: TestClient) -> None:
    # No engine behind this app: a 503 means the request was valid and was sent.
    for fields in [
        {"prompt": ["hello", [5, 6]], "n": 2, "echo": True},
        {"prompt": "hello", "best_of": 3, "n": 2},
        {"prompt": "hello", "suffix": ""},  # an empty suffix asks for nothing
        {"prompt": "hello", "add_special_tokens": False, "include_stop_str_in_output": True},
        # Truncated to fit the context; without truncate_prompt_tokens, too long.
        {"prompt": list(range(MAX_MODEL_LEN)), "truncate_prompt_tokens": 8},
        {
            "prompt": list(range(MAX_MODEL_LEN)),
            "truncate_prompt_tokens": 8,
            "truncation_side": "right",
        },
    ]:
        response = client.post("/v1/completions", json=fields)
        assert_error(response, 503, None, "engine_unavailable")


def test_truncation_keeps_the_last_tokens() -> None:
    def truncated(**fields: Any) -> list[int]:
        request = CompletionRequest(prompt="x", **fields)
        return request.truncated_prompt(list(range(10)), max_model_len=6)

    assert truncated() == list(range(10))
    assert truncated(truncate_prompt_tokens=3) == [7, 8, 9]
    assert truncated(truncate_prompt_tokens=3, truncation_side="right") == [0, 1, 2]
    assert truncated(truncate_prompt_tokens=-1) == [4, 5, 6, 7, 8, 9]  # the context's length


def test_allowed_token_ids_that_other_fields_ban_are_refused(client: TestClient) -> None:
    """Up front, where the server can tell: every allowed token a one-token bad word, or an
    EOS or stop token before min_tokens. (Structured outputs: tests/engine.)"""
    tokenizer = Tokenizer.from_str(TOKENIZER_JSON)
    hello, world = tokenizer.token_to_id("hello"), tokenizer.token_to_id("Ġworld")

    def post(**fields: Any) -> Any:
        return client.post("/v1/completions", json={"prompt": "hi", **fields})

    banned = post(allowed_token_ids=[hello], bad_words=["hello"])
    assert "no token is left" in assert_error(banned, 400, "allowed_token_ids")
    before_min = post(allowed_token_ids=[1, hello], stop_token_ids=[hello], min_tokens=2)
    assert_error(before_min, 400, "allowed_token_ids")
    for fine in (
        post(allowed_token_ids=[hello, world], bad_words=["hello"]),
        post(allowed_token_ids=[1, hello], stop_token_ids=[hello]),  # no min_tokens
    ):
        assert_error(fine, 503, None, "engine_unavailable")


def test_spaces_between_special_tokens_false_where_the_decoder_adds_none(
    client: TestClient,
) -> None:
    """Byte-level BPE puts no spaces between special tokens: false changes nothing, as in
    vLLM. (A WordPiece decoder does: ServedModel.spaces_between_added_tokens.)"""
    body = chat(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert_error(client.post("/v1/chat/completions", json=body), 503, None, "engine_unavailable")


# Fields beyond those declared


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"length_penalty": 1.2}, "length_penalty"),
        ("/v1/completions", {"logprob_token_ids": [1]}, "logprob_token_ids"),
        ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ("/v1/completions", {"structural_tag": "{}"}, "structural_tag"),
        ("/v1/completions", {"request_id": "mine"}, "request_id"),
        ("/v1/chat/completions", {"chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"prompt": "hi", "chat_template": "{{ 1 }}"}, "chat_template"),
    ],
)
def test_vllm_fields_not_served_yet_are_refused(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    body = chat(**fields) if "chat" in path else {"prompt": "hi", **fields}
    message = assert_error(client.post(path, json=body), 400, param, "unsupported_parameter")
    assert "not supported" in message


def test_vllm_fields_at_their_defaults_and_unknown_fields_are_accepted(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True}
    long_name = "x" * 100_000  # logged cut short, not whole
    with caplog.at_level(logging.WARNING, logger="server.openai_schemas"):
        response = client.post(
            "/v1/chat/completions",
            json=chat(**neutral, frobnicate=1, service_tier="auto", **{long_name: 1}),
        )
    assert_error(response, 503, None, "engine_unavailable")
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith(
        "The following fields were present in the request but ignored: 'frobnicate', "
        "'service_tier', 'xxx"
    )
    assert len(warning) < 300


# Request ids and the version


def test_request_ids_are_echoed_or_made(client: TestClient) -> None:
    for response in [
        client.get("/v1/models", headers={"X-Request-Id": "abc-123"}),
        client.get("/v1/nothing", headers={"X-Request-Id": "abc-123"}),
        client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-123"}),
    ]:
        assert response.headers["x-request-id"] == "abc-123"
    made = [client.get("/v1/models").headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(len(made_id) == 32 for made_id in made)
    # An id too long to copy into every engine message and streamed chunk, or unprintable,
    # is replaced by a new one.
    for given in ("x" * (MAX_REQUEST_ID_CHARS + 1), "a\tb"):
        replaced = client.get("/v1/models", headers={"X-Request-Id": given})
        assert len(replaced.headers["x-request-id"]) == 32
    longest = "x" * MAX_REQUEST_ID_CHARS
    assert (
        client.get("/v1/models", headers={"X-Request-Id": longest}).headers["x-request-id"]
        == longest
    )


def test_version(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": importlib.metadata.version("tandem")}


def test_completion_too_long(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": list(range(MAX_MODEL_LEN))})
    assert_error(response, 400, "prompt", "context_length_exceeded")


# Without an engine


def test_valid_request_without_engine_is_a_503(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert_error(response, 503, None, "engine_unavailable")


def test_health_without_engine(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"


# Routing


def test_unknown_route(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing-here"), 404)


def test_wrong_method(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert_error(response, 405)
    assert "POST" in response.headers["allow"]


def test_models(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert client.get(f"/v1/models/{MODEL}").json() == card
    assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")


def test_web_ui(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("js/app.js", "style.css", "vendor/dompurify/purify.min.js"):
        assert f"/static/{name}" in page.text
        assert client.get(f"/static/{name}").status_code == 200


# The models themselves


def test_defaults_and_normalisation() -> None:
    request = parse_request(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": "hi", "name": "ann"}], "stop": "END",'
        b' "frequency_penalty": 0, "n": 1, "stream": true,'
        b' "stream_options": {"include_usage": true}}',
    )
    assert request.stop == ["END"]
    assert request.temperature is None and request.top_p is None  # defaults come later
    assert request.include_usage
    assert request.messages[0].model_dump(exclude_unset=True) == {
        "role": "user",
        "content": "hi",
        "name": "ann",
    }
    assert parse_request(CompletionRequest, b'{"prompt": "one"}').prompt == ["one"]
    assert parse_request(CompletionRequest, b'{"prompt": ["one", "two"]}').prompt == ["one", "two"]
    assert parse_request(CompletionRequest, b'{"prompt": [5, 6]}').prompt == [[5, 6]]
    assert parse_request(CompletionRequest, b'{"prompt": [[5], "x"]}').prompt == [[5], "x"]


def test_model_defaults_fill_only_what_the_request_leaves_out() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    model = ServedModel.from_handshake(
        dataclasses.replace(handshake(CHATML), sampling_defaults=defaults)
    )
    bare = parse_request(CompletionRequest, b'{"prompt": "hi"}').sampling_params(1, model)
    assert (bare.temperature, bare.top_p, bare.top_k) == (0.6, 0.9, 20)
    assert (bare.min_p, bare.repetition_penalty) == (0.0, 1.1)
    body = b'{"prompt": "hi", "temperature": 0, "top_k": -1, "repetition_penalty": 1, "min_p": 0.2}'
    chosen = parse_request(CompletionRequest, body).sampling_params(1, model)
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (0, 0.9, 0)
    assert (chosen.min_p, chosen.repetition_penalty) == (0.2, 1.0)
    plain = ServedModel.from_handshake(handshake(CHATML))  # a model with no defaults: vLLM's
    vllm = parse_request(CompletionRequest, b'{"prompt": "hi"}').sampling_params(1, plain)
    assert (vllm.temperature, vllm.top_p, vllm.top_k, vllm.repetition_penalty) == (1, 1, 0, 1)


def test_a_chat_template_of_the_servers_ends_answers_at_its_end_of_turn(tmp_path: Path) -> None:
    """The engine stops on the end-of-turn token of the checkpoint's template only: a model
    served with --chat-template of ChatML ends its answers at <|im_end|> (id 1) too, as EOS
    (ignore_eos goes past it), or they ran on into a turn the model made up."""
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    # A checkpoint without a template whose EOS is another token (here id 0).
    reply = dataclasses.replace(handshake(None), eos_token="<|im_start|>", eos_token_ids=[0])
    model = ServedModel.from_handshake(reply, ChatOptions(chat_template=str(template)))
    assert model.eos_token_ids == {0, 1}
    request = parse_request(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}]}'
    )
    assert 1 in request.sampling_params(1, model).stop_token_ids
    body = b'{"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true}'
    assert (
        1 not in parse_request(ChatCompletionRequest, body).sampling_params(1, model).stop_token_ids
    )
    # The checkpoint's own template: its end-of-turn token is the engine's to stop on already.
    own = ServedModel.from_handshake(dataclasses.replace(reply, chat_template=CHATML))
    assert request.sampling_params(1, own).stop_token_ids == []


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    """Each word as it is; after a space too, if that gives another first token and as many
    tokens (so " world", one token here against two for "world", is not banned)."""
    model = ServedModel.from_handshake(handshake(CHATML))
    tokenizer = model.tokenizer

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    assert len(ids("the")) == len(ids(" the")) == 1 and ids("the") != ids(" the")
    assert len(ids("world")) == 2 and len(ids(" world")) == 1
    assert model.bad_words_token_ids(["the", "  world"]) == [ids("the"), ids(" the"), ids("world")]


def test_parse_request_raises_api_errors() -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, b'{"prompt": "x", "max_tokens": 0}')
    assert caught.value.status == 400 and caught.value.param == "max_tokens"


# Tokenizing needs no engine either: the model's tokenizer came with the handshake.


def test_tokenize_and_detokenize(client: TestClient) -> None:
    tokenizer = Tokenizer.from_str(TOKENIZER_JSON)
    reply = client.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert reply.status_code == 200, reply.text
    ids = tokenizer.encode("hello world").ids
    assert reply.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": None,
    }
    strings = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert strings.json()["token_strs"] == ["hello", "Ġworld"]
    back = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.json() == {"prompt": "hello world"}

    messages = [{"role": "user", "content": "hello"}]
    reply = client.post("/tokenize", json={"messages": messages})
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert reply.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False).ids
    # The chat endpoint's other template fields, as vLLM's /tokenize takes them.
    reply = client.post(
        "/tokenize",
        json={
            "messages": [*messages, {"role": "assistant", "content": "hello wor"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhello wor"
    assert reply.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False).ids


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),  # neither prompt nor messages
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ],
)
def test_bad_tokenize_requests(
    client: TestClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = client.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_api_key_guards_the_api_but_not_the_page() -> None:
    engine = EnginePool(["tcp://127.0.0.1:9"])
    app = create_app(engine, handshake(CHATML), api_key="s3cret")
    with TestClient(app, raise_server_exceptions=False) as client:
        refused = client.get("/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = client.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "x"})
        assert wrong.status_code == 401
        allowed = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert allowed.json()["data"][0]["id"] == MODEL
        # The scheme's case is the client's (RFC 9110), as vLLM reads it; the key's is not.
        assert client.get("/v1/models", headers={"Authorization": "bearer s3cret"}).is_success
        for other in ("Basic s3cret", "Bearer S3CRET", "s3cret"):
            assert client.get("/v1/models", headers={"Authorization": other}).status_code == 401
        assert client.get("/").status_code == 200
        assert client.get("/health").status_code == 503  # open; no engine behind this one
    asyncio.run(engine.close())


def test_metrics_without_an_engine_say_it_is_down(client: TestClient) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'tandem_engine_up{replica="0"} 0.0' in response.text.splitlines()


def test_chat_add_special_tokens_puts_the_tokenizers_own_on_top() -> None:
    """vLLM's add_special_tokens for chat: off by default (the template holds its special
    tokens); on, the tokenizer's post-processor adds its own (here a BOS) too."""
    tokenizer = Tokenizer.from_str(TOKENIZER_JSON)
    bos = tokenizer.token_to_id("<|im_start|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    reply = dataclasses.replace(handshake(CHATML), tokenizer_json=tokenizer.to_str())
    model = ServedModel.from_handshake(reply)

    def prompt_ids(**fields: Any) -> list[int]:
        body = ChatCompletionRequest.model_validate(chat(**fields))
        return asyncio.run(chat_generation(model, body)).generation.prompt_ids

    plain, added = prompt_ids(), prompt_ids(add_special_tokens=True)
    assert added == [bos, *plain] and plain[0] == bos  # the template's own, then the BOS
