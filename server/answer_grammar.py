"""The grammar a chat answer is held to, composed of its parts: the reasoning a thinking model
writes first, then what the request asks of the answer proper. vLLM's semantics:

- the reasoning is free: the grammar of the answer starts after the reasoning parser's end
  marker (vLLM starts its matcher once the reasoning has ended). A prompt that opens
  ``<think>`` itself (QwQ, DeepSeek-R1's distillations) has the answer start inside the
  reasoning; otherwise (Qwen3) the model may write a reasoning block first, or not, as the
  reasoning parser reads it;
- ``tool_choice`` "required" or a named function: the call's JSON alone. A response format is
  for a text answer, and there is none;
- "auto" with a response format: either calls, in the syntax of the model's tool-call parser
  (``server/tool_parsers/call_formats.py``), or an answer in the format, each under its own
  grammar (openai-agents' ``Agent(tools=..., output_type=...)`` asks for this);
- "none", or no tools: the format alone.

Parts are composed as an xgrammar structural tag (``StructuredOutputKind.STRUCTURAL_TAG``); an
answer of one part keeps its plain constraint, and the engine's grammar is the same as before.
"""

from __future__ import annotations

import json
from typing import Any

from protocol import StructuredOutput, StructuredOutputKind
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest
from server.reasoning import ReasoningParser, prompt_opens_reasoning
from server.reasoning_parsers import REASONING_PARSERS
from server.served_model import ServedModel
from server.tool_calling import ToolUse, declared_tools
from server.tool_parsers.call_formats import Format, call_format

# Between the reasoning and the answer: Qwen3 writes "\n\n". Bounded, so that whitespace can
# never take the place of the answer.
_GAP = {"type": "regex", "pattern": "[ \\t\\r\\n]{0,4}"}
_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def answer_constraint(
    model: ServedModel,
    body: ChatCompletionRequest,
    tools: ToolUse,
    requested: StructuredOutput | None,
    prompt: str,
) -> StructuredOutput | None:
    """The constraint of a chat request's answers, or None for free text: ``tools`` is what
    its tools ask, ``requested`` its response format, and ``prompt`` the prompt's text.
    ApiError (400) for tools and a response format where the model's tool-call parser writes
    calls no grammar can hold."""
    if tools.constraint is not None:
        answer = tools.constraint
    elif requested is not None and tools.parser is not None:
        assert body.tools and model.tool_parser is not None  # "auto" has both
        calls = call_format(
            model.tool_parser, declared_tools(body.tools) or [], body.parallel_tool_calls
        )
        if calls is None:
            raise ApiError(
                400,
                f"tools with a response format need calls a grammar can hold, and the "
                f"{model.tool_parser} tool-call parser's calls start with a special token; use "
                'tool_choice "none" or "required", or leave out the response format.',
                param="response_format",
            )
        answer = _structural_tag({"type": "or", "elements": [calls, _format(requested)]})
    else:
        answer = requested
    reasoning = model.reasoning_parser
    if answer is None or reasoning is None:
        return answer
    parts = [_reasoning(REASONING_PARSERS[reasoning], prompt), _GAP, _format(answer)]
    return _structural_tag({"type": "sequence", "elements": parts})


def _structural_tag(format_: Format) -> StructuredOutput:
    """A format as the one constraint the engine compiles."""
    return StructuredOutput(
        StructuredOutputKind.STRUCTURAL_TAG,
        json.dumps(
            {"type": "structural_tag", "format": format_},
            ensure_ascii=False,
            separators=(",", ":"),
        ),
    )


def _reasoning(parser: type[ReasoningParser], prompt: str) -> Format:
    """The reasoning block, free text to its end marker: already open in the prompt, or one
    the model may open first."""
    opens = prompt_opens_reasoning(prompt)
    block = {
        "type": "tag",
        "begin": "" if opens else parser.start,
        "content": {"type": "any_text"},
        "end": parser.end,
    }
    return block if opens else {"type": "optional", "content": block}


def _format(constraint: StructuredOutput) -> Format:
    """One constraint as a part of a structural tag."""
    kind, spec = constraint.kind, constraint.spec
    if kind == StructuredOutputKind.JSON_SCHEMA:
        return {"type": "json_schema", "json_schema": json.loads(spec)}
    if kind == StructuredOutputKind.JSON_OBJECT:
        return {"type": "json_schema", "json_schema": _JSON_OBJECT}
    if kind == StructuredOutputKind.REGEX:
        return {"type": "regex", "pattern": spec}
    if kind == StructuredOutputKind.CHOICE:
        choices = json.loads(spec)
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    if kind == StructuredOutputKind.GRAMMAR:
        return {"type": "grammar", "grammar": spec}
    assert kind == StructuredOutputKind.STRUCTURAL_TAG, kind
    return json.loads(spec)["format"]
