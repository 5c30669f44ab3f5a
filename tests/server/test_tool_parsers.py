"""Tool-call parsers read back the calls that the models' own templates write.

Each answer comes from a real template: the conversation is rendered with an assistant
message that calls tools, the answer is what that message adds to the prompt, and the
parser must give back the message's content and calls, streamed in any pieces or not.
Llama 3's templates are under the Llama license, so its answers are written by hand
from the format they document ({"name": ..., "parameters": {...}}, after
<|python_tag|> or not).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from server.tool_parsers import (
    TOOL_PARSERS,
    CallArrayParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedFunctionParser,
    ParsedToolCalls,
    ToolCall,
    ToolChoiceError,
    ToolParser,
    ToolParserDelta,
    assemble,
    tool_choice_schema,
    tool_parser_for_template,
)
from server.tool_parsers import mistral as mistral_parser
from tests.server.renderings import (
    MISTRAL_NEMO,
    MISTRAL_SMALL_32,
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

ParserFactory = Callable[..., ToolParser]


def counting_ids(ids: list[str] | None = None) -> Callable[[], str]:
    """Call ids in order: the given ones, or call_0, call_1, ..."""
    source = iter(ids) if ids is not None else (f"call_{n}" for n in itertools.count())
    return lambda: next(source)


def parse(factory: ParserFactory, text: str, **options: Any) -> ParsedToolCalls:
    return factory(new_call_id=counting_ids(), **options).parse(text)


def assert_streams_as_parsed(factory: ParserFactory, text: str, **options: Any) -> None:
    """However a stream cuts the answer, its deltas assemble to the non-streamed result."""
    whole = parse(factory, text, **options)
    for pieces in chunkings(text):
        parser = factory(new_call_id=counting_ids(), **options)
        deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        assert assemble(deltas) == whole, pieces


def expected_calls(message: dict[str, Any], ids: list[str] | None = None) -> list[ToolCall]:
    """The message's calls as a parser returns them: the arguments as the template wrote
    them (JSON as tojson writes it), the ids the parser's."""
    new_id = counting_ids(ids)
    return [
        ToolCall(
            new_id(),
            call["function"]["name"],
            json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False),
        )
        for call in message["tool_calls"]
    ]


QUESTION = [{"role": "user", "content": "What is the weather in Paris and in Zürich?"}]

HERMES_ANSWERS = {
    "one call": {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call("call_a", "get_weather", {"city": "Paris"})],
    },
    "content and two calls": {
        "role": "assistant",
        "content": "Let me look both up.",
        "tool_calls": [
            tool_call("call_a", "get_weather", {"city": "Paris", "unit": "celsius"}),
            tool_call("call_b", "get_weather", {"city": "Zürich"}),
        ],
    },
    "tricky arguments": {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            tool_call(
                "call_a",
                "search",
                {"query": 'a "quoted" {brace} [bracket] \\ </tool_call> 🎉', "n": [1, 2.5e3]},
            ),
            tool_call("call_b", "search", {}),
        ],
    },
}


@pytest.mark.parametrize("template_name", [QWEN25, QWEN3, "chatml_tools"])
@pytest.mark.parametrize("answer_name", list(HERMES_ANSWERS))
def test_hermes_reads_back_qwen_calls(template_name: str, answer_name: str) -> None:
    template = chat_template(template_name)
    answer = HERMES_ANSWERS[answer_name]
    # Qwen3 without thinking: its reasoning parser is tested in test_reasoning.py.
    options = {"tools": WEATHER_TOOLS, "template_kwargs": {"enable_thinking": False}}
    _, text = split_turn(template, QUESTION, answer, "<|im_end|>", **options)
    parsed = parse(HermesToolParser, text)
    assert parsed == ParsedToolCalls(answer["content"], expected_calls(answer))
    assert_streams_as_parsed(HermesToolParser, text)
    # The parsed message, sent back in the next request, renders as the original did.
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": [call.to_openai() for call in parsed.tool_calls],
    }
    assert template.render([*QUESTION, message], add_generation_prompt=False, **options) == (
        template.render([*QUESTION, answer], add_generation_prompt=False, **options)
    )


