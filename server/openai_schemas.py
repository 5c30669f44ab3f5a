"""The request bodies of the OpenAI API that this server accepts, and their validation.

Fields that OpenAI or vLLM define but this server cannot honour yet are refused with a
400 rather than silently ignored: a client asking for tools must not get an answer that
looks right without them. Fields that neither defines are ignored with a warning naming
them, as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from protocol import (
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
    Scheduling,
    context_length_problem,
    prompt_logprobs_problem,
    quoted,
)
from server.errors import ApiError
from server.json_schema_defs import DEFINITION_SECTIONS
from server.served_model import ServedModel
from server.structured_output import structured_output_of

if TYPE_CHECKING:
    from starlette.requests import Request

logger = logging.getLogger(__name__)

_MAX_STOP_STRINGS = 4
MAX_CHOICES = 128  # n, as OpenAI allows
# The engine's integers are signed 64-bit (its tensors' int64; the wire refuses larger).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


def _temperature(value: float) -> float:
    """As vLLM: a temperature below MIN_TEMPERATURE samples greedily (the engine takes 0)."""
    return 0.0 if value < MIN_TEMPERATURE else value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise PydanticCustomError("invalid_type", "stop must be a string or a list of strings")
    if len(stops) > _MAX_STOP_STRINGS:
        raise PydanticCustomError(
            "invalid_value", "stop may hold at most {limit} strings", {"limit": _MAX_STOP_STRINGS}
        )
    if "" in stops:
        raise PydanticCustomError("invalid_value", "stop strings must not be empty")
    return stops


def _prompts(value: Any) -> list[str | list[int]]:
    """A completion's prompts: OpenAI's one prompt (text or token ids) or batch of them."""
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(_is_prompt(item) for item in value):
        return value
    raise PydanticCustomError(
        "invalid_type",
        "prompt must be a string, a non-empty list of non-negative token ids, or a non-empty "
        "list of either",
    )


def _embedding_inputs(value: Any) -> list[str | list[int]]:
    """The inputs to embed: as a completion's prompts, but an empty string is refused."""
    try:
        inputs = _prompts(value)
    except PydanticCustomError:
        raise PydanticCustomError(
            "invalid_type",
            "input must be a string, a non-empty list of non-negative token ids, or a "
            "non-empty list of either",
        ) from None
    if "" in inputs:
        raise PydanticCustomError("invalid_value", "input must not hold an empty string")
    return inputs


def _is_token_ids(value: Any) -> bool:
    # bool is an int subclass; [true] is not a list of token ids.
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(item) is int and item >= 0 for item in value)
    )


def _is_prompt(value: Any) -> bool:
    return isinstance(value, str) or _is_token_ids(value)


