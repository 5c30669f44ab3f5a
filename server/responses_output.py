"""The Responses API's answer: the ``response`` object, whole (``ResponseObject.final``) or
built up by the events of its stream (``ResponseEvents``), as OpenAI writes them.

A response's output is its reasoning (a ``reasoning`` item, when a reasoning parser
reads the answer), its text (an assistant message holding one ``output_text`` part; an
empty one when the answer is nothing else) and its tool calls (``function_call`` items),
in that order. It is ``completed``, or ``incomplete`` (``max_output_tokens``) when the
length ran out. The usage's cache and reasoning token counts are 0: the engine does not
report the first per request, nor which tokens were reasoning.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from protocol import FinishReason, TokenLogprobs
from server.answer import Answer
from server.errors import ApiError
from server.generation import TextDelta
from server.logprobs import chat_logprobs
from server.responses_schemas import ResponsesRequest
from server.served_model import ServedModel
from server.sse import event
from server.tool_calling import ChatParsing
from server.tool_parsers import ToolCall, ToolCallDelta


class ResponseObject:
    """One response's ``response`` object, at each stage of its life."""

    def __init__(
        self,
        answer: Answer,
        request: ResponsesRequest,
        model: ServedModel,
        parsing: ChatParsing,
        store: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """``store``, if given, keeps the finished response object (server/response_store.py)."""
        self.answer = answer
        self._store = store
        self.parsing = parsing  # how the answer splits into reasoning, text and calls
        self._request = request
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._logprobs = partial(chat_logprobs, model) if request.wants_logprobs else None

    @property
    def message_id(self) -> str:
        return self._message_id

    @property
    def reasoning_id(self) -> str:
        return self._reasoning_id

    def body(
        self, status: str, output: list[dict[str, Any]], completion_tokens: int | None = None
    ) -> dict[str, Any]:
        """The response object; its usage once ``completion_tokens`` are known."""
        request = self._request
        prompt_tokens = self.answer.prompt_tokens
        usage = None
        if completion_tokens is not None:
            usage = {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt_tokens + completion_tokens,
            }
        text_format = request.text.format if request.text and request.text.format else None
        return {
            "id": self.answer.id,
            "object": "response",
            "created_at": self.answer.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": request.max_tool_calls,
            "model": self.answer.model,
            "output": output,
            "parallel_tool_calls": (
                True if request.parallel_tool_calls is None else request.parallel_tool_calls
            ),
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning,
            "service_tier": "default",
            "store": self._store is not None,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": request.tools,
            "top_logprobs": request.top_logprobs or 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": request.truncation,
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def output_text(
        self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs]
    ) -> dict[str, Any]:
        """The message's ``output_text`` part."""
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": self.logprobs(token_ids, logprobs),
        }

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[Any]:
        """The tokens' log-probabilities, as the chat API lists them; none if not asked."""
        return [] if self._logprobs is None else self._logprobs(token_ids, logprobs)["content"]

    def message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def reasoning(self, status: str, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self._reasoning_id,
            "status": status,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None,  # no key here (server/responses_schemas.py)
        }

    def final(self, whole: TextDelta) -> dict[str, Any]:
        """The finished response, from its one choice whole."""
        status = _status(whole.finish_reason)
        output = self.parsing.parser().parse(whole.text)
        items = []
        if output.reasoning_content is not None:
            items.append(self.reasoning("completed", output.reasoning_content))
        # As the stream makes it: an empty message only when the answer is nothing else.
        if output.content is not None or not (items or output.tool_calls):
            part = self.output_text(output.content or "", whole.token_ids, whole.logprobs)
            items.append(self.message(status, [part]))
        items += [function_call(call, "completed") for call in output.tool_calls]
        return self.done(status, items, whole.completion_tokens)

    def done(
        self, status: str, output: list[dict[str, Any]], completion_tokens: int
    ) -> dict[str, Any]:
        """The finished response object (whole, or the last event's of its stream), kept
        if it is stored."""
        body = self.body(status, output, completion_tokens)
        if self._store is not None:
            self._store(body)
        return body