MISTRAL_ANSWER = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        tool_call("abcDEF123", "get_weather", {"city": "Paris"}),
        tool_call("xyz789QRS", "search", {"query": "Zürich [weather] {today}"}),
    ],
}


@pytest.mark.parametrize("template_name", [MISTRAL_NEMO, MISTRAL_SMALL_32])
def test_mistral_reads_back_both_formats(template_name: str) -> None:
    template = chat_template(template_name)
    _, text = split_turn(template, QUESTION, MISTRAL_ANSWER, "</s>", tools=WEATHER_TOOLS)
    # Nemo writes the calls as a JSON array, Small 3.2 one marker, name and id per call.
    array = template_name == MISTRAL_NEMO
    assert text.startswith("[TOOL_CALLS][{" if array else "[TOOL_CALLS]get_weather[CALL_ID]")
    ids = ["abcDEF123", "xyz789QRS"]
    parsed = MistralToolParser(new_call_id=counting_ids(ids)).parse(text)
    assert parsed == ParsedToolCalls(None, expected_calls(MISTRAL_ANSWER, ids))
    assert_streams_as_parsed(MistralToolParser, text)
    # Mistral's templates take only ids of nine letters or digits: the parser makes such.
    parsed = MistralToolParser().parse(text)
    assert all(re.fullmatch("[A-Za-z0-9]{9}", call.id) for call in parsed.tool_calls)
    message = {"role": "assistant", "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
    template.render([*QUESTION, message], add_generation_prompt=False, tools=WEATHER_TOOLS)


MISTRAL_BY_HAND = {
    # Devstral and the v11 tokenizers without call ids; some tokenizers drop [ARGS]'s text.
    "v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, ["get_weather"]),
    "v11 without [ARGS]": ('[TOOL_CALLS]search{"query": "x"}', None, ["search"]),
    "content first": (
        'Checking.[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": 1}',
        "Checking.",
        ["a", "b"],
    ),
    "array with a space": ('[TOOL_CALLS] [{"name": "a", "arguments": {}}]', None, ["a"]),
    "no call": ("Sure, here it is.", "Sure, here it is.", []),
    "not a name": ("[TOOL_CALLS]Hello there.", "[TOOL_CALLS]Hello there.", []),
    "an empty array": ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    "spaces around the name": ("[TOOL_CALLS] a [ARGS]{}", None, ["a"]),
    "a space inside the name": ("[TOOL_CALLS]a b[ARGS]{}", "[TOOL_CALLS]a b[ARGS]{}", []),
}


@pytest.mark.parametrize("case", list(MISTRAL_BY_HAND))
def test_mistral_formats_by_hand(case: str) -> None:
    text, content, names = MISTRAL_BY_HAND[case]
    parsed = parse(MistralToolParser, text)
    assert parsed.content == content
    assert [call.name for call in parsed.tool_calls] == names
    for call in parsed.tool_calls:
        json.loads(call.arguments)
    assert_streams_as_parsed(MistralToolParser, text)


class MatchCountingPattern:
    """A compiled pattern that counts the characters its ``fullmatch`` is given to read."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.characters_read = 0

    def fullmatch(self, text: str) -> re.Match[str] | None:
        self.characters_read += len(text)
        return self.pattern.fullmatch(text)


def mistral_name_check_length(monkeypatch: pytest.MonkeyPatch, deltas: int) -> int:
    """The characters the Mistral parser's name check reads while a name that never ends
    streams in ``deltas`` deltas of one character."""
    counting = MatchCountingPattern(mistral_parser._NAME_SO_FAR)
    with monkeypatch.context() as patch:
        patch.setattr(mistral_parser, "_NAME_SO_FAR", counting)
        parser = MistralToolParser()
        assert parser.feed("[TOOL_CALLS]") == ToolParserDelta()
        for _ in range(deltas):
            assert parser.feed("a") == ToolParserDelta()
        assert parser.finish().content == "[TOOL_CALLS]" + "a" * deltas
    return counting.characters_read


def test_a_mistral_name_that_never_ends_streams_in_linear_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model can be made to write ``[TOOL_CALLS]`` and then name characters for ever;
    each token's delta checked the whole name so far: quadratic, seconds of a server's event
    loop at 100,000 deltas. Each checks only its own now. Counted, not timed: four times the
    deltas read about four times the characters, where checking the whole name reads
    sixteen times."""
    once = mistral_name_check_length(monkeypatch, 2_000)
    assert 0 < mistral_name_check_length(monkeypatch, 8_000) < 5 * once


LLAMA3_ANSWERS = {
    "a call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, ["get_weather"]),
    "after the python tag": (
        '<|python_tag|>{"name": "search", "parameters": {"query": "Zürich"}}',
        None,
        ["search"],
    ),
    "two calls": (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": "}"}}',
        None,
        ["a", "b"],
    ),
    "a type key": (
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        ["get_weather"],
    ),
    "text": ("Paris is sunny.", "Paris is sunny.", []),
    "JSON that is no call": ('{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', []),
    "a call then text": (
        '{"name": "a", "parameters": {}}\nDone.',
        "Done.",
        ["a"],
    ),
}


