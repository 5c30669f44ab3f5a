"""Reasoning that a model writes before its answer, returned apart from it.

Qwen3 (and QwQ, DeepSeek-R1's distillations) think inside ``<think>...</think>``:
the model writes the opening tag itself, or the chat template writes it at the end of
the prompt (the model then only closes it), or, with Qwen3's ``enable_thinking=False``,
the prompt already holds an empty, closed block. So whether the answer starts inside
the reasoning is read from the prompt. The reasoning goes to ``reasoning_content``,
the rest to ``content``, as vLLM's ``qwen3`` reasoning parser returns them; an answer
cut off before ``</think>`` is all reasoning.

Newlines around the reasoning and at the start of the answer are dropped, as Qwen3's
template drops them when it renders the turn back into a later prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from server.tool_parsers.base import partial_marker_length

_START = "<think>"
_END = "</think>"
_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning_content: str = ""
    content: str = ""


@dataclass(frozen=True)
class ParsedReasoning:
    reasoning_content: str | None  # None when the answer has none
    content: str


class ReasoningParser(Protocol):
    """What splits one answer into reasoning and content (``server/reasoning_parsers.py``
    lists them): made for the answer's prompt, fed its text, finished once."""

    name: ClassVar[str]
    # The markers around the reasoning, for a grammar over the answer
    # (``server/answer_grammar.py``).
    start: ClassVar[str]
    end: ClassVar[str]

    def __init__(self, prompt: str) -> None: ...

    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...

    def parse(self, text: str) -> ParsedReasoning: ...


def prompt_opens_reasoning(prompt: str) -> bool:
    """The prompt ends inside a ``<think>`` block, so the answer starts with reasoning."""
    return prompt.rfind(_START) > prompt.rfind(_END)


class StreamingReasoningParser:
    """What every parser here does alike: text fed in pieces goes to ``_pending``, each
    piece's split (``_consume``, the parser's own) is gathered in ``_out`` and taken."""

    def __init__(self) -> None:
        self._pending = ""
        self._out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        self._pending += text
        self._consume(final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        self._consume(final=True)
        return self._take()

    def parse(self, text: str) -> ParsedReasoning:
        """The whole answer at once, on a parser that has not been fed."""
        deltas = [self.feed(text), self.finish()]
        reasoning = "".join(delta.reasoning_content for delta in deltas)
        return ParsedReasoning(reasoning or None, "".join(delta.content for delta in deltas))

    def _consume(self, final: bool) -> None:
        """Move what ``_pending`` holds, as far as it can be told, into ``_out``; all of it
        if ``final``."""
        raise NotImplementedError

    def _take(self) -> ReasoningDelta:
        out, self._out = self._out, ReasoningDelta()
        return out


class ThinkReasoningParser(StreamingReasoningParser):
    """Splits one answer into reasoning and content; one instance per answer."""

    name = "qwen3"
    start: ClassVar[str] = _START  # the markers around the reasoning
    end: ClassVar[str] = _END

    def __init__(self, prompt: str) -> None:
        super().__init__()
        # "start": the answer may still open with <think>.
        self._state: Literal["start", "reasoning", "content"] = (
            "reasoning" if prompt_opens_reasoning(prompt) else "start"
        )
        self._newlines = ""  # at the end of the reasoning so far: dropped if it ends there
        self._reasoning_began = False
        self._content_began = False

    def _consume(self, final: bool) -> None:
        pending = self._pending
        if self._state == "start":
            stripped = pending.lstrip(_WHITESPACE)
            if not final and _START.startswith(stripped):
                return  # all whitespace, or the start of <think>
            if stripped.startswith(_START):
                pending = stripped[len(_START) :]
                self._state = "reasoning"
            else:
                self._state = "content"
                self._content_began = True
        if self._state == "reasoning":
            end = pending.find(_END)
            if end < 0:
                keep = 0 if final else partial_marker_length(pending, _END)
                self._reasoning(pending[: len(pending) - keep])
                self._pending = pending[len(pending) - keep :]
                return
            self._reasoning(pending[:end])
            self._newlines = ""
            pending = pending[end + len(_END) :]
            self._state = "content"
        if not self._content_began:
            pending = pending.lstrip("\n")
            self._content_began = bool(pending)
        self._out.content += pending
        self._pending = ""

    def _reasoning(self, text: str) -> None:
        if not self._reasoning_began:
            text = text.lstrip("\n")
            if not text:
                return
            self._reasoning_began = True
        text = self._newlines + text
        body = text.rstrip("\n")
        self._newlines = text[len(body) :]
        self._out.reasoning_content += body