def _content(value: Any) -> str | list[dict[str, str]] | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type", "content must be a string or a list of parts")
    if not value:  # as OpenAI: a message of no parts says nothing
        raise PydanticCustomError("invalid_value", "content must not be an empty list of parts")
    parts = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PydanticCustomError("invalid_type", "each content part must be an object")
        if part["type"] != "text":
            raise PydanticCustomError(
                "unsupported_parameter",
                "content parts of type '{type}' are not supported yet; only 'text' is",
                {"type": part["type"]},
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("invalid_type", "a text part needs a string 'text'")
        parts.append({"type": "text", "text": part["text"]})
    return parts


StopStrings = Annotated[list[str], BeforeValidator(_stop_strings)]
Prompts = Annotated[list[str | list[int]], BeforeValidator(_prompts)]
Content = Annotated[str | list[dict[str, str]] | None, BeforeValidator(_content)]

# vLLM's fields of chat completions and completions that this server does not serve yet
# (RequestBody.not_served): the values that ask for nothing are vLLM's defaults.
_NOT_SERVED_GENERATION: dict[str, tuple[Any, ...]] = {
    "logprob_token_ids": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "watermarking": (False,),
    "guided_decoding_backend": ("xgrammar", "auto"),  # xgrammar is the one served
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "logits_processors": (),
    "request_id": (),  # the X-Request-Id header names a request (server/request_id.py)
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": (),
    "return_token_ids": (False,),
    "repetition_detection": (),
    "thinking_token_budget": (),
    "stream_interval": (),
}


class RequestBody(BaseModel):
    """A request body. Undeclared fields are kept, for ``parse_request`` to refuse those
    in ``not_served`` and to warn about (and then ignore) the others."""

    model_config = ConfigDict(extra="allow")

    # Fields that vLLM knows and this server does not serve yet, each with the values
    # that ask for nothing (null always does).
    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {}


RequestT = TypeVar("RequestT", bound=RequestBody)
T = TypeVar("T", int, float)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


class ChatMessage(BaseModel):
    # Extra fields (name, tool_call_id, ...) are kept: chat templates may read them.
    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: Content = None
    name: str | None = None  # the participant's, as OpenAI's: a template writes it as text

    @model_validator(mode="after")
    def _content_where_required(self) -> ChatMessage:
        # As OpenAI: only an assistant's message (its tool calls) may leave it out; without
        # it a chat template fails on the missing field with an error that names neither.
        if self.content is None and self.role in _ROLES_WITH_CONTENT:
            raise PydanticCustomError(
                "invalid_value", "a {role} message needs its content", {"role": self.role}
            )
        return self


# The roles whose messages carry content: all of OpenAI's but the assistant's.
_ROLES_WITH_CONTENT = frozenset({"system", "developer", "user", "tool"})


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _definitions_are_objects(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # tool_choice "required" moves them to its schema's root (server/json_schema_defs.py).
        for section in DEFINITION_SECTIONS:
            if value is not None and not isinstance(value.get(section, {}), dict):
                raise PydanticCustomError(
                    "invalid_type", "{section} must be an object", {"section": section}
                )
        return value


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class SamplingFields(RequestBody):
    """The sampling fields that chat completions, completions and the Responses API all take
    (vLLM's ResponsesRequest has these of them), validated and read the same way: the
    Responses API hands them to the chat request it makes (server/responses_schemas.py)."""

    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=-1, lt=2**63)] = None  # vLLM's; -1 or 0: no cut
    # Token ids (as strings, JSON's keys) to a bias added to their logits.
    logit_bias: (
        dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = None
    stop: StopStrings = Field(default_factory=list)
    # OpenAI takes any 64-bit seed; the engine's are non-negative (see sampling_params).
    seed: Int64 | None = None
    ignore_eos: bool = False
    repetition_penalty: Annotated[
        float | None, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ] = None
    include_stop_str_in_output: bool = False  # a stop string or token ends the text
    # vLLM's: False keeps special tokens' text in the answer.
    skip_special_tokens: bool = True
    # vLLM's structured outputs (server/structured_output.py reads them).
    structured_outputs: Any = None


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    """none, auto, required, or {"type": "function", "function": {"name": ...}}."""
    if value is None or value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(function, dict)
        or value.get("type") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise PydanticCustomError(
            "invalid_value",
            'tool_choice must be none, auto, required or {"type": "function", '
            '"function": {"name": ...}}',
        )
    return {"type": "function", "function": {"name": function["name"]}}


class PromptTruncation(RequestBody):
    """vLLM's truncation of a prompt that has token ids (completions, embeddings)."""

    # Keep only the prompt's last k tokens (its first, with truncation_side "right");
    # -1: as many as the context holds.
    truncate_prompt_tokens: Annotated[int | None, Field(ge=-1)] = None
    truncation_side: Literal["left", "right"] | None = None

    def truncated_prompt(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """``prompt_ids`` as ``truncate_prompt_tokens`` cuts them (vLLM's semantics)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == 0:
            raise ApiError(
                400,
                "truncate_prompt_tokens must be -1 or at least 1.",
                param="truncate_prompt_tokens",
            )
        keep = max_model_len if keep == -1 else keep
        if self.truncation_side == "right":
            return prompt_ids[:keep]
        return prompt_ids[-keep:]


class GenerationBody(SamplingFields, PromptTruncation):
    """What the generating endpoints share: the model, sampling, stopping and streaming.

    Each endpoint's body says what it calls its prompt and how it asks for a length and
    for log-probabilities; ``sampling_params`` turns all of it into the engine's terms.
    """

    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = _NOT_SERVED_GENERATION
    # What the request calls its prompt, in errors about it (the chat API's "messages").
    prompt_param: ClassVar[str]
    # The length of an answer that neither the request nor the model's max_new_tokens bounds
    # (None: what the context leaves).
    unasked_max_tokens: ClassVar[int | None] = None

    model: str | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    n: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: lower runs earlier, on an engine with --scheduling-policy priority.
    priority: Int64 = 0
    frequency_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    # vLLM's extensions, which many clients use.
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    bad_words: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]] | None, Field(min_length=1)] = (
        None
    )
    prompt_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # vLLM's: with skip_special_tokens false, False joins special tokens without the
    # spaces a tokenizer's decoder may put between them.
    spaces_between_special_tokens: bool = True
    # vLLM's: log-probabilities name their tokens "token_id:ID" rather than by their text.
    return_tokens_as_token_ids: bool = False
    # Structured outputs, in every shape clients send (server/structured_output.py reads
    # them): OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> GenerationBody:
        # As OpenAI and vLLM: options of a stream that is not asked for are a mistake.
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_candidates(self) -> int:
        """How many choices each prompt generates."""
        return self.num_choices

    def scheduling(self, peer: str) -> Scheduling:
        """Its place in the engine's queue: its priority, and whose it is for fair turns,
        its ``user`` if it names one, else ``peer``, the address it came from."""
        return Scheduling(self.priority, self.user or peer)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def hidden_token_ids(
        self, model: ServedModel, parser_reads_special_tokens: bool = False
    ) -> frozenset[int] | None:
        """Whose text the answer leaves out (``PreparedGeneration.hidden_token_ids``): every
        special token's (None), as vLLM by default; none, with skip_special_tokens false
        (the EOS or stop token that ends a request is not among the tokens sent: its text
        shows only with include_stop_str_in_output, as in vLLM); or, while a parser reads
        special tokens' text (markers), the EOS and stop tokens'."""
        if not self.skip_special_tokens:
            if not self.spaces_between_special_tokens and model.spaces_between_added_tokens:
                raise ApiError(
                    400,
                    f"spaces_between_special_tokens false is not supported for {model.name}: "
                    "its tokenizer's decoder puts spaces between special tokens.",
                    param="spaces_between_special_tokens",
                    code="unsupported_parameter",
                )
            return frozenset()
        if parser_reads_special_tokens:
            return model.eos_token_ids | frozenset(self.stop_token_ids)
        return None

    def requested_max_tokens(self) -> int | None:
        """The most tokens to generate, if the request says; else None: the model's
        max_new_tokens, or as many as fit (``sampling_params``)."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many alternatives' log-probabilities each token needs, or None for none."""
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """How many alternatives' log-probabilities each prompt token needs, or None."""
        return self.prompt_logprobs

    def sampling_params(self, prompt_tokens: int, model: ServedModel) -> SamplingParams:
        """How the engine samples each choice after a prompt of ``prompt_tokens`` tokens;
        raises ``ApiError`` for what ``model`` cannot do (context length, token ids).

        A sampling field the request leaves out takes the model's default (its
        generation_config.json, as vLLM does), else vLLM's."""
        logprobs = self.requested_logprobs()
        requested_max_tokens = self.requested_max_tokens()
        limit = model.max_model_len
        problem = context_length_problem(
            prompt_tokens, requested_max_tokens, limit, self.prompt_param
        )
        if problem:
            raise ApiError(400, problem, param=self.prompt_param, code="context_length_exceeded")
        defaults = model.sampling_defaults
        # As vLLM: what the request asks, else the model's max_new_tokens, else the endpoint's
        # default, within the context.
        max_tokens = min(
            _first(requested_max_tokens, defaults.max_tokens, self.unasked_max_tokens or limit),
            limit - prompt_tokens,
        )
        generated = self.num_candidates * max_tokens
        if generated > model.max_generated_tokens:
            raise ApiError(
                400,
                f"This request may generate {generated} tokens ({self.num_candidates} choices "
                f"of up to {max_tokens}), more than this server takes in one request "
                f"({model.max_generated_tokens}). Please lower n or max_tokens.",
                param="n" if self.num_candidates > 1 else "max_tokens",
            )
        if self.min_tokens > max_tokens:
            raise ApiError(
                400,
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                f"{self.min_tokens}.",
                param="min_tokens",
            )
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(
                400, "prompt_logprobs are not available when stream=True.", param="prompt_logprobs"
            )
        prompt_logprobs = self.requested_prompt_logprobs()
        problem = prompt_logprobs_problem(prompt_tokens, prompt_logprobs)
        if problem:
            asked_by = "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"
            raise ApiError(400, problem, param=asked_by)
        model.check_token_ids(self.stop_token_ids, "stop_token_ids")
        logit_bias = self.logit_bias or {}
        model.check_token_ids(list(logit_bias), "logit_bias")
        model.check_token_ids(self.allowed_token_ids or [], "allowed_token_ids")
        bad_words_token_ids = model.bad_words_token_ids(self.bad_words)
        self._check_some_token_allowed(model, bad_words_token_ids)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(_first(self.temperature, defaults.temperature, 1.0)),
            top_p=_first(self.top_p, defaults.top_p, 1.0),
            # vLLM's -1 and OpenAI's absence: no cut
            top_k=max(_first(self.top_k, defaults.top_k, 0), 0),
            # The engine takes seeds in [0, 2**63); this maps OpenAI's signed ones there.
            seed=None if self.seed is None else self.seed % 2**63,
            stop_token_ids=self.stop_token_ids
            + ([] if self.ignore_eos else sorted(model.template_eos_token_ids)),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias_token_ids=list(logit_bias),
            logit_bias_values=list(logit_bias.values()),
            min_p=_first(self.min_p, defaults.min_p, 0.0),
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            min_tokens=self.min_tokens,
            bad_words_token_ids=bad_words_token_ids,
            allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=prompt_logprobs,
            structured_output=structured_output_of(
                response_format=self.response_format,
                structured_outputs=self.structured_outputs,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
            ),
        )

    def _check_some_token_allowed(
        self, model: ServedModel, bad_words_token_ids: list[list[int]]
    ) -> None:
        """Refuses allowed_token_ids that the request's other fields ban from the first token:
        bad words of one token, or EOS and stop tokens before min_tokens. (What a structured
        output leaves is the engine's to find: engine/sampling/token_restrictions.py.)"""
        if self.allowed_token_ids is None:
            return
        banned = {word[0] for word in bad_words_token_ids if len(word) == 1}
        if self.min_tokens:
            banned |= model.eos_token_ids | set(self.stop_token_ids)
        if banned.issuperset(self.allowed_token_ids):
            raise ApiError(
                400,
                "Every token of allowed_token_ids is banned by bad_words or, before "
                "min_tokens, as an EOS or stop token: no token is left to generate.",
                param="allowed_token_ids",
            )


def _first(requested: T | None, default: T | None, fallback: T) -> T:
    """The request's value, else the model's default, else ``fallback``."""
    if requested is not None:
        return requested
    return default if default is not None else fallback


class ChatCompletionRequest(GenerationBody):
    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **_NOT_SERVED_GENERATION,
        "chat_template": (),  # vLLM too refuses it unless told to trust request templates
        "media_io_kwargs": (),
        "mm_processor_kwargs": (),
        "return_prompt_text": (False,),
    }
    prompt_param: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    tools: list[Tool] | None = None
    # Default: "auto" with tools, else "none" (server/tool_calling.py reads it).
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message goes on instead
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the template
    # Retrieved documents for a RAG template, as transformers' apply_chat_template takes them.
    documents: list[dict[str, Any]] | None = None
    # vLLM's: the answer's content starts with the last message's, where that message has
    # the answer's role (an assistant message it goes on with, or any, without a generation
    # prompt).
    echo: bool = False
    add_special_tokens: bool = False  # vLLM's: the tokenizer's (BOS) on top of the template's
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer
    # OpenAI's; the template gets it as a variable (gpt-oss's read it), as vLLM gives it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's extra variables: chat_template_kwargs and reasoning_effort."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    @property
    def response_role(self) -> str:
        """The answer's role, as vLLM gives it: the assistant's, or without a generation
        prompt the last message's (which the answer goes on with)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed_content(self) -> str:
        """With ``echo``: what the answer's content starts with (else nothing)."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part["text"] for part in last.content)  # as the template sees it

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationBody):
    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        **_NOT_SERVED_GENERATION,
        "prompt_embeds": (),
    }
    prompt_param: ClassVar[str] = "prompt"
    unasked_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's

    prompt: Prompts
    echo: bool = False  # each choice's text starts with its prompt's
    # 0 only with echo: the prompt alone, OpenAI's and vLLM's way to score a prompt.
    max_tokens: Annotated[int | None, Field(ge=0)] = None
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    # Fill in the middle: the text that follows the completion (server/fill_in_middle.py).
    suffix: str | None = None
    # Generate this many candidates for each prompt; answer with the n likeliest.
    best_of: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the BOS token if the model has one

    @model_validator(mode="after")
    def _check_combinations(self) -> CompletionRequest:
        # ApiError, not a validation error: it names the field (pydantic lets it through).
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400,
                "max_tokens must be at least 1, or 0 with echo (the prompt alone).",
                param="max_tokens",
            )
        if self.best_of is not None and self.best_of < self.num_choices:
            raise ApiError(400, "best_of must be at least n.", param="best_of")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise ApiError(400, "best_of cannot be used with stream.", param="best_of")
        if self.suffix and not all(isinstance(prompt, str) for prompt in self.prompt):
            raise ApiError(400, "suffix needs text prompts, not token ids.", param="suffix")
        if self.suffix and self.truncate_prompt_tokens is not None:
            # Cutting the prompt would cut the fill-in-the-middle tokens around it.
            raise ApiError(
                400, "suffix cannot be used with truncate_prompt_tokens.", param="suffix"
            )
        return self

    @property
    def num_candidates(self) -> int:
        """How many choices each prompt generates, of which the ``n`` best are answered."""
        return self.best_of or self.num_choices

    @property
    def prompt_only(self) -> bool:
        """Echo with max_tokens 0: each choice is its prompt alone (with the prompt's
        log-probabilities), as OpenAI and vLLM answer it."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        # As vLLM: the engine generates one token (the prompt's log-probabilities come with
        # it), which the answer leaves out.
        return 1 if self.prompt_only else self.max_tokens

    def requested_prompt_logprobs(self) -> int | None:
        # As vLLM: echo with logprobs scores the echoed prompt's tokens as the completion's.
        if self.prompt_logprobs is None and self.echo_logprobs:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_logprobs(self) -> bool:
        """Whether the answer's log-probabilities start with the echoed prompt's."""
        return self.echo and self.logprobs is not None

    def requested_logprobs(self) -> int | None:
        if self.logprobs is None and self.num_candidates > self.num_choices:
            return 0  # best_of ranks the candidates by their tokens' log-probabilities
        return self.logprobs


class EmbeddingRequest(PromptTruncation):
    """OpenAI's /v1/embeddings body, with vLLM's fields: one input (text or token ids) or a
    batch of them, each embedded on its own."""

    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "normalize": (True,),  # always L2-normalized, vLLM's default
        "embed_dtype": ("float32",),
        "endianness": ("native", "little"),
        "priority": (0,),
        "request_id": (),  # the X-Request-Id header names a request (server/request_id.py)
        "cache_salt": (),
        "mm_processor_kwargs": (),
    }

    model: str | None = None
    input: Annotated[list[str | list[int]], BeforeValidator(_embedding_inputs)]
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka embeddings' length: no model here is trained for a shorter one, so any
    # value gets vLLM's refusal.
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text input gets the BOS token if the model has one

    @model_validator(mode="after")
    def _no_dimensions(self) -> EmbeddingRequest:
        # ApiError, not a validation error: it names the field (pydantic lets it through).
        if self.dimensions is not None:
            raise ApiError(
                400,
                "Model does not support matryoshka representation, changing output "
                "dimensions will lead to poor results.",
                param="dimensions",
                code="unsupported_parameter",
            )
        return self


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize body: a prompt, or messages to render with the chat template."""

    not_served: ClassVar[Mapping[str, tuple[Any, ...]]] = {
        "chat_template": (),
        "mm_processor_kwargs": (),
    }

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    add_special_tokens: bool = True  # for a prompt (a template holds its own)
    return_token_strs: bool = False  # the tokens' strings too, as the vocabulary spells them
    # For messages, as the chat endpoint takes them:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give either prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# Bodies larger than this are parsed in a thread (``read_request``); smaller ones, nearly every
