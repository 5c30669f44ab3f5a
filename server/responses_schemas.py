"""The request body of OpenAI's Responses API (POST /v1/responses), and the chat request
it maps to.

A response is generated as a chat completion is: ``ResponsesRequest.chat_request`` turns
the instructions and input items into chat messages and the sampling fields into the chat
ones, and the chat endpoint's preparation (server/prompts.py, ``chat_generation``) takes it
from there. What the chat endpoint learns to do, the Responses API gets by extending that
map: function ``tools``, ``tool_choice`` and ``parallel_tool_calls`` map to the chat ones,
``function_call`` and ``function_call_output`` input items to an assistant message's
``tool_calls`` and ``tool`` messages, and ``text.format`` (json_schema, json_object) to
a structured output (``structured_output``). The sampling fields vLLM's Responses API adds
(``SamplingFields``: top_k, seed, stop, repetition_penalty, structured_outputs, ...) are
the chat request's own, passed on as they are.

A response is stored (``store``, true by default as OpenAI's) in the server that answered
it, for a while (server/response_store.py): ``previous_response_id`` goes on from its
conversation there. What needs more (``conversation``, ``background``) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from protocol import MAX_TOP_LOGPROBS, StructuredOutput
from server.errors import ApiError
from server.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    Int64,
    RequestBody,
    SamplingFields,
    Tool,
)
from server.structured_output import structured_output_of

# The input roles, as chat templates know them: a developer message is a system one.
_CHAT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Accepted as vLLM accepts it: reasoning items carry no encrypted content (null), since
# this server holds no key; a client sending the reasoning back has it in the item's text.
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
_INCLUDES = (LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE)


def output_messages(output: list[dict[str, Any]]) -> list[ChatMessage]:
    """A response's output items as the chat messages a next turn reads: its text and its
    calls (its reasoning left out, as chat templates leave earlier turns' out)."""
    items = [item for item in output if item["type"] != "reasoning"]
    return (
        [ChatMessage.model_validate(message) for message in _input_messages(items)] if items else []
    )


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; a list holds messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "invalid_type", "input must be a string or a non-empty list of input items"
        )
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        message = _input_message(f"input[{index}]", item)
        previous = messages[-1] if messages else None
        if "tool_calls" in message and previous is not None and previous.get("tool_calls"):
            previous["tool_calls"] += message["tool_calls"]  # parallel calls: one message
        else:
            messages.append(message)
    return messages


