"""Every request shape of structured outputs maps to the one StructuredOutput the engine takes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol import StructuredOutput, StructuredOutputKind
from server.errors import ApiError
from server.structured_output import structured_output_of

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_SPEC = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput(StructuredOutputKind.JSON_OBJECT),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA_SPEC),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA_SPEC),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2), "regex": None}},
            StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA_SPEC),
        ),
        (
            {"structured_outputs": {"regex": "[0-9]+", "json_object": False}},
            StructuredOutput(StructuredOutputKind.REGEX, "[0-9]+"),
        ),
        (
            {"structured_outputs": {"choice": ["ja", "née"]}},
            StructuredOutput(StructuredOutputKind.CHOICE, '["ja", "née"]'),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutput(StructuredOutputKind.GRAMMAR, 'root ::= "a"'),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            StructuredOutput(StructuredOutputKind.JSON_OBJECT),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput(StructuredOutputKind.JSON_SCHEMA, SCHEMA_SPEC)),
        ({"guided_regex": "a|b"}, StructuredOutput(StructuredOutputKind.REGEX, "a|b")),
        (
            {"guided_choice": ["a", "b"]},
            StructuredOutput(StructuredOutputKind.CHOICE, '["a", "b"]'),
        ),
        (
            {"guided_grammar": 'root ::= "x"'},
            StructuredOutput(StructuredOutputKind.GRAMMAR, 'root ::= "x"'),
        ),
        # Text output alongside a vLLM field is one constraint, not two.
        (
            {"response_format": {"type": "text"}, "guided_regex": "a"},
            StructuredOutput(StructuredOutputKind.REGEX, "a"),
        ),
    ],
)
def test_each_shape_maps_to_its_constraint(
    fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    constraint = structured_output_of(**fields)
    assert constraint == expected
    assert constraint is None or constraint.validate() is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": "json"}, "response_format", "an object with a type"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "with a schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "JSON Schema object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "needs a name",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one of",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": ["a", 2]}, "guided_choice", "non-empty list of strings"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "one structured output, not response_format and guided_regex",
        ),
    ],
)
def test_malformed_fields_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(ApiError) as raised:
        structured_output_of(**fields)
    assert raised.value.status == 400
    assert raised.value.param == param
    assert message in raised.value.message
