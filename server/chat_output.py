"""A chat answer's text split into reasoning, content and tool calls, streamed or not.

The reasoning parser (if the model thinks) reads the raw text first; what it passes
on as content goes through the tool-call parser (if the request has tools). The
non-streamed ``parse`` feeds the same machine the whole text, so a streamed answer
assembles to exactly the non-streamed message.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from server.reasoning import ReasoningParser
from server.tool_parsers.base import (
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolParserDelta,
    assemble,
    joined,
)


@dataclass
class ChatDelta:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)

    def extend(self, later: ChatDelta) -> None:
        """Appends what came after this delta, keeping one tool-call entry per call."""
        self.reasoning_content += later.reasoning_content
        self.content += later.content
        self.tool_calls = joined([*self.tool_calls, *later.tool_calls])


@dataclass(frozen=True)
class ChatOutput:
    # None rather than "" beside tool calls or reasoning, as OpenAI and vLLM send it.
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]

    def message(self) -> dict[str, Any]:
        """The assistant message of a non-streamed choice."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


def chat_finish_reason(engine_finish_reason: str, called_tools: bool) -> str:
    """OpenAI's ``tool_calls`` for an answer that stopped after calling tools."""
    return "tool_calls" if called_tools and engine_finish_reason == "stop" else engine_finish_reason


def assemble_chat(deltas: Iterable[ChatDelta]) -> ChatOutput:
    """What a client that joins the streamed deltas ends up with."""
    deltas = list(deltas)
    reasoning = "".join(delta.reasoning_content for delta in deltas) or None
    calls = assemble(ToolParserDelta(delta.content, delta.tool_calls) for delta in deltas)
    content = calls.content or ""
    if not content and (calls.tool_calls or reasoning):
        return ChatOutput(None, reasoning, calls.tool_calls)
    return ChatOutput(content, reasoning, calls.tool_calls)


class ChatOutputParser:
    """One answer's text deltas in, chat deltas out; one instance per answer."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolParser | None = None,
        include_reasoning: bool = True,
    ) -> None:
        """``include_reasoning`` false (vLLM's field) drops the reasoning from the answer."""
        self._reasoning = reasoning
        self._tools = tools
        self._include_reasoning = include_reasoning

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        delta = self._content(split.content, final=False)
        if self._include_reasoning:
            delta.reasoning_content = split.reasoning_content
        return delta

    def finish(self) -> ChatDelta:
        if self._reasoning is None:
            return self._content("", final=True)
        split = self._reasoning.finish()
        delta = self._content(split.content, final=True)
        if self._include_reasoning:
            delta.reasoning_content = split.reasoning_content
        return delta

    def parse(self, text: str) -> ChatOutput:
        """The whole answer at once, on a parser that has not been fed."""
        return assemble_chat([self.feed(text), self.finish()])

    def _content(self, text: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content=text)
        parsed = self._tools.feed(text)
        if final:
            last = self._tools.finish()
            parsed.content += last.content
            parsed.tool_calls = joined([*parsed.tool_calls, *last.tool_calls])
        return ChatDelta(content=parsed.content, tool_calls=parsed.tool_calls)