def _input_message(where: str, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise PydanticCustomError("invalid_type", "{where} must be an object", {"where": where})
    kind = item.get("type", "message")
    if kind == "function_call":
        return _function_call(where, item)
    if kind == "function_call_output":
        return _function_call_output(where, item)
    if kind != "message":
        raise PydanticCustomError(
            "unsupported_parameter",
            "{where}: input items of type '{kind}' are not supported yet",
            {"where": where, "kind": str(kind)},
        )
    role = item.get("role")
    if not isinstance(role, str) or role not in _CHAT_ROLES:  # a dict or list is unhashable
        raise PydanticCustomError(
            "invalid_value",
            "{where}.role must be one of user, assistant, system and developer",
            {"where": where},
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _CHAT_ROLES[role], "content": content}
    if not isinstance(content, list):
        raise PydanticCustomError(
            "invalid_type", "{where}.content must be a string or a list of parts", {"where": where}
        )
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise PydanticCustomError(
                "unsupported_parameter",
                "{where}: content parts of type '{kind}' are not supported yet; "
                "only input_text and output_text are",
                {"where": where, "kind": str(kind)},
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError(
                "invalid_type", "{where}: a text part needs a string 'text'", {"where": where}
            )
        parts.append({"type": "text", "text": part["text"]})  # the chat API's text part
    return {"role": _CHAT_ROLES[role], "content": parts}


def _function_call(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """An earlier answer's call, as the assistant message that made it."""
    fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
    if not all(isinstance(value, str) for value in fields.values()):
        raise PydanticCustomError(
            "invalid_type",
            "{where}: a function_call needs string call_id, name and arguments",
            {"where": where},
        )
    call = {
        "id": fields["call_id"],
        "type": "function",
        "function": {"name": fields["name"], "arguments": fields["arguments"]},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _function_call_output(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A call's result, as the ``tool`` message that answers it."""
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
        raise PydanticCustomError(
            "invalid_type",
            "{where}: a function_call_output needs string call_id and output",
            {"where": where},
        )
    return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}


def _text_format(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if value is not None and kind not in ("text", "json_schema", "json_object"):
        raise PydanticCustomError(
            "invalid_value", "text.format.type must be text, json_schema or json_object"
        )
    return value


def _tools(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type", "tools must be a list")
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            if not isinstance(tool.get("name"), str):
                raise PydanticCustomError("invalid_type", "a function tool needs a string name")
            try:  # as the chat request made from this one will take it
                Tool.model_validate(_chat_tool(tool))
            except ValidationError as exc:
                error = exc.errors()[0]
                field = ".".join(str(part) for part in error["loc"][1:])
                raise PydanticCustomError(
                    "invalid_value",
                    "tools[{index}].{field}: {message}",
                    {"index": index, "field": field, "message": error["msg"]},
                ) from None
            continue
        raise PydanticCustomError(
            "unsupported_parameter",
            "tools of type '{kind}' are not supported: this server runs no built-in tools",
            {"kind": str(kind)},
        )
    return value


def _tool_choice(value: Any) -> Any:
    """none, auto, required, or ``{"type": "function", "name": ...}``."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("name"), str)
    ):
        return {"type": "function", "name": value["name"]}
    raise PydanticCustomError(
        "invalid_value",
        'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
    )


def _include(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise PydanticCustomError("invalid_type", "include must be a list of strings")
    for item in value:
        if item not in _INCLUDES:
            raise PydanticCustomError(
                "unsupported_parameter",
                "include '{item}' is not supported; only {served} are",
                {"item": item, "served": " and ".join(f"'{served}'" for served in _INCLUDES)},
            )
    return value


_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning(value: Any) -> Any:
    """OpenAI's reasoning object: its ``effort`` goes to the chat template, as vLLM gives it;
    a summary is not served (clients may send the object with nothing set in it)."""
    if value is None:
        return value
    if not isinstance(value, dict) or value.get("effort") not in (None, *_REASONING_EFFORTS):
        efforts = ", ".join(_REASONING_EFFORTS)
        raise PydanticCustomError(
            "invalid_value", "reasoning.effort must be one of {efforts}", {"efforts": efforts}
        )
    if any(setting for key, setting in value.items() if key != "effort"):
        raise PydanticCustomError("unsupported_parameter", "reasoning summaries are not supported")
    return value


def _refused(reason: str, *neutral: Any) -> BeforeValidator:
    """A validator that refuses any value but null and ``neutral`` ones, saying ``reason``."""

    def check(value: Any) -> Any:
        if value is not None and value not in neutral:
            raise PydanticCustomError("unsupported_parameter", reason)
        return value

    return BeforeValidator(check)


class ResponseText(RequestBody):
    format: Annotated[Any, BeforeValidator(_text_format)] = None
    verbosity: Annotated[
        Any, _refused("verbosity other than medium is not supported", "medium")
    ] = None


class ResponsesRequest(SamplingFields):
    """The sampling fields it shares with chat (``SamplingFields``: vLLM's ResponsesRequest
    takes those) go to the chat request as they are."""

    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        # vLLM's own fields
        "vllm_xargs": (),
        "enable_response_messages": (False,),
        "previous_input_messages": (),
        "request_id": (),  # the X-Request-Id header names a request (server/request_id.py)
        "cache_salt": (),
        "mm_processor_kwargs": (),
    }

    model: str | None = None
    # vLLM's: lower runs earlier, on an engine with --scheduling-policy priority.
    priority: Int64 = 0
    input: Annotated[list[ChatMessage], BeforeValidator(_input_messages)]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Annotated[int | None, Field(ge=1)] = None
    stream: bool = False
    include: Annotated[list[str], BeforeValidator(_include)] = Field(default_factory=list)
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    text: ResponseText | None = None
    tools: Annotated[list[Any], BeforeValidator(_tools)] = Field(default_factory=list)
    tool_choice: Annotated[Any, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int | None, Field(ge=1)] = None
    # Informational: echoed in the response, changing nothing.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    store: bool = True  # kept by this server for a while (see the module's docstring)
    previous_response_id: str | None = None  # go on from this stored response's conversation
    conversation: Annotated[
        Any, _refused("conversation is not supported: this server stores no conversations")
    ] = None
    background: Annotated[
        Any, _refused("background is not supported: this server stores no responses", False)
    ] = None
    prompt: Annotated[Any, _refused("prompt templates are not supported")] = None
    # auto: the oldest input items are dropped until the prompt fits the context
    # (server/routes/responses.py); disabled (OpenAI's default): a 400 instead.
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Annotated[Any, BeforeValidator(_reasoning)] = None

    @model_validator(mode="after")
    def _logprobs_need_include(self) -> ResponsesRequest:
        # ApiError, not a validation error: it names the field (pydantic lets it through).
        if self.top_logprobs and not self.wants_logprobs:
            raise ApiError(
                400,
                f"top_logprobs requires include: ['{LOGPROBS_INCLUDE}'].",
                param="top_logprobs",
            )
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in self.include

    def chat_request(self, history: list[ChatMessage] | None = None) -> ChatCompletionRequest:
        """The chat completion request that generates this response after ``history`` (a
        previous response's conversation; its instructions are not carried over, as
        OpenAI's)."""
        instructions = (
            [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        )
        return _ChatForResponses(
            model=self.model,
            messages=instructions + (history or []) + self.input,
            max_completion_tokens=self.max_output_tokens,
            **{name: getattr(self, name) for name in SamplingFields.model_fields},
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs if self.wants_logprobs else None,
            stream=self.stream,
            tools=[_chat_tool(tool) for tool in self.tools] or None,
            tool_choice=(
                {"type": "function", "function": {"name": self.tool_choice["name"]}}
                if isinstance(self.tool_choice, dict)
                else self.tool_choice
            ),
            parallel_tool_calls=(
                True if self.parallel_tool_calls is None else self.parallel_tool_calls
            ),
            reasoning_effort=(self.reasoning or {}).get("effort"),
            # Its place in the engine's queue, as a chat request's.
            priority=self.priority,
            user=self.user,
        )

    def structured_output(self) -> StructuredOutput | None:
        """What ``text.format`` holds the output to, or None (plain text)."""
        text_format = self.text.format if self.text is not None else None
        if not isinstance(text_format, dict) or text_format["type"] == "text":
            return None  # the chat request's structured_outputs, if any
        if self.structured_outputs is not None:
            raise ApiError(
                400, "Cannot specify both structured_outputs and text.format.", param="text.format"
            )
        try:
            if text_format["type"] == "json_object":
                return structured_output_of(response_format={"type": "json_object"})
            # The Responses API flattens what the chat API nests under json_schema.
            json_schema = {k: v for k, v in text_format.items() if k != "type"}
            return structured_output_of(
                response_format={"type": "json_schema", "json_schema": json_schema}
            )
        except ApiError as exc:
            raise ApiError(400, exc.message, param="text.format") from exc


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as a chat one: its fields under ``function``."""
    function = {key: value for key, value in tool.items() if key != "type"}
    return {"type": "function", "function": function}


class _ChatForResponses(ChatCompletionRequest):
    """A chat request made from a Responses one: errors about its prompt name ``input``."""

    prompt_param: ClassVar[str] = "input"