@pytest.mark.parametrize("case", list(LLAMA3_ANSWERS))
def test_llama3_json(case: str) -> None:
    text, content, names = LLAMA3_ANSWERS[case]
    parsed = parse(Llama3JsonToolParser, text)
    assert parsed.content == content
    assert [call.name for call in parsed.tool_calls] == names
    if case == "a call":
        assert parsed.tool_calls[0].arguments == '{"city": "Paris"}'
    assert_streams_as_parsed(Llama3JsonToolParser, text)


HERMES_EDGES = {
    # (answer, content, [(name, arguments)])
    "a tag's start that is not one": ("x < y and <tool_ but no", "x < y and <tool_ but no", []),
    "a block without a call": (
        "I would call <tool_call>\nnothing here\n</tool_call> today.",
        "I would call <tool_call>\nnothing here\n</tool_call> today.",
        [],
    ),
    "text between and after calls": (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nthen\n'
        '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call>\n\nDone.\n',
        "then\n\nDone.\n",
        [("a", "{}"), ("b", '{"k": "v"}')],
    ),
    "cut off in the arguments (max_tokens)": (
        'On it.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
        "On it.",
        [("get_weather", '{"city": "Pa')],
    ),
    "cut off before the name is complete": (
        'On it.<tool_call>\n{"name": "get_wea',
        'On it.<tool_call>\n{"name": "get_wea',
        [],
    ),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    "arguments as a string": (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [("f", '{"x": 1}')],
    ),
    "arguments first": (
        '<tool_call>{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}</tool_call>',
        None,
        [("f", '{"x": [1, {"y": 2}]}')],
    ),
    # Qwen2.5-Coder-0.5B's own answer to a weather question (see the slow test below).
    "a bare call object": (
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    "JSON content is not a bare call": (
        '{"name": "Ada", "born": 1815}',
        '{"name": "Ada", "born": 1815}',
        [],
    ),
}


@pytest.mark.parametrize("case", list(HERMES_EDGES))
def test_hermes_edges(case: str) -> None:
    text, content, calls = HERMES_EDGES[case]
    parsed = parse(HermesToolParser, text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == calls
    assert_streams_as_parsed(HermesToolParser, text)


def test_hermes_bare_call_needs_a_declared_name() -> None:
    """Without its tags, an object is a call only if it names one of the request's tools
    (openai-agents fails on a call to a tool it does not have); tagged calls are the
    model's own markup, read whatever they name."""
    declared = {"tool_names": frozenset({"get_weather"})}
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parsed = parse(HermesToolParser, bare, **declared)
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    undeclared = '{"name": "get_weather_args", "arguments": {"city": "Paris"}}'
    assert parse(HermesToolParser, undeclared, **declared) == ParsedToolCalls(undeclared, [])
    assert_streams_as_parsed(HermesToolParser, undeclared, **declared)
    tagged = f"<tool_call>{undeclared}</tool_call>"
    assert [call.name for call in parse(HermesToolParser, tagged, **declared).tool_calls] == [
        "get_weather_args"
    ]


def test_deltas_are_chunked_as_openai_chunks_them() -> None:
    """At most one entry per call in a delta: the first carries the id and the name with
    the arguments that came with them, the rest only arguments."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parser = HermesToolParser(new_call_id=counting_ids())
    deltas = [parser.feed(char) for char in text] + [parser.finish()]
    for delta in deltas:
        indexes = [piece.index for piece in delta.tool_calls]
        assert len(indexes) == len(set(indexes)), delta
    pieces = [piece for delta in deltas for piece in delta.tool_calls]
    first, rest = pieces[0], pieces[1:]
    assert first.to_openai() == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{"},
    }
    assert all(
        piece.to_openai() == {"index": 0, "function": {"arguments": piece.arguments}}
        for piece in rest
    )
    assert len(rest) > 5  # the arguments stream as they come, not at the end
    assert "".join(piece.arguments for piece in pieces) == '{"city": "Paris"}'
    # Nothing of the markup leaks into the content, not even while it could be markup.
    assert "".join(delta.content for delta in deltas) == "Sure."
    # Fed at once, the call is one entry.
    [whole] = HermesToolParser(new_call_id=counting_ids()).feed(text).tool_calls
    assert whole.to_openai()["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }


def test_max_calls_keeps_the_first() -> None:
    """parallel_tool_calls=false: the first call only."""
    text = "".join(
        f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' for name in "abc"
    )
    parsed = parse(HermesToolParser, text, max_calls=1)
    assert [call.name for call in parsed.tool_calls] == ["a"]
    parser = HermesToolParser(max_calls=1)
    parser.feed(text)
    assert parser.num_calls == 1
    assert_streams_as_parsed(HermesToolParser, text, max_calls=1)


def test_default_ids_look_like_openais() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 2
    ids = [call.id for call in HermesToolParser().parse(text).tool_calls]
    assert all(re.fullmatch("call_[A-Za-z0-9]{24}", call_id) for call_id in ids)
    assert ids[0] != ids[1]


def test_parser_for_template() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai"}
    for name, parser in [
        (QWEN25, "hermes"),
        (QWEN3, "hermes"),
        (QWQ, "hermes"),
        ("chatml_tools", "hermes"),
        (MISTRAL_NEMO, "mistral"),
        (MISTRAL_SMALL_32, "mistral"),
    ]:
        assert tool_parser_for_template(template_source(name)) == parser, name
    # Llama 3.1's template writes <|python_tag|>; 3.2's only has the ipython role.
    assert tool_parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_parser_for_template("{{ '<|start_header_id|>ipython<|end_header_id|>' }}") == (
        "llama3_json"
    )
    assert tool_parser_for_template("{{ messages[0]['content'] }}") is None


# --- tool_choice "required" and a named function --------------------------------------------


def test_required_schema_and_its_output() -> None:
    schema = tool_choice_schema(WEATHER_TOOLS, "required", parallel_tool_calls=True)
    assert schema is not None
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["arguments"] == WEATHER_TOOLS[0]["function"]["parameters"]
    assert tool_choice_schema(WEATHER_TOOLS, "required", parallel_tool_calls=False)["maxItems"] == 1
    # What a grammar held to the schema lets the model write.
    output = json.dumps(
        [
            {"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "search", "arguments": {"query": "]}"}},
        ]
    )
    parsed = parse(CallArrayParser, output)
    assert parsed == ParsedToolCalls(
        None,
        [
            ToolCall("call_0", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_1", "search", '{"query": "]}"}'),
        ],
    )
    assert_streams_as_parsed(CallArrayParser, output)


def resolve(root: Any, ref: str) -> Any:
    """What a local ``$ref`` points to in ``root``."""
    assert ref.startswith("#")
    target = root
    for segment in ref[1:].split("/")[1:]:
        segment = segment.replace("~1", "/").replace("~0", "~")
        target = target[int(segment)] if isinstance(target, list) else target[segment]
    return target


def references(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return own + [ref for item in value.values() for ref in references(item)]
    if isinstance(value, list):
        return [ref for item in value for ref in references(item)]
    return []


def test_required_schema_hoists_the_tools_definitions() -> None:
    """Nested models write $defs and $refs relative to the parameters' root: in the array
    of calls they must still resolve, to each tool's own definitions."""

    class Address(BaseModel):
        city: str

    class Person(BaseModel):
        name: str
        home: Address

    class Letter(BaseModel):
        to: Person
        sender: Person

    # Another tool's Address: the same name, another body.
    other_address = {"type": "object", "properties": {"planet": {"type": "string"}}}
    trip = {
        "type": "object",
        "properties": {
            "to": {"$ref": "#/$defs/Address"},
            "back": {"$ref": "#/properties/to"},  # a reference into the parameters
        },
        "$defs": {"Address": other_address},
    }
    letter = Letter.model_json_schema()
    tools = [
        {"type": "function", "function": {"name": "send", "parameters": letter}},
        {"type": "function", "function": {"name": "travel", "parameters": trip}},
    ]
    assert "$defs" in letter
    schema = tool_choice_schema(tools, "required")
    assert schema is not None and set(schema["$defs"]) == {"Address", "Person", "Address_2"}
    send, travel = (call["properties"]["arguments"] for call in schema["items"]["anyOf"])
    assert "$defs" not in send and "$defs" not in travel
    for ref in references(schema):
        resolve(schema, ref)  # every reference lands somewhere
    person = resolve(schema, send["properties"]["to"]["$ref"])
    assert resolve(schema, person["properties"]["home"]["$ref"]) == Address.model_json_schema()
    assert resolve(schema, travel["properties"]["to"]["$ref"]) == other_address
    assert resolve(schema, travel["properties"]["back"]["$ref"]) == {"$ref": "#/$defs/Address_2"}
    # The request's tools are left as they were.
    assert tools[1]["function"]["parameters"]["properties"]["to"] == {"$ref": "#/$defs/Address"}
    # A named function's parameters are the whole schema: their $defs are at its root.
    named = {"type": "function", "function": {"name": "send"}}
    assert tool_choice_schema(tools, named) == letter


def test_named_function_schema_and_its_output() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice_schema(WEATHER_TOOLS, choice) == WEATHER_TOOLS[0]["function"]["parameters"]
    no_parameters = [{"type": "function", "function": {"name": "now"}}]
    now = {"type": "function", "function": {"name": "now"}}
    assert tool_choice_schema(no_parameters, now) == {"type": "object", "properties": {}}
    with pytest.raises(ToolChoiceError, match="'nope'"):
        tool_choice_schema(WEATHER_TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert tool_choice_schema(WEATHER_TOOLS, "auto") is None
    assert tool_choice_schema(WEATHER_TOOLS, "none") is None

    def named(**options: Any) -> NamedFunctionParser:
        return NamedFunctionParser("get_weather", **options)

    # The call is certain from the start: its first delta goes out before any text.
    first = named(new_call_id=counting_ids()).feed("")
    assert [piece.name for piece in first.tool_calls] == ["get_weather"]
    output = '{"city": "Paris", "unit": "celsius"}'
    expected = ParsedToolCalls(None, [ToolCall("call_0", "get_weather", output)])
    assert parse(named, output) == expected
    assert_streams_as_parsed(named, output)


# --- a real model's own output (slow: Qwen2.5-Coder-0.5B, never in CI) -----------------------


@pytest.mark.slow
def test_qwen25_coder_calls_a_tool() -> None:
    """Qwen2.5-Coder-0.5B, asked through its own template with tools, calls the weather tool,
    and the hermes parser reads the call from its greedy answer (transformers runs it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.checkpoint.gguf_file import read_gguf
    from tandem.testing.gguf_models import TEST_MODELS
    from tandem.testing.reference import hf_greedy

    path: Path = TEST_MODELS["qwen2.5-coder-0.5b"].path
    if not path.is_file():
        pytest.skip(f"{path} is absent: scripts/fetch_test_gguf.py fetches it")
    source = read_gguf(path).metadata["tokenizer.chat_template"]
    assert source == template_source(QWEN25)  # so the checked-in template is the model's own
    assert tool_parser_for_template(source) == "hermes"
    prompt = chat_template(QWEN25).render(
        [{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=WEATHER_TOOLS,
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    start = time.perf_counter()
    ids = hf_greedy(model, tokenizer.encode(prompt, add_special_tokens=False), 32)
    answer = tokenizer.decode(ids, skip_special_tokens=False).split("<|im_end|>")[0]
    print(f"{time.perf_counter() - start:.0f} s: {answer!r}")
    parsed = parse(HermesToolParser, answer)
    assert [call.name for call in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments)["city"] == "Paris"
    assert_streams_as_parsed(HermesToolParser, answer)