# request, on the event loop, where a thread's hand-off would cost more than the parse.
_PARSED_ON_THE_LOOP_BYTES = 64 * 1024


async def read_request(model: type[RequestT], request: Request) -> RequestT:
    """``parse_request`` of the request's body. A large body is parsed in a thread: its
    parse takes a time that grows with it (a tenth of a second or more for the default 4 MB
    limit), and on the event loop it would stop every other request's stream meanwhile; in a
    thread the loop takes the GIL back at each switch interval."""
    body = await request.body()
    if len(body) <= _PARSED_ON_THE_LOOP_BYTES:
        return parse_request(model, body)
    return await asyncio.to_thread(parse_request, model, body)


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """The validated request, or an ``ApiError`` naming the first bad field or the first
    field it asks for that this server does not serve yet. Fields that nobody defines are
    logged and ignored."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None
    unknown = _undeclared_fields(request)
    if unknown:
        # Each name cut short: a body's field name may be megabytes.
        logger.warning(
            "The following fields were present in the request but ignored: %s",
            ", ".join(quoted(name) for name in unknown),
        )
    return request


def _undeclared_fields(request: RequestBody, path: str = "") -> list[str]:
    """The names of ``request``'s fields (and its nested bodies') that nobody defines;
    raises ``ApiError`` for the first one this server does not serve yet."""
    unknown = []
    for name, value in (request.model_extra or {}).items():
        neutral = request.not_served.get(name)
        if neutral is None:
            unknown.append(path + name)
        elif value is not None and value not in neutral:
            raise ApiError(
                400,
                f"{path}{name} is not supported yet.",
                param=path + name,
                code="unsupported_parameter",
            )
    for name in type(request).model_fields:
        value = getattr(request, name)
        if isinstance(value, RequestBody):
            unknown += _undeclared_fields(value, f"{path}{name}.")
    return unknown


def _to_api_error(exc: ValidationError) -> ApiError:
    error = exc.errors(include_url=False)[0]
    kind, location = error["type"], error["loc"]
    if kind == "json_invalid":
        return ApiError(
            400,
            "We could not parse the JSON body of your request. The body must be valid JSON.",
        )
    if not location:  # the body as a whole: not an object, or a rule across its fields
        if kind == "model_type":
            return ApiError(400, "The request body must be a JSON object.")
        return ApiError(400, f"Invalid request: {error['msg']}.", code="invalid_value")
    param = _param_name(location)
    if kind == "missing":
        return ApiError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if kind in ("invalid_type", "invalid_value", "unsupported_parameter"):
        code = kind  # raised by the validators above
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    else:
        code = "invalid_value"
    return ApiError(400, f"Invalid '{param}': {error['msg']}.", param=param, code=code)


def _param_name(location: tuple[int | str, ...]) -> str:
    # ("messages", 0, "content") -> "messages[0].content", as OpenAI names params.
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else part
    return name
