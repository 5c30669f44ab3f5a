"""``tool_choice`` "required" and a named function: the output is constrained JSON.

With these choices the model does not write calls in its own format: a grammar holds
its output to a JSON schema (``tool_choice_schema``), and these parsers read that JSON:

- "required": an array of ``{"name": ..., "arguments": {...}}`` objects, at least one
  (exactly one without parallel tool calls), each name one of the tools';
- a named function: the output is that function's arguments object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from server.json_schema_defs import HoistedDefs
from server.tool_parsers.base import ToolParser
from server.tool_parsers.json_reader import JsonValueScanner

_WHITESPACE = " \t\r\n"
# A function declared without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    """The tool_choice names no tool of the request."""


def tool_choice_schema(
    tools: Sequence[Mapping[str, Any]], tool_choice: Any, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None ("auto", "none": no constraint)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice == "required":
        # Each tool's parameters sit inside the array's schema: their $defs go to its root.
        defs = HoistedDefs()
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "arguments": defs.embed(
                        function.get("parameters") or NO_PARAMETERS,
                        f"/items/anyOf/{index}/properties/arguments",
                    ),
                },
                "required": ["name", "arguments"],
            }
            for index, (name, function) in enumerate(functions.items())
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        if defs.defs:
            schema["$defs"] = defs.defs
        return schema
    name = named_function(tool_choice)
    if name not in functions:
        raise ToolChoiceError(f"tool_choice names {name!r}, which is not one of the tools")
    return dict(functions[name].get("parameters") or NO_PARAMETERS)


def named_function(tool_choice: Mapping[str, Any]) -> str:
    """The function name of ``{"type": "function", "function": {"name": ...}}``."""
    return tool_choice["function"]["name"]


class CallArrayParser(ToolParser):
    """Reads "required"'s output: a JSON array of call objects."""

    name = "call_array"
    _state: Literal["start", "array", "content"] = "start"

    def _consume(self, final: bool) -> None:
        if self._state == "start":
            pending = self._pending
            stripped = pending.lstrip(_WHITESPACE)
            if not stripped and not final:
                return
            if stripped.startswith("["):
                self._held = pending[: len(pending) - len(stripped) + 1]
                self._pending = stripped[1:]
                self._array_expect = "item or ]"
                self._state = "array"
            else:
                self._state = "content"
        if self._state == "array":
            if not self._read_array(final):
                return
            self._state = "content"
        self._content(self._pending)
        self._pending = ""


class NamedFunctionParser(ToolParser):
    """Reads a named function's output: its arguments object, sent as it arrives."""

    name = "named_function"
    _scanner: JsonValueScanner | None = None

    def __init__(self, function_name: str, new_call_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_call_id=new_call_id)
        self._function_name = function_name

    def _consume(self, final: bool) -> None:
        if self._num_calls == 0:
            # The call is certain from the start: its first delta goes out at once.
            self._start_call(self._function_name)
            self._scanner = JsonValueScanner()
        scanner = self._scanner
        if scanner is None:  # the arguments are complete: nothing else is part of the call
            self._pending = ""
            return
        pending = self._pending
        start = 0 if scanner.begun else len(pending) - len(pending.lstrip(_WHITESPACE))
        end = scanner.scan(pending, start)
        self._arguments(pending[start:end])
        self._pending = ""
        if scanner.complete or final:
            self._scanner = None
            self._end_call()
