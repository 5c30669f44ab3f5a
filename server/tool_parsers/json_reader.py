"""Incremental JSON reading for tool calls: where a value ends, and a call object's parts.

Models write their calls as text a few characters at a time, so both readers take
text in pieces of any size and keep their state between pieces. Neither builds the
arguments: they are passed on as the model wrote them, which is what lets a stream
carry them piece by piece and still add up to the non-streamed answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

_WHITESPACE = " \t\r\n"
# Characters that can continue a number, true, false or null.
_SCALAR_END = re.compile(r"[^0-9A-Za-z+\-.]")
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')
# The characters a JSON value can start with.
VALUE_START = frozenset('"{[-0123456789tfn')


class JsonValueScanner:
    """Finds the end of one JSON value that starts at the first character it is given.

    It follows strings (with escapes) and the nesting of objects and arrays, but does not
    check the rest of JSON's grammar. A number or literal ends at the first character
    that cannot continue it, which is then left to the caller.
    """

    def __init__(self) -> None:
        self.complete = False
        self.is_string = False  # known once the first character is scanned
        self._kind = ""  # "string", "container" or "scalar"
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the last piece ended just after a backslash

    @property
    def begun(self) -> bool:
        return bool(self._kind)

    @property
    def in_string(self) -> bool:
        return self._in_string

    def scan(self, text: str, start: int = 0) -> int:
        """Reads ``text[start:]``; returns where the value's text ends in it (exclusive)."""
        index = start
        if not self._kind and index < len(text):
            first = text[index]
            index += 1
            if first == '"':
                self._kind, self._in_string, self.is_string = "string", True, True
            elif first in "{[":
                self._kind, self._depth = "container", 1
            else:
                self._kind = "scalar"
        while index < len(text) and not self.complete:
            if self._escaped:
                self._escaped = False
                index += 1
            elif self._in_string:
                found = _STRING_STOP.search(text, index)
                if found is None:
                    return len(text)
                index = found.end()
                if found.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                    self.complete = self._kind == "string"
            elif self._kind == "scalar":
                found = _SCALAR_END.search(text, index)
                if found is None:
                    return len(text)
                self.complete = True
                return found.start()
            else:
                found = _CONTAINER_STOP.search(text, index)
                if found is None:
                    return len(text)
                index = found.end()
                mark = found.group()
                if mark == '"':
                    self._in_string = True
                elif mark in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    self.complete = self._depth == 0
        return index


class CallObjectReader:
    """Reads one call written as a JSON object: ``{"name": "f", "arguments": {...}}``.

    ``name`` is set once the name's string is complete. The arguments value's text is
    handed out as it arrives (``take_arguments``); a string value (some models quote
    their arguments) is decoded once complete, and a missing one reads as ``{}`` unless
    ``require_arguments``. Other keys are skipped, or with ``only_call_keys`` make the
    object no call; so does a name not among ``names``, when given. ``failed`` is set when
    the text is not such an object, ``done`` after its closing brace; ``read`` stops there.
    """

    def __init__(
        self,
        argument_keys: tuple[str, ...] = ("arguments",),
        *,
        require_arguments: bool = False,
        only_call_keys: bool = False,
        names: Collection[str] | None = None,
    ) -> None:
        self.name: str | None = None
        self.has_arguments = False  # the arguments value has begun (or is known)
        self.done = False
        self.failed = False
        self._argument_keys = argument_keys
        self._require_arguments = require_arguments
        self._only_call_keys = only_call_keys
        self._names = names
        self._expect = "{"  # "{", "key or }", "key", ":", "value", ", or }"
        self._key: str | None = None
        self._scanner: JsonValueScanner | None = None
        self._raw: list[str] | None = None  # the key or value being scanned, if kept
        self._arguments: list[str] = []  # arguments text not taken yet
        self._streaming_arguments = False

    @property
    def in_string(self) -> bool:
        """Inside a key or a string value: markup read now is the string's text."""
        return self._scanner is not None and self._scanner.in_string

    def take_arguments(self) -> str:
        """The arguments' text that arrived since the last call."""
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def read(self, text: str) -> int:
        """Reads ``text``; returns how much of it belongs to the object (all, unless it ended)."""
        index = 0
        while index < len(text) and not (self.done or self.failed):
            if self._scanner is not None:
                end = self._scanner.scan(text, index)
                self._keep(text[index:end])
                index = end
                if self._scanner.complete:
                    self._scanned()
                continue
            char = text[index]
            if char in _WHITESPACE:
                index += 1
                continue
            expect = self._expect
            if expect == "{" and char == "{":
                self._expect = "key or }"
            elif expect in ("key or }", ", or }") and char == "}":
                self._close()
            elif expect in ("key or }", "key") and char == '"':
                self._begin(kept=True)
                continue  # the scanner reads the quote
            elif expect == ":" and char == ":":
                self._expect = "value"
            elif expect == "value" and char in VALUE_START:
                self._begin_value(char)
                continue
            elif expect == ", or }" and char == ",":
                self._expect = "key"
            else:
                self.failed = True
                return index
            index += 1
        return index

    def _begin(self, kept: bool) -> None:
        self._scanner = JsonValueScanner()
        self._raw = [] if kept else None

    def _begin_value(self, first: str) -> None:
        key = self._key
        if key == "name" and self.name is None:
            if first != '"':
                self.failed = True  # a call's name is a string
                return
            self._begin(kept=True)
        elif key in self._argument_keys and not self.has_arguments:
            self._begin(kept=first == '"')
            # Anything but a string is passed on as written, as it arrives.
            self._streaming_arguments = first != '"'
            self.has_arguments = self._streaming_arguments
        else:
            self._begin(kept=False)

    def _keep(self, piece: str) -> None:
        if self._streaming_arguments:
            self._arguments.append(piece)
        elif self._raw is not None:
            self._raw.append(piece)

    def _scanned(self) -> None:
        raw = None if self._raw is None else "".join(self._raw)
        self._scanner = None
        self._raw = None
        if self._expect in ("key or }", "key"):
            self._key = _decode_string(raw)
            self._expect = ":"
            if self._only_call_keys and self._key not in ("name", *self._argument_keys):
                self.failed = True
            return
        self._expect = ", or }"
        if self._streaming_arguments:
            self._streaming_arguments = False
        elif raw is not None and self._key == "name" and self.name is None:
            self.name = _decode_string(raw)
            if self._names is not None and self.name not in self._names:
                self.failed = True
        elif raw is not None and self._key in self._argument_keys and not self.has_arguments:
            decoded = _decode_string(raw)
            self._arguments.append(decoded if decoded is not None else raw)
            self.has_arguments = True
        if self.name is None and self._key == "name":
            self.failed = True  # the name's string did not decode

    def _close(self) -> None:
        if self.name is None or (self._require_arguments and not self.has_arguments):
            self.failed = True
            return
        if not self.has_arguments:
            self._arguments.append("{}")
            self.has_arguments = True
        self.done = True


def _decode_string(raw: str | None) -> str | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None
