"""Hermes-style calls, as Qwen2.5, Qwen3 and Hermes models write them:

    some content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": ...}
    </tool_call>

Each call is one JSON object between ``<tool_call>`` and ``</tool_call>`` (a closing
tag inside one of the object's strings is that string's text). Whatever follows the
object inside its block is dropped; a block that holds no call (no object, or one
without a string name) is content, markers and all.

Small Qwen2.5 models (Qwen2.5-Coder-0.5B) often leave the tags out and answer with
the bare object. So an answer that starts with an object of exactly the two keys
``name`` and ``arguments``, whose name is one of the request's tools, is a call too;
any other key, as in JSON written as content, or another name (an object that merely
looks like a call) makes it content as soon as it shows.
"""

from __future__ import annotations

from typing import Literal

from server.tool_parsers.base import ToolParser, partial_marker_length

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_WHITESPACE = " \t\r\n"

# Where the parser is: at the start of the answer; in a bare call object there; outside
# any call; in a block reading its call, dropping what follows the call, or passing on
# a block that turned out to hold no call.
_Place = Literal["start", "bare call", "outside", "call", "after call", "not a call"]


class HermesToolParser(ToolParser):
    name = "hermes"
    _place: _Place = "start"

    def _consume(self, final: bool) -> None:
        while True:
            pending = self._pending
            place = self._place
            if place == "start":
                stripped = pending.lstrip(_WHITESPACE)
                if not stripped and not final:
                    return
                self._place = "outside"
                if stripped.startswith("{"):
                    self._held = pending[: len(pending) - len(stripped)]
                    self._pending = stripped
                    self._begin_call_object(require_arguments=True, only_call_keys=True, bare=True)
                    self._place = "bare call"
            elif place == "bare call":
                used, outcome = self._read_call(pending, end_of_input=final)
                self._pending = pending[used:]
                if outcome == "open":
                    return
                self._place = "outside"
            elif place == "outside":
                start = pending.find(_OPEN)
                if start < 0:
                    keep = 0 if final else partial_marker_length(pending, _OPEN)
                    self._content(pending[: len(pending) - keep])
                    self._pending = pending[len(pending) - keep :]
                    return
                self._content(pending[:start])
                self._pending = pending[start + len(_OPEN) :]
                self._held = _OPEN
                self._begin_call_object()
                self._place = "call"
            else:
                end = pending.find(_CLOSE)
                if end < 0 and not final:
                    keep = partial_marker_length(pending, _CLOSE)
                    self._pending = pending[len(pending) - keep :]
                    self._block_text(pending[: len(pending) - keep], end_of_block=False)
                    return
                self._block_text(pending if end < 0 else pending[:end], end_of_block=False)
                if end >= 0 and self._reading_a_string():
                    # The tag is text in one of the call's strings: the block goes on.
                    self._block_text(_CLOSE, end_of_block=False)
                    self._pending = pending[end + len(_CLOSE) :]
                    continue
                self._pending = "" if end < 0 else pending[end + len(_CLOSE) :]
                self._block_text("", end_of_block=True)
                if end >= 0 and self._place == "not a call":
                    self._content(_CLOSE)
                self._place = "outside"
                if end < 0:
                    return

    def _reading_a_string(self) -> bool:
        return self._place == "call" and self._reader is not None and self._reader.in_string

    def _block_text(self, text: str, end_of_block: bool) -> None:
        if self._place == "call":
            used, outcome = self._read_call(text, end_of_input=end_of_block)
            if outcome == "open":
                return
            text = text[used:]
            self._place = "not a call" if outcome == "not a call" else "after call"
        if self._place == "not a call":
            self._content(text)
