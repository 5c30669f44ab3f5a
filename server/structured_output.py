"""A request's structured-output fields, in any of the shapes clients send, as the one
``StructuredOutput`` the engine enforces.

The shapes: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its
older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. Only their form is
checked here; whether a schema, regex or grammar is valid is the engine's grammar library's to
say, and its message reaches the client as a 400 (an ``invalid_request`` ErrorReply).
"""

from __future__ import annotations

import json
from typing import Any

from protocol import StructuredOutput, StructuredOutputKind
from server.errors import ApiError

_VLLM_FIELDS = {
    "json": StructuredOutputKind.JSON_SCHEMA,
    "regex": StructuredOutputKind.REGEX,
    "choice": StructuredOutputKind.CHOICE,
    "grammar": StructuredOutputKind.GRAMMAR,
    "json_object": StructuredOutputKind.JSON_OBJECT,
}


def structured_output_of(
    *,
    response_format: Any = None,
    structured_outputs: Any = None,
    guided_json: Any = None,
    guided_regex: Any = None,
    guided_choice: Any = None,
    guided_grammar: Any = None,
) -> StructuredOutput | None:
    """The constraint a request's fields ask for, or None for free text. ApiError (400) for a
    malformed field, or for more than one constraint."""
    asked: dict[str, StructuredOutput] = {}
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            asked["response_format"] = constraint
    if structured_outputs is not None:
        asked["structured_outputs"] = _from_structured_outputs(structured_outputs)
    guided = {
        "guided_json": (StructuredOutputKind.JSON_SCHEMA, guided_json),
        "guided_regex": (StructuredOutputKind.REGEX, guided_regex),
        "guided_choice": (StructuredOutputKind.CHOICE, guided_choice),
        "guided_grammar": (StructuredOutputKind.GRAMMAR, guided_grammar),
    }
    for param, (kind, value) in guided.items():
        if value is not None:
            asked[param] = _constraint(kind, value, param)
    if len(asked) > 1:
        raise ApiError(
            400,
            f"a request may ask for one structured output, not {' and '.join(asked)}",
            param=next(iter(asked)),
        )
    return next(iter(asked.values()), None)


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(
            400, "response_format must be an object with a type", param="response_format"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(
                400,
                "response_format json_schema needs a json_schema object with a schema",
                param="response_format.json_schema",
            )
        # strict is not read: the output always follows the schema.
        constraint = _constraint(
            StructuredOutputKind.JSON_SCHEMA, spec["schema"], "response_format.json_schema.schema"
        )
        # Required by OpenAI's API (and vLLM's), though the output does not depend on it.
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError(
                400,
                "response_format json_schema needs a name (a non-empty string)",
                param="response_format.json_schema.name",
            )
        return constraint
    raise ApiError(
        400,
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        param="response_format.type",
    )


def _from_structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    # vLLM's defaults (None, False) mean "not set"; a set field we do not know is refused.
    given = {name: item for name, item in value.items() if item not in (None, False)}
    unsupported = sorted(given.keys() - _VLLM_FIELDS.keys())
    if unsupported:
        raise ApiError(
            400,
            f"structured_outputs.{unsupported[0]} is not supported",
            param=f"structured_outputs.{unsupported[0]}",
        )
    if len(given) != 1:
        raise ApiError(
            400,
            f"structured_outputs needs exactly one of {', '.join(_VLLM_FIELDS)}",
            param="structured_outputs",
        )
    ((name, item),) = given.items()
    return _constraint(_VLLM_FIELDS[name], item, f"structured_outputs.{name}")


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """One field's value as a constraint of ``kind``; ``param`` names the field in errors."""
    if kind == StructuredOutputKind.JSON_OBJECT:
        if value is not True:
            raise ApiError(400, f"{param} must be true", param=param)
        return StructuredOutput(kind)
    if kind == StructuredOutputKind.JSON_SCHEMA:
        if isinstance(value, str):  # the schema as JSON text
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                raise ApiError(400, f"{param} is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, dict | bool):
            raise ApiError(400, f"{param} must be a JSON Schema object", param=param)
        # Compact and in the client's key order (the output follows the properties' order).
        return StructuredOutput(kind, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    if kind == StructuredOutputKind.CHOICE:
        if not (isinstance(value, list) and value and all(isinstance(item, str) for item in value)):
            raise ApiError(400, f"{param} must be a non-empty list of strings", param=param)
        return StructuredOutput(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    return StructuredOutput(kind, value)
