"""Tools for a chat template that cannot show them: the conversation rewritten in plain
messages, as llama.cpp does for any model.

A template shows tools when it reads its ``tools`` variable; most of those that do not
cannot show tool calls or results either (an assistant message with ``content: null``
and ``tool_calls`` can even make them fail). So, for such a template:

- the assistant's tool calls become its message's text, a JSON array of
  ``{"name": ..., "arguments": {...}}`` (after its content, if any);
- tool results become a user message (one for a run of them), each result a JSON object
  naming its call;
- when the request forces a call (``tool_choice`` "required" or a named function), a
  system message lists the tools as JSON schemas and says what to answer: the grammar
  of that ``tool_choice`` holds the answer to it, so the model only has to know what
  its arguments mean. It goes before the first system message's text, or is the first
  message.

With ``tool_choice`` "auto" or "none" the tools are not described: the answer is free
text, so "auto" needs a parser of a format the model was taught, which this prompt does
not teach (see server/tool_calling.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from server.errors import ApiError
from server.openai_schemas import ChatMessage


@dataclass(frozen=True)
class GenericToolPrompt:
    tools: list[dict[str, Any]]  # OpenAI tool dicts, as the request gave them
    # What the answer must be, when a call is forced; None: the tools are not described.
    instruction: str | None = None

    @classmethod
    def forcing(
        cls, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool
    ) -> GenericToolPrompt:
        """The prompt of a forced call: "required", or a named function (a dict)."""
        if tool_choice == "required":
            calls = "a JSON array of calls" if parallel_tool_calls else "a JSON array of one call"
            instruction = (
                f"Call the functions now: answer with only {calls}, each written as "
                '{"name": <function-name>, "arguments": <arguments-json-object>}.'
            )
        else:
            name = tool_choice["function"]["name"]
            instruction = (
                f"Call the function {name} now: answer with only its arguments, as a JSON "
                "object that follows its parameters' schema."
            )
        return cls(tools, instruction)

    def messages(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        """``messages`` as plain messages that any chat template can show."""
        rewritten = list(_plain_messages(messages))
        if self.instruction is None:
            return rewritten
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in self.tools)
        system = (
            "# Tools\n\nYou can call functions. Their signatures, as JSON schemas, are "
            f"between <tools> and </tools>:\n<tools>\n{listed}\n</tools>\n\n{self.instruction}"
        )
        if rewritten and rewritten[0].role == "system":
            first = rewritten[0]
            first = first.model_copy(update={"content": _prepended(system, first.content)})
            return [first, *rewritten[1:]]
        return [ChatMessage(role="system", content=system), *rewritten]


def _plain_messages(messages: Sequence[ChatMessage]) -> Iterator[ChatMessage]:
    names: dict[str, str] = {}  # call ids to their functions' names, for their results
    results: list[str] = []  # a run of tool results, written as one user message
    for message in messages:
        if message.role == "tool":
            call_id = getattr(message, "tool_call_id", None)
            result = {
                "tool_call_id": call_id,
                "name": names.get(call_id) if isinstance(call_id, str) else None,
                "content": _text(message.content),
            }
            results.append(json.dumps({"tool_response": result}, ensure_ascii=False))
            continue
        if results:
            yield ChatMessage(role="user", content="\n".join(results))
            results = []
        calls = getattr(message, "tool_calls", None)
        if message.role != "assistant" or not calls:
            yield message
            continue
        if not isinstance(calls, list):
            raise ApiError(
                400, "an assistant message's tool_calls must be a list", param="messages"
            )
        written = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                raise ApiError(400, "each tool call needs a function with a name", param="messages")
            call_id = call.get("id", "")
            if not isinstance(call_id, str):
                raise ApiError(400, "a tool call's id must be a string", param="messages")
            names[call_id] = function["name"]
            written.append({"name": function["name"], "arguments": _arguments(function)})
        text = json.dumps(written, ensure_ascii=False)
        content = _text(message.content)
        yield ChatMessage(role="assistant", content=f"{content}\n{text}" if content else text)
    if results:
        yield ChatMessage(role="user", content="\n".join(results))


def _arguments(function: dict[str, Any]) -> Any:
    """A call's arguments as a JSON value: clients send them as JSON text."""
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return arguments if arguments is not None else {}
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return arguments  # not JSON: shown as the text it is


def _text(content: str | list[dict[str, str]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part["text"] for part in content)


def _prepended(text: str, content: str | list[dict[str, str]] | None) -> Any:
    if not content:
        return text
    if isinstance(content, str):
        return f"{text}\n\n{content}"
    return [{"type": "text", "text": f"{text}\n\n"}, *content]
