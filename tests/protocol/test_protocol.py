"""The wire format: round trips, and malformed frames rejected with ProtocolError only."""

import re

import msgpack
import pytest

from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    Message,
    PromptTokenLogprobs,
    ProtocolError,
    ReadReceipt,
    RequestOutput,
    SamplingParams,
    StatsRequest,
    StructuredOutput,
    StructuredOutputKind,
    TokenLogprobs,
    TokenOutputs,
    build_codecs,
    codec,
    decode_message,
)

MESSAGES = [
    HandshakeRequest(protocol_version=1, client_name="server-8000"),
    HandshakeReply(1, "m", "{}", None, "<s>", "</s>", [2, 7], 2048, 123, 1.5),
    GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.7, seed=9)),
    GenerateRequest(
        "r2",
        [1],
        SamplingParams(structured_output=StructuredOutput("json_schema", '{"type":"object"}')),
    ),
    GenerateRequest("r3", [1], SamplingParams(structured_output=StructuredOutput("json_object"))),
    AbortRequest("r1"),
    StatsRequest(),
    ReadReceipt(3 * 2**40),
    TokenOutputs([RequestOutput("r1", [5], None, 3, 1), RequestOutput("r2", [], "stop", 4, 9)]),
    TokenOutputs(
        [
            RequestOutput(
                "r3",
                [5],
                None,
                2,
                1,
                prompt_logprobs=[PromptTokenLogprobs(-1.5, 2, [4, 8], [-0.2, -1.5])],
                queue_time=0.25,
                prefill_time=0.125,
            )
        ]
    ),
    ErrorReply("r1", "prompt_too_long", "too long"),
    EngineStats(1, 2.0, "m", "cpu", 16, 100, 90, 1, 0, 3),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    assert decode_message(message.encode()) == message


def _frame(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte MessagePack never uses
        b"garbage that is not msgpack \x00\xff",
        _frame([1, 2, 3]),
        _frame({"no": "type"}),
        _frame({"type": "no_such_message"}),
        _frame({"type": "abort"}),  # missing request_id
        _frame({"type": "abort", "request_id": 5}),  # wrong type
        _frame({"type": "abort", "request_id": "a", "extra": 1}),
        _frame(
            {"type": "generate", "request_id": "a", "prompt_token_ids": [1, "x"], "sampling": {}}
        ),
        _frame({"type": "generate", "request_id": "a", "prompt_token_ids": [True], "sampling": {}}),
        _frame(
            {
                "type": "generate",
                "request_id": "a",
                "prompt_token_ids": [1],
                "sampling": {"max_tokens": "many"},
            }
        ),
        _frame({"type": "generate", "request_id": "a", "prompt_token_ids": [1], "sampling": [1]}),
        *(
            _frame(
                {
                    "type": "generate",
                    "request_id": "a",
                    "prompt_token_ids": [1],
                    "sampling": {"structured_output": constraint},
                }
            )
            for constraint in [
                "regex",  # not a map
                {"spec": "a+"},  # no kind
                {"kind": 3, "spec": "a+"},
                {"kind": "regex", "spec": None},
                {"kind": "regex", "spec": "a+", "flags": "i"},
            ]
        ),
        GenerateRequest("r", [1], SamplingParams()).encode()[:-3],  # truncated
        # Integers past a signed 64-bit one (MessagePack carries unsigned ones to 2**64 - 1),
        # which would overflow the engine's int64 tensors in a step.
        _frame(
            {
                "type": "generate",
                "request_id": "a",
                "prompt_token_ids": [1],
                "sampling": {"top_k": 2**63},
            }
        ),
        _frame(
            {"type": "generate", "request_id": "a", "prompt_token_ids": [2**64 - 1], "sampling": {}}
        ),
        _frame(
            {
                "type": "generate",
                "request_id": "a",
                "prompt_token_ids": [1],
                "sampling": {},
                "scheduling": {"priority": 2**63},
            }
        ),
    ],
)
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_message(frame)


@pytest.mark.parametrize(
    "body",
    [{"type": "x" * 1_000_000}, {"type": "abort", "request_id": "r", "x" * 1_000_000: 1}],
    ids=["type", "field name"],
)
def test_a_protocol_error_quotes_the_frame_short(body: dict) -> None:
    # The engine logs every ProtocolError: one that quoted a frame's string whole put up to
    # 64 MiB in its log a frame.
    with pytest.raises(ProtocolError) as refused:
        decode_message(_frame(body))
    assert "xxxx...xxxx" in str(refused.value) and len(str(refused.value)) < 200


