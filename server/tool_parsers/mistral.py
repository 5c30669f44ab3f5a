"""Mistral calls, after the ``[TOOL_CALLS]`` marker, in either of Mistral's formats:

- tokenizers before v11 (Mistral 7B v0.3, Nemo): a JSON array of call objects,
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "..."}, ...]``;
- v11 and later (Small 3.x, Devstral): one marker per call, the name, then the
  arguments, ``[TOOL_CALLS]f[ARGS]{...}``, with ``[CALL_ID]id`` before ``[ARGS]`` in
  some versions (the id is skipped: the call gets one of ours).

Content may come before the marker. Mistral's templates refuse call ids that are not
nine letters or digits, so the calls get such ids, as vLLM gives them.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Literal

from server.tool_parsers.base import ToolParser, partial_marker_length
from server.tool_parsers.json_reader import VALUE_START, JsonValueScanner

_MARKER = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_WHITESPACE = " \t\r\n"
_NAME_SO_FAR = re.compile(r"[A-Za-z0-9_.\-]*")
_ALPHANUMERIC = string.ascii_letters + string.digits

_State = Literal["content", "format", "array", "name", "call id", "arguments"]


class MistralToolParser(ToolParser):
    name = "mistral"
    _state: _State = "content"
    _name = ""
    _scanner: JsonValueScanner | None = None

    @staticmethod
    def default_call_id() -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def _consume(self, final: bool) -> None:
        while True:
            pending = self._pending
            state = self._state
            if state == "content":
                start = pending.find(_MARKER)
                if start < 0:
                    keep = 0 if final else partial_marker_length(pending, _MARKER)
                    self._content(pending[: len(pending) - keep])
                    self._pending = pending[len(pending) - keep :]
                    return
                self._content(pending[:start])
                self._pending = pending[start + len(_MARKER) :]
                self._held = _MARKER
                self._state = "format"
            elif state == "format":
                stripped = pending.lstrip(_WHITESPACE)
                self._hold(pending[: len(pending) - len(stripped)])
                self._pending = stripped
                if not stripped:
                    if not final:
                        return
                    self._reject()
                    self._state = "content"
                elif stripped.startswith("["):
                    self._hold("[")
                    self._pending = stripped[1:]
                    self._array_expect = "item or ]"
                    self._state = "array"
                else:
                    self._name = ""
                    self._state = "name"
            elif state == "array":
                if not self._read_array(final):
                    return
                self._state = "content"
            elif state == "name":
                if not self._read_name(final):
                    return
            elif state == "call id":
                # Skipped up to the arguments (`{` for tokenizers that drop [ARGS]'s text).
                ends = [i for i in (pending.find(_ARGS), pending.find("{")) if i >= 0]
                if ends:
                    end = min(ends)
                    skip = len(_ARGS) if pending.startswith(_ARGS, end) else 0
                    self._pending = pending[end + skip :]
                    self._start_arguments()
                elif final:
                    self._pending = ""
                    self._end_call()
                    self._state = "content"
                else:
                    self._pending = pending[len(pending) - partial_marker_length(pending, _ARGS) :]
                    return
            elif not self._read_arguments(final):
                return

    def _read_name(self, final: bool) -> bool:
        """Reads the v11 format's name; False while it is not complete."""
        pending = self._pending
        ends = [
            (index, marker)
            for marker in (_ARGS, _CALL_ID, "{")
            if (index := pending.find(marker)) >= 0
        ]
        end, marker = min(ends) if ends else (-1, "")
        if end < 0:
            end = len(pending) - (0 if final else partial_marker_length(pending, _ARGS, _CALL_ID))
        piece = pending[:end]
        self._held += piece
        self._pending = pending[end:]
        if not self._name:
            piece = piece.lstrip(_WHITESPACE)
        # Only the new piece is checked, after what stands for the name so far (valid, or it
        # was rejected): nothing, a name, or a name and whitespace. Checking the whole name
        # at each delta made a name that never ends cost quadratic time.
        so_far = "" if not self._name else "a " if self._name[-1] in _WHITESPACE else "a"
        self._name += piece
        name_is_valid = _NAME_SO_FAR.fullmatch((so_far + piece).strip(_WHITESPACE))
        name = self._name.strip(_WHITESPACE) if marker or final else ""
        if not name_is_valid or ((marker or final) and not name):
            self._reject()
            self._state = "content"
            return True
        if not marker:
            if final:
                self._reject()
                self._state = "content"
            return final
        self._start_call(name)
        if marker == _CALL_ID:
            self._pending = self._pending[len(_CALL_ID) :]
            self._state = "call id"
        else:
            if marker == _ARGS:
                self._pending = self._pending[len(_ARGS) :]
            self._start_arguments()
        return True

    def _start_arguments(self) -> None:
        self._scanner = JsonValueScanner()
        self._state = "arguments"

    def _read_arguments(self, final: bool) -> bool:
        """Passes the arguments on as they come; False while they are not complete."""
        scanner = self._scanner
        assert scanner is not None
        pending = self._pending
        start = 0
        if not scanner.begun:
            stripped = pending.lstrip(_WHITESPACE)
            start = len(pending) - len(stripped)
            if not stripped and not final:
                self._pending = ""
                return False
            if not stripped or stripped[0] not in VALUE_START:
                # No arguments after the name: the call ends here.
                self._pending = stripped
                self._end_call()
                self._state = "content"
                return True
        end = scanner.scan(pending, start)
        self._arguments(pending[start:end])
        self._pending = pending[end:]
        if scanner.complete or final:
            self._scanner = None
            self._end_call()
            self._state = "content"
            return True
        return False