def function_call(call: ToolCall, status: str) -> dict[str, Any]:
    """A ``function_call`` output item; its id is the call's, as ``fc_...``."""
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class ResponseEvents:
    """The events of a streamed response (server/streaming.py's ``StreamEvents``): each is
    an SSE event named by its type, numbered in order; no [DONE] ends them.

    Output items open as the answer reaches them (its reasoning, its text, each tool
    call). The reasoning and each tool call are done when the next of them opens or the
    answer ends; the message stays open until the answer ends, so that it holds all the
    answer's text and tokens, as the whole response's message does, also text that comes
    after a tool call (in the same engine step as the call's last arguments, or later)."""

    def __init__(self, response: ResponseObject) -> None:
        self.answer = response.answer
        self._response = response
        self._parser = response.parsing.parser()
        self._sequence_number = 0
        # The output items added, in order; the message's is its in-progress item until the
        # answer ends.
        self._items: list[dict[str, Any]] = []
        self._open: Literal["reasoning", "function_call"] | None = None  # its item is last
        self._message_index: int | None = None  # the message's place, once added
        self._reasoning: list[str] = []
        self._text: list[str] = []
        self._call: ToolCall | None = None  # the open function call, its arguments so far
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._unsent = 0  # tokens at the end of _token_ids whose logprobs no delta carried
        self._finish_reason: str | None = None

    def start(self) -> list[str]:
        in_progress = self._response.body("in_progress", [])
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def render(self, index: int, delta: TextDelta) -> list[str]:
        self._token_ids += delta.token_ids
        self._logprobs += delta.logprobs
        self._unsent += len(delta.token_ids)
        self._finish_reason = delta.finish_reason
        split = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            split.extend(self._parser.finish())
        events = []
        if split.reasoning_content:
            events += self._open_reasoning()
            self._reasoning.append(split.reasoning_content)
            delta_event = "response.reasoning_text.delta"
            events.append(
                self._event(delta_event, **self._reasoning_place(), delta=split.reasoning_content)
            )
        calls = split.tool_calls
        # The open call's last arguments come before any text after it in the answer: they
        # go to that call before a message the text opens closes it.
        continuing = 0
        while continuing < len(calls) and calls[continuing].id is None:
            continuing += 1
        events += self._call_arguments(calls[:continuing])
        if split.content:
            events += self._open_message()
            self._text.append(split.content)
            events.append(self._text_delta(split.content))
        events += self._call_arguments(calls[continuing:])
        if not events and self._message_open() and delta.token_ids:
            events.append(self._text_delta(""))  # tokens held back: their logprobs go now
        return events

    def _call_arguments(self, calls: list[ToolCallDelta]) -> list[str]:
        """The events of tool-call pieces: a new call's item, its arguments' deltas."""
        events = []
        for call in calls:
            if call.id is not None:
                assert call.name is not None
                events += self._close()
                self._call = ToolCall(call.id, call.name, "")
                events += self._add("function_call", function_call(self._call, "in_progress"))
            assert self._call is not None
            if call.arguments:
                self._call = ToolCall(
                    self._call.id, self._call.name, self._call.arguments + call.arguments
                )
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=function_call(self._call, "")["id"],
                        output_index=len(self._items) - 1,
                        delta=call.arguments,
                    )
                )
        return events

    def finish(self, completion_tokens: int) -> list[str]:
        status = _status(self._finish_reason)
        events = []
        if not self._items:
            events += self._open_message()  # an empty answer: an empty message
        events += self._close()
        if self._message_open():
            part = self._part()
            item = self._response.message(status, [part])
            self._items[self._message_index] = item
            events += [
                self._event(
                    "response.output_text.done",
                    **self._part_place(),
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self._event("response.content_part.done", **self._part_place(), part=part),
                self._event(
                    "response.output_item.done", output_index=self._message_index, item=item
                ),
            ]
        response = self._response.done(status, self._items, completion_tokens)
        return [*events, self._event(f"response.{status}", response=response)]

    def error(self, error: ApiError) -> list[str]:
        failed = self._response.body("failed", [])
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]

    def end(self) -> list[str]:
        return []

    def _message_open(self) -> bool:
        return self._message_index is not None

    def _open_message(self) -> list[str]:
        """Adds the message, once: it stays open until the answer ends."""
        if self._message_open():
            return []
        events = self._close()
        self._message_index = len(self._items)
        events += self._add("message", self._response.message("in_progress", []))
        events.append(
            self._event("response.content_part.added", **self._part_place(), part=self._part())
        )
        return events

    def _open_reasoning(self) -> list[str]:
        """Opens the reasoning item unless it is open."""
        if self._open == "reasoning":
            return []
        events = self._close()
        return events + self._add("reasoning", self._response.reasoning("in_progress", ""))

    def _add(
        self, kind: Literal["reasoning", "message", "function_call"], item: dict[str, Any]
    ) -> list[str]:
        """Adds ``item``, in progress, as the last output item."""
        self._open = None if kind == "message" else kind
        self._items.append(item)
        added = self._event(
            "response.output_item.added", output_index=len(self._items) - 1, item=item
        )
        return [added]

    def _close(self) -> list[str]:
        """The events that end the open reasoning or function call, if any (the last item)."""
        kind, self._open = self._open, None
        output_index = len(self._items) - 1
        if kind == "reasoning":
            text = "".join(self._reasoning)
            item = self._response.reasoning("completed", text)
            events = [
                self._event("response.reasoning_text.done", **self._reasoning_place(), text=text)
            ]
        elif kind == "function_call":
            assert self._call is not None
            item = function_call(self._call, "completed")
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=output_index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        else:
            return []
        self._items[output_index] = item
        return [
            *events,
            self._event("response.output_item.done", output_index=output_index, item=item),
        ]

    def _text_delta(self, text: str) -> str:
        sent = len(self._token_ids) - self._unsent
        self._unsent = 0
        logprobs = self._response.logprobs(self._token_ids[sent:], self._logprobs[sent:])
        return self._event(
            "response.output_text.delta", **self._part_place(), delta=text, logprobs=logprobs
        )

    def _part(self) -> dict[str, Any]:
        return self._response.output_text("".join(self._text), self._token_ids, self._logprobs)

    def _part_place(self) -> dict[str, Any]:
        return {
            "item_id": self._response.message_id,
            "output_index": self._message_index,
            "content_index": 0,
        }

    def _reasoning_place(self) -> dict[str, Any]:
        return {
            "item_id": self._response.reasoning_id,
            "output_index": len(self._items) - 1,
            "content_index": 0,
        }

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event(data, kind)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
