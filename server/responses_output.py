"""The Responses API's answer: the ``response`` object, whole (``ResponseObject.final``) or
built up by the events of its stream (``ResponseEvents``), as OpenAI writes them.

A response's output is one assistant message holding one ``output_text`` part. It is
``completed``, or ``incomplete`` (``max_output_tokens``) when the length ran out. The
usage's cache and reasoning token counts are 0: the engine does not report the first per
request, and the models served here do not reason.
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

from protocol import FinishReason, TokenLogprobs
from server.answer import Answer
from server.errors import ApiError
from server.generation import TextDelta
from server.logprobs import chat_logprobs
from server.responses_schemas import ResponsesRequest
from server.served_model import ServedModel
from server.sse import event


class ResponseObject:
    """One response's ``response`` object, at each stage of its life."""

    def __init__(self, answer: Answer, request: ResponsesRequest, model: ServedModel) -> None:
        self.answer = answer
        self._request = request
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._logprobs = partial(chat_logprobs, model) if request.wants_logprobs else None

    @property
    def message_id(self) -> str:
        return self._message_id

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
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "store": False,  # nothing is stored, whatever the request said
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": [],
            "top_logprobs": request.top_logprobs or 0,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": "disabled",
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

    def final(self, whole: TextDelta) -> dict[str, Any]:
        """The finished response, from its one choice whole."""
        status = _status(whole.finish_reason)
        part = self.output_text(whole.text, whole.token_ids, whole.logprobs)
        return self.body(status, [self.message(status, [part])], whole.completion_tokens)


class ResponseEvents:
    """The events of a streamed response (server/streaming.py's ``StreamEvents``): each is
    an SSE event named by its type, numbered in order; no [DONE] ends them."""

    def __init__(self, response: ResponseObject) -> None:
        self.answer = response.answer
        self._response = response
        self._sequence_number = 0
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._finish_reason: str | None = None

    def start(self) -> list[str]:
        in_progress = self._response.body("in_progress", [])
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._response.message("in_progress", []),
            ),
            self._event("response.content_part.added", **self._part_place(), part=self._part()),
        ]

    def render(self, index: int, delta: TextDelta) -> list[str]:
        self._text.append(delta.text)
        self._token_ids += delta.token_ids
        self._logprobs += delta.logprobs
        self._finish_reason = delta.finish_reason
        if not (delta.text or delta.token_ids):
            return []
        logprobs = self._response.logprobs(delta.token_ids, delta.logprobs)
        return [
            self._event(
                "response.output_text.delta",
                **self._part_place(),
                delta=delta.text,
                logprobs=logprobs,
            )
        ]

    def finish(self, completion_tokens: int) -> list[str]:
        status = _status(self._finish_reason)
        part = self._part()
        message = self._response.message(status, [part])
        response = self._response.body(status, [message], completion_tokens)
        return [
            self._event(
                "response.output_text.done",
                **self._part_place(),
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self._event("response.content_part.done", **self._part_place(), part=part),
            self._event("response.output_item.done", output_index=0, item=message),
            self._event(f"response.{status}", response=response),
        ]

    def error(self, error: ApiError) -> list[str]:
        failed = self._response.body("failed", [])
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]

    def end(self) -> list[str]:
        return []

    def _part(self) -> dict[str, Any]:
        return self._response.output_text("".join(self._text), self._token_ids, self._logprobs)

    def _part_place(self) -> dict[str, Any]:
        return {"item_id": self._response.message_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event(data, kind)


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
