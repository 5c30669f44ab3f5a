"""Tool-call parsers, one per format a model family writes its calls in.

``TOOL_PARSERS`` maps a parser's name to its class (the names vLLM's
``--tool-call-parser`` uses); ``tool_parser_for_template`` picks one from the markers
a chat template teaches its model. "required" and named ``tool_choice`` outputs are
constrained JSON instead, read by the parsers of ``tool_choice``.
"""

from __future__ import annotations

from server.tool_parsers.base import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolParserDelta,
    assemble,
)
from server.tool_parsers.harmony import HarmonyToolParser
from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser
from server.tool_parsers.mistral import MistralToolParser
from server.tool_parsers.tool_choice import (
    CallArrayParser,
    NamedFunctionParser,
    ToolChoiceError,
    tool_choice_schema,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser)
}


def tool_parser_for_template(template_source: str) -> str | None:
    """The parser for the call format the template shows its model, or None."""
    if "<|channel|>" in template_source:  # harmony (gpt-oss)
        return HarmonyToolParser.name
    if "<tool_call>" in template_source:
        return HermesToolParser.name
    if "[TOOL_CALLS]" in template_source:
        return MistralToolParser.name
    # Llama 3.1's template writes <|python_tag|>; 3.2's only names the ipython role.
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return Llama3JsonToolParser.name
    return None


__all__ = [
    "TOOL_PARSERS",
    "CallArrayParser",
    "HarmonyToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedFunctionParser",
    "ParsedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoiceError",
    "ToolParser",
    "ToolParserDelta",
    "assemble",
    "tool_choice_schema",
    "tool_parser_for_template",
]
