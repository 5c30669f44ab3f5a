"""What every tool-call parser shares: the call and delta types, and the streaming core.

A parser reads a model's answer as text deltas (``feed``, then ``finish``) and splits
it into content and OpenAI-shaped tool-call deltas. The non-streamed ``parse`` is the
same machine fed the whole text at once, so a streamed answer assembles to exactly
the non-streamed one whatever the deltas' boundaries.

Text is held back only while it might still turn out to be part of a call (the start
of a marker, a call whose name is not complete yet): once a call's name is known the
call is committed, its first delta goes out, and its arguments follow as the model
writes them. What looked like a call but is not one comes back as content, as it
was written. Whitespace before a call is dropped, and after it unless content came
before it: the content reads as if the calls were cut out of the text.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from server.tool_parsers.json_reader import CallObjectReader

_ALPHANUMERIC = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"

ObjectOutcome = Literal["open", "call", "not a call"]


def openai_call_id() -> str:
    """An id in OpenAI's shape: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call: its first carries the id and name, the rest arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolParserDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None  # None when the answer is only tool calls, as OpenAI sends it
    tool_calls: list[ToolCall]


def joined(pieces: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """``pieces`` with each call's consecutive pieces made one, which keeps the first's id
    and name: a chunk carries at most one entry per call, as OpenAI's do (clients that
    read ``tool_calls[0]`` of a chunk would lose the rest)."""
    merged: list[ToolCallDelta] = []
    for piece in pieces:
        if merged and merged[-1].index == piece.index:
            assert piece.id is None, "a call starts once"
            merged[-1] = replace(merged[-1], arguments=merged[-1].arguments + piece.arguments)
        else:
            merged.append(piece)
    return merged


def assemble(deltas: Iterable[ToolParserDelta]) -> ParsedToolCalls:
    """What a client that joins the streamed deltas ends up with."""
    content: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.id is not None:
                calls[piece.index] = (piece.id, piece.name or "", [piece.arguments])
            else:
                calls[piece.index][2].append(piece.arguments)
    tool_calls = [
        ToolCall(call_id, name, "".join(arguments))
        for call_id, name, arguments in (calls[index] for index in sorted(calls))
    ]
    text = "".join(content)
    return ParsedToolCalls(None if tool_calls and not text else text, tool_calls)


class ToolParser(ABC):
    """Splits one answer into content and tool calls; one instance per answer."""

    name: ClassVar[str]
    # For formats that write each call as {"name": ..., <arguments key>: {...}}.
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(
        self,
        *,
        max_calls: int | None = None,
        new_call_id: Callable[[], str] | None = None,
        tool_names: Collection[str] | None = None,
    ) -> None:
        """``max_calls`` keeps the first calls only (1 for ``parallel_tool_calls=false``);
        ``tool_names`` are the request's tools, for a format that reads a call without
        its markers only when it names one of them (None: any name)."""
        self._max_calls = max_calls
        self._tool_names = tool_names
        self._new_call_id = new_call_id or self.default_call_id
        self._pending = ""  # fed, not read yet: it may begin a marker
        self._held = ""  # read as the start of a call not committed yet
        self._space = ""  # whitespace after the content so far: dropped if a call follows
        # Whitespace right after a call is dropped too, unless content came before it.
        self._after_call = False
        self._wrote_content = False
        self._num_calls = 0
        self._in_call = False
        self._emitting = False  # the current call is one of the first max_calls
        self._reader: CallObjectReader | None = None
        self._array_expect = ""  # in _read_array: "item or ]", "item" or ", or ]"
        self._out = ToolParserDelta()

    @staticmethod
    def default_call_id() -> str:
        return openai_call_id()

    @property
    def num_calls(self) -> int:
        """The calls sent so far (``finish_reason`` is ``tool_calls`` when there are any)."""
        return self._num_calls if self._max_calls is None else min(self._num_calls, self._max_calls)

    def feed(self, text: str) -> ToolParserDelta:
        """Reads the next piece of the answer; returns what became certain."""
        self._pending += text
        self._consume(final=False)
        return self._take()

    def finish(self) -> ToolParserDelta:
        """The end of the answer: everything still held back."""
        self._consume(final=True)
        self._out.content += self._space
        self._space = ""
        return self._take()

    def parse(self, text: str) -> ParsedToolCalls:
        """The whole answer at once, on a parser that has not been fed."""
        return assemble([self.feed(text), self.finish()])

    @abstractmethod
    def _consume(self, final: bool) -> None:
        """Reads ``self._pending`` as far as it can be; all of it when ``final``."""

    # The building blocks of the formats.

    def _content(self, text: str) -> None:
        if self._after_call and not self._wrote_content:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_call = False
        text = self._space + text
        body = text.rstrip(_WHITESPACE)
        self._space = text[len(body) :]
        self._out.content += body
        self._wrote_content = self._wrote_content or bool(body)

    def _hold(self, text: str) -> None:
        """Keeps separators for a sequence of calls not committed yet (else they go)."""
        if self._held:
            self._held += text

    def _reject(self) -> None:
        """What was held as a possible call is content after all."""
        held, self._held = self._held, ""
        self._reader = None
        self._content(held)

    def _start_call(self, name: str) -> None:
        self._held = ""
        self._space = ""
        self._in_call = True
        self._emitting = self._max_calls is None or self._num_calls < self._max_calls
        if self._emitting:
            call_id = self._new_call_id()
            self._out.tool_calls.append(ToolCallDelta(self._num_calls, "", call_id, name))
        self._num_calls += 1

    def _arguments(self, text: str) -> None:
        if not (text and self._emitting):
            return
        deltas = self._out.tool_calls
        index = self._num_calls - 1
        if deltas and deltas[-1].index == index:  # one entry per call (see ``joined``)
            deltas[-1] = replace(deltas[-1], arguments=deltas[-1].arguments + text)
        else:
            deltas.append(ToolCallDelta(index, text))

    def _end_call(self) -> None:
        self._in_call = False
        self._after_call = True

    def _begin_call_object(
        self, require_arguments: bool = False, only_call_keys: bool = False, bare: bool = False
    ) -> None:
        """``bare``: a call written without its format's markers, which only a declared
        tool's name makes a call (else the object is content)."""
        self._reader = CallObjectReader(
            self.argument_keys,
            require_arguments=require_arguments,
            only_call_keys=only_call_keys,
            names=self._tool_names if bare else None,
        )

    def _read_call(self, text: str, end_of_input: bool) -> tuple[int, ObjectOutcome]:
        """Feeds the call object being read; returns how much of ``text`` it took and
        whether the object is still open, was a call, or was not a call (its text
        then went out as content; the rest of ``text`` is the caller's)."""
        reader = self._reader
        assert reader is not None
        used = reader.read(text)
        if not self._in_call:
            self._held += text[:used]
            if reader.name is not None and (reader.has_arguments or reader.done):
                self._start_call(reader.name)
        if self._in_call:
            self._arguments(reader.take_arguments())
        if not (reader.done or reader.failed or end_of_input):
            return used, "open"
        if self._in_call:
            # A call broken off (the answer ended, or its JSON went wrong) is still
            # sent: its first delta is out already.
            self._reader = None
            self._end_call()
            return used, "call"
        self._reject()
        return used, "not a call"

    def _read_array(self, final: bool) -> bool:
        """Reads call objects in a JSON array whose ``[`` is read (set ``_array_expect``
        first); returns True once the array is over. If it ends any other way than with
        its ``]``, the rest of ``self._pending`` is the caller's, as content."""
        while True:
            if self._reader is not None:
                used, outcome = self._read_call(self._pending, end_of_input=final)
                self._pending = self._pending[used:]
                if outcome == "open":
                    return False
                if outcome == "not a call":
                    return True
                self._array_expect = ", or ]"
                continue
            stripped = self._pending.lstrip(_WHITESPACE)
            self._hold(self._pending[: len(self._pending) - len(stripped)])
            self._pending = stripped
            if not stripped:
                if final and self._held:
                    self._reject()
                return final
            char, expect = stripped[0], self._array_expect
            if char == "{" and expect in ("item or ]", "item"):
                self._begin_call_object()
            elif char == "," and expect == ", or ]":
                self._hold(",")
                self._pending = stripped[1:]
                self._array_expect = "item"
            elif char == "]" and expect in ("item or ]", ", or ]"):
                self._hold("]")
                self._pending = stripped[1:]
                if self._held:  # an empty array: no call after all
                    self._reject()
                return True
            else:
                if self._held:
                    self._reject()
                return True

    def _take(self) -> ToolParserDelta:
        out, self._out = self._out, ToolParserDelta()
        return out


def partial_marker_length(text: str, *markers: str) -> int:
    """The length of the longest end of ``text`` that some marker starts with (short of
    the whole marker): text that must wait for the next delta to be told apart."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest
