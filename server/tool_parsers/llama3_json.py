"""Llama 3.1 / 3.2 JSON calls, as their chat templates ask for them:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``, several separated by ``;``. The answer is either
calls or content: calls only if it starts (after whitespace) with ``{`` or the tag. A
first object that is not a call (no string ``name``, no ``parameters`` or
``arguments``) makes the whole answer content; text after the calls is content.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from server.tool_parsers.base import ToolParser

_PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    argument_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    _state: Literal["start", "calls", "content"] = "start"

    def _consume(self, final: bool) -> None:
        if self._state == "start":
            pending = self._pending
            stripped = pending.lstrip(_WHITESPACE)
            if not final and (not stripped or _PYTHON_TAG.startswith(stripped)):
                return
            lead = pending[: len(pending) - len(stripped)]
            if stripped.startswith(_PYTHON_TAG):
                self._held = lead + _PYTHON_TAG
                self._pending = stripped[len(_PYTHON_TAG) :]
                self._state = "calls"
            elif stripped.startswith("{"):
                self._held = lead
                self._pending = stripped
                self._state = "calls"
            else:
                self._state = "content"
        if self._state == "calls":
            if not self._read_calls(final):
                return
            self._state = "content"
        self._content(self._pending)
        self._pending = ""

    def _read_calls(self, final: bool) -> bool:
        """Reads calls and their separators; True once something else (or the end) comes."""
        while True:
            if self._reader is not None:
                used, outcome = self._read_call(self._pending, end_of_input=final)
                self._pending = self._pending[used:]
                if outcome == "open":
                    return False
                if outcome == "not a call":
                    return True
                continue
            stripped = self._pending.lstrip(_WHITESPACE + ";")
            self._hold(self._pending[: len(self._pending) - len(stripped)])
            self._pending = stripped
            if stripped.startswith("{"):
                # Without its arguments any JSON object with a "name" would be a call.
                self._begin_call_object(require_arguments=True)
                continue
            if stripped or final:
                if self._held:  # the tag, and no call after it
                    self._reject()
                return True
            return False
