"""A chat request's tools: the constraint its ``tool_choice`` puts on the output, and how
each of its answers is read (``ChatParsing``: reasoning, content, tool calls).

"auto" lets the model write calls in its own format, read by the served model's tool-call
parser; "required" and a named function hold the output to JSON (``tool_choice_schema``),
enforced by the engine as a structured output, and read by the parsers of that JSON. A
chat template that cannot show tools gets them in plain messages instead
(server/generic_tool_prompt.py), so that forced calls work with any model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from protocol import StructuredOutput, StructuredOutputKind
from server.chat_output import ChatOutputParser, chat_finish_reason
from server.errors import ApiError
from server.generic_tool_prompt import GenericToolPrompt
from server.openai_schemas import ChatCompletionRequest, ChatMessage, Tool
from server.reasoning_parsers import REASONING_PARSERS
from server.served_model import ServedModel
from server.tool_parsers import (
    TOOL_PARSERS,
    CallArrayParser,
    NamedFunctionParser,
    ToolChoiceError,
    ToolParser,
    tool_choice_schema,
)


@dataclass(frozen=True)
class PromptTools:
    """How a request's tools reach the prompt: given to a chat template that shows them,
    or else in plain messages (server/generic_tool_prompt.py)."""

    template_tools: list[dict[str, Any]] | None  # for the chat template
    generic_prompt: GenericToolPrompt | None = None  # the template cannot show the tools

    def messages(self, messages: list[ChatMessage]) -> list[ChatMessage]:
        """The messages the chat template renders."""
        return messages if self.generic_prompt is None else self.generic_prompt.messages(messages)


def prompt_tools(
    model: ServedModel,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any = "none",
    parallel_tool_calls: bool = True,
) -> PromptTools:
    """``tools`` (OpenAI tool dicts) for the prompt; a forced ``tool_choice`` ("required",
    a named function) describes them in a system message where the template cannot
    show them."""
    if not tools or (model.chat_template and model.chat_template.supports_tools):
        return PromptTools(tools)
    if tool_choice in ("auto", "none"):
        return PromptTools(None, GenericToolPrompt(tools))
    return PromptTools(None, GenericToolPrompt.forcing(tools, tool_choice, parallel_tool_calls))


def declared_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The request's tools as OpenAI tool dicts, as it gave them."""
    return None if tools is None else [tool.model_dump(exclude_unset=True) for tool in tools]


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools and ``tool_choice`` ask of its prompt and its answers."""

    prompt: PromptTools
    constraint: StructuredOutput | None  # the output's JSON schema ("required", named)
    parser: Callable[[], ToolParser] | None  # a new tool-call parser for each answer
    named: bool = False  # a named function: OpenAI's finish reason stays "stop"


def tool_use(model: ServedModel, body: ChatCompletionRequest) -> ToolUse:
    """The request's tools, checked against the model's template and parser; ApiError (400)
    for a ``tool_choice`` that cannot be honoured."""
    choice = body.tool_choice
    if choice is None or (choice == "auto" and not body.tools):
        # Clients send "auto" without tools; with no tools there is nothing to call.
        choice = "auto" if body.tools else "none"
    tools = declared_tools(body.tools)
    prompt = prompt_tools(model, tools, choice, body.parallel_tool_calls)
    if choice == "none":
        return ToolUse(prompt, None, None)
    if not tools:
        raise ApiError(400, "tool_choice needs tools.", param="tool_choice")
    try:
        schema = tool_choice_schema(tools, choice, body.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise ApiError(400, f"Invalid 'tool_choice': {exc}.", param="tool_choice") from exc
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "auto":
        if model.tool_parser is None:
            # As vLLM: "auto" reads calls in the model's own format, which needs a parser
            # (vLLM's --tool-call-parser); the markers of a template that shows no tools
            # name none, and the generic prompt teaches no format to read.
            raise ApiError(
                400,
                'tool_choice "auto" needs a tool-call parser, and none is known for this '
                "model's chat template (start the server with --tool-call-parser, or with "
                '--chat-template to use one that shows tools); "required" and a named '
                "function work with any template.",
                param="tool_choice",
            )
        names = frozenset(tool["function"]["name"] for tool in tools)
        parser = partial(TOOL_PARSERS[model.tool_parser], max_calls=max_calls, tool_names=names)
        return ToolUse(prompt, None, parser)
    assert schema is not None
    constraint = StructuredOutput(kind=StructuredOutputKind.JSON_SCHEMA, spec=json.dumps(schema))
    if choice == "required":
        parser = partial(CallArrayParser, max_calls=max_calls)
        return ToolUse(prompt, constraint, parser)
    assert isinstance(choice, dict)
    named = partial(NamedFunctionParser, choice["function"]["name"])
    return ToolUse(prompt, constraint, named, named=True)


@dataclass(frozen=True)
class ChatParsing:
    """How each answer of one chat request splits into reasoning, content and tool calls."""

    prompt: str  # whether the answer starts inside reasoning is read from the prompt
    reasoning_parser: str | None
    tools: ToolUse
    include_reasoning: bool = True  # false: the reasoning is left out of the answers

    @property
    def keeps_special_tokens(self) -> bool:
        """Markers such as [TOOL_CALLS] are special tokens: a parser must see their text."""
        return self.reasoning_parser is not None or self.tools.parser is not None

    def parser(self) -> ChatOutputParser:
        """A parser for one answer (each choice has its own)."""
        reasoning = self.reasoning_parser
        return ChatOutputParser(
            REASONING_PARSERS[reasoning](self.prompt) if reasoning is not None else None,
            self.tools.parser() if self.tools.parser is not None else None,
            self.include_reasoning,
        )

    def finish_reason(self, engine_finish_reason: str, called_tools: bool) -> str:
        if self.tools.named:
            return engine_finish_reason  # OpenAI answers a forced function with "stop"
        return chat_finish_reason(engine_finish_reason, called_tools)