def test_oversized_frame_is_rejected_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_message(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_defaults_fill_missing_optional_fields() -> None:
    frame = _frame(
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {"max_tokens": 4},
        }
    )
    message = decode_message(frame)
    assert message.sampling == SamplingParams(max_tokens=4)


def test_outputs_go_by_position_without_their_unset_tail() -> None:
    """A request's output goes as an array of its fields (an engine step sends one per running
    request): the trailing fields whose default is None are cut while unset, one unset
    before a set one stays as nil."""
    outputs = TokenOutputs(
        [
            RequestOutput("r1", [5], None, 3, 1),
            RequestOutput("r2", [], "stop", 3, 2, stop_token_id=7),
            RequestOutput(
                "r3", [6], None, 3, 1, logprobs=[TokenLogprobs(-0.5, [6, 2], [-0.5, -1.0])]
            ),
        ]
    )
    body = msgpack.unpackb(outputs.encode())
    assert body["outputs"] == [
        ["r1", [5], None, 3, 1],
        ["r2", [], "stop", 3, 2, None, None, 7],
        ["r3", [6], None, 3, 1, [[-0.5, [6, 2], [-0.5, -1.0]]]],
    ]
    assert decode_message(outputs.encode()) == outputs


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ({"request_id": "r1", "new_token_ids": [5]}, "outputs[0]: expected an array"),
        (["r1", [5], None, 3], "expected 5 to 10 values, got 4"),
        (
            ["r1", [5], None, 3, 1, None, None, None, None, None, None],
            "expected 5 to 10 values, got 11",
        ),
        (["r1", [5], None, "3", 1], "outputs[0].num_prompt_tokens: expected int"),
        (["r1", [5], None, 3, 1, [[-0.5, [6], "x"]]], "outputs[0].logprobs[0].top_logprobs"),
    ],
)
def test_malformed_outputs_name_the_field(output: object, problem: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(problem)):
        decode_message(_frame({"type": "outputs", "outputs": [output]}))


def test_sampling_validation_names_the_problem() -> None:
    assert SamplingParams().validate() is None
    assert "max_tokens" in SamplingParams(max_tokens=0).validate()
    assert "temperature" in SamplingParams(temperature=-1).validate()
    assert "top_p" in SamplingParams(top_p=0).validate()


def test_structured_output_is_optional_on_the_wire() -> None:
    frame = _frame({"type": "generate", "request_id": "a", "prompt_token_ids": [1], "sampling": {}})
    assert decode_message(frame).sampling.structured_output is None
    constrained = _frame(
        {
            "type": "generate",
            "request_id": "a",
            "prompt_token_ids": [1],
            "sampling": {"structured_output": {"kind": "regex", "spec": "[0-9]+"}},
        }
    )
    assert decode_message(constrained).sampling.structured_output == StructuredOutput(
        StructuredOutputKind.REGEX, "[0-9]+"
    )


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (StructuredOutput("yaml", "a: 1"), "kind must be one of"),
        (StructuredOutput("regex"), "needs a spec"),
        (StructuredOutput("json_schema"), "needs a spec"),
        (StructuredOutput("json_object", "{}"), "takes no spec"),
        (StructuredOutput("choice", "yes"), "JSON list of strings"),
        (StructuredOutput("choice", "[]"), "JSON list of strings"),
        (StructuredOutput("choice", '["a", 1]'), "JSON list of strings"),
        # Nested past Python's recursion limit: a refusal, not a RecursionError.
        (StructuredOutput("choice", "[" * 100_000), "JSON list of strings"),
    ],
)
def test_structured_output_validation_names_the_problem(
    constraint: StructuredOutput, problem: str
) -> None:
    assert problem in SamplingParams(structured_output=constraint).validate()


def test_well_formed_structured_outputs_validate() -> None:
    for constraint in [
        StructuredOutput("json_object"),
        StructuredOutput("json_schema", '{"type": "string"}'),
        StructuredOutput("regex", "a|b"),
        StructuredOutput("choice", '["a", ""]'),
        StructuredOutput("grammar", 'root ::= "a"'),
    ]:
        assert SamplingParams(structured_output=constraint).validate() is None


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_codecs_built_at_start_serve_every_message(message: Message) -> None:
    """After build_codecs() (the engine and the servers call it at start), no message's first
    encoding or decoding builds anything: a fresh engine's first request pays for none."""
    codec._encoder.cache_clear()
    codec._checker.cache_clear()
    build_codecs()
    built = (codec._encoder.cache_info().misses, codec._checker.cache_info().misses)
    assert decode_message(message.encode()) == message
    assert (codec._encoder.cache_info().misses, codec._checker.cache_info().misses) == built
