"""How a tool-call parser's calls are written, as a grammar: a structural-tag format (xgrammar's,
as vLLM's ``structural_tag`` takes it) that holds the output to one or more calls of the
request's tools, each with arguments that follow its ``parameters`` schema.

A request with tools and a response format asks for either a call or an answer in that
format (``server/answer_grammar.py``); this is the call half of that alternative, written as the
parser reads it and the chat template teaches it:

- hermes: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per
  call, a newline between blocks;
- llama3_json: ``{"name": "f", "parameters": {...}}``, calls separated by ``; ``.

Mistral's calls start with ``[TOOL_CALLS]``, a special token, which a grammar cannot match (the
engine's grammars never allow special tokens): it has no format here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser
from server.tool_parsers.tool_choice import NO_PARAMETERS

Format = dict[str, Any]


def call_format(
    parser: str, tools: Sequence[Mapping[str, Any]], parallel_tool_calls: bool
) -> Format | None:
    """One or more calls (one without ``parallel_tool_calls``) of ``tools`` as ``parser``
    reads them, or None if its calls cannot be written as a grammar."""
    syntax = _CALL_SYNTAX.get(parser)
    if syntax is None:
        return None
    tags = [
        {
            "type": "tag",
            "begin": syntax.begin.format(name=_json_text(tool["function"]["name"])),
            "content": {
                "type": "json_schema",
                "json_schema": tool["function"].get("parameters") or NO_PARAMETERS,
            },
            "end": syntax.end,
        }
        for tool in tools
    ]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": syntax.separator,
        "at_least_one": True,
        "stop_after_first": not parallel_tool_calls,
    }


def _json_text(name: str) -> str:
    """A function name as it reads inside a JSON string (the quotes are the syntax's)."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


class _CallSyntax(NamedTuple):
    begin: str  # the text before a call's arguments object; {name}: the function's name
    end: str  # the text after it
    separator: str  # the text between two calls


_CALL_SYNTAX = {
    HermesToolParser.name: _CallSyntax(
        '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"
    ),
    Llama3JsonToolParser.name: _CallSyntax('{{"name": "{name}", "parameters": ', "}", "; "),
}
