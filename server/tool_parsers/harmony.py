"""gpt-oss's tool calls (OpenAI's harmony format), vLLM's ``openai`` tool-call parser.

The harmony reasoning parser (``server/harmony.py``) passes each message to a function on
as content in one form, ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``:
here its name starts a call and the arguments, JSON as the model writes it, stream until
``<|call|>``. Content around the calls is content.
"""

from __future__ import annotations

from server.tool_parsers.base import ToolParser, partial_marker_length

MESSAGE = "<|message|>"
CALL = "<|call|>"
# What a call's form starts with; its function's name follows, up to <|message|>.
CALL_HEADER = "<|channel|>commentary to=functions."


class HarmonyToolParser(ToolParser):
    name = "openai"

    def _consume(self, final: bool) -> None:
        while True:
            pending = self._pending
            if self._in_call:
                end = pending.find(CALL)
                if end < 0:
                    keep = 0 if final else partial_marker_length(pending, CALL)
                    self._arguments(pending[: len(pending) - keep])
                    self._pending = pending[len(pending) - keep :]
                    if final:
                        self._end_call()
                    return
                self._arguments(pending[:end])
                self._pending = pending[end + len(CALL) :]
                self._end_call()
                continue
            start = pending.find(CALL_HEADER)
            if start < 0:
                keep = 0 if final else partial_marker_length(pending, CALL_HEADER)
                self._content(pending[: len(pending) - keep])
                self._pending = pending[len(pending) - keep :]
                return
            self._content(pending[:start])
            name_end = pending.find(MESSAGE, start)
            if name_end < 0:  # the name is not complete yet
                self._pending = pending[start:]
                if final:
                    self._content(self._pending)
                    self._pending = ""
                return
            self._start_call(pending[start + len(CALL_HEADER) : name_end].strip())
            self._pending = pending[name_end + len(MESSAGE) :]
