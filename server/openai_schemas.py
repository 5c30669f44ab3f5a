"""The request bodies of the OpenAI API that this server accepts, and their validation.

Fields that OpenAI defines but this server cannot honour yet are refused with a 400
rather than silently ignored: a client asking for tools must not get an answer that
looks right without them. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from protocol import MAX_TOP_LOGPROBS, SamplingParams, context_length_problem
from server.errors import ApiError
from server.served_model import ServedModel
from server.structured_output import structured_output_of

_MAX_STOP_STRINGS = 4
MAX_CHOICES = 128  # n, as OpenAI allows


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


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    # bool is an int subclass; [true] is not a list of token ids.
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        if min(value) < 0:
            raise PydanticCustomError("invalid_value", "token ids must not be negative")
        return value
    raise PydanticCustomError(
        "invalid_type",
        "prompt must be a string, a non-empty list of token ids, or a list of one string",
    )


def _content(value: Any) -> str | list[dict[str, str]] | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type", "content must be a string or a list of parts")
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


def _unsupported(what: str, off: Any) -> Any:
    """A validator that refuses any value but ``off`` (or null) with "``what`` is not supported"."""

    def check(value: Any) -> Any:
        if value not in (None, off):
            raise PydanticCustomError(
                "unsupported_parameter", "{what} is not supported yet", {"what": what}
            )
        return value

    return BeforeValidator(check)


StopStrings = Annotated[list[str], BeforeValidator(_stop_strings)]
Prompt = Annotated[str | list[int], BeforeValidator(_prompt)]
Content = Annotated[str | list[dict[str, str]] | None, BeforeValidator(_content)]


class _Body(BaseModel):
    # OpenAI's clients send fields this server has no use for; ignore them.
    model_config = ConfigDict(extra="ignore")


RequestT = TypeVar("RequestT", bound=_Body)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(BaseModel):
    # Extra fields (name, tool_call_id, ...) are kept: chat templates may read them.
    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: Content = None


class GenerationBody(_Body):
    """What the generating endpoints share: the model, sampling, stopping and streaming.

    Each endpoint's body says what it calls its prompt and how it asks for a length and
    for log-probabilities; ``sampling_params`` turns all of it into the engine's terms.
    """

    # What the request calls its prompt, in errors about it (the chat API's "messages").
    prompt_param: ClassVar[str]

    model: str | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    n: Annotated[int | None, Field(ge=1, le=MAX_CHOICES)] = None
    stop: StopStrings = Field(default_factory=list)
    # OpenAI takes any 64-bit seed; the engine's are non-negative (see sampling_params).
    seed: Annotated[int | None, Field(ge=-(2**63), lt=2**63)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    # Token ids (as strings, JSON's keys) to a bias added to their logits.
    logit_bias: (
        dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = None
    # vLLM's extensions, which many clients use.
    top_k: Annotated[int | None, Field(ge=-1)] = None  # -1 or 0: no top-k cut
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    # Structured outputs, in every shape clients send (server/structured_output.py reads
    # them): OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The most tokens to generate, if the request says; else as many as fit."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many alternatives' log-probabilities each token needs, or None for none."""
        raise NotImplementedError

    def sampling_params(self, prompt_tokens: int, model: ServedModel) -> SamplingParams:
        """How the engine samples each choice after a prompt of ``prompt_tokens`` tokens;
        raises ``ApiError`` for what ``model`` cannot do (context length, token ids)."""
        logprobs = self.requested_logprobs()
        max_tokens = self.requested_max_tokens()
        limit = model.max_model_len
        problem = context_length_problem(prompt_tokens, max_tokens, limit, self.prompt_param)
        if problem:
            raise ApiError(400, problem, param=self.prompt_param, code="context_length_exceeded")
        model.check_token_ids(self.stop_token_ids, "stop_token_ids")
        logit_bias = self.logit_bias or {}
        model.check_token_ids(list(logit_bias), "logit_bias")
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limit - prompt_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # vLLM's -1 and OpenAI's absence: no cut
            # The engine takes seeds in [0, 2**63); this maps OpenAI's signed ones there.
            seed=None if self.seed is None else self.seed % 2**63,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias_token_ids=list(logit_bias),
            logit_bias_values=list(logit_bias.values()),
            structured_output=structured_output_of(
                response_format=self.response_format,
                structured_outputs=self.structured_outputs,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
            ),
        )


class ChatCompletionRequest(GenerationBody):
    prompt_param: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    tools: Annotated[Any, _unsupported("tools", [])] = None
    tool_choice: Annotated[Any, _unsupported("tool_choice other than none", "none")] = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationBody):
    prompt_param: ClassVar[str] = "prompt"

    prompt: Prompt
    echo: Annotated[Any, _unsupported("echo", False)] = None
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    suffix: Annotated[Any, _unsupported("suffix", "")] = None
    best_of: Annotated[Any, _unsupported("best_of other than 1", 1)] = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a prompt, or messages to render with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    add_special_tokens: bool = True  # for a prompt (a template holds its own)
    add_generation_prompt: bool = True  # for messages

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse_request(model: type[RequestT], body: bytes) -> RequestT:
    """The validated request, or an ``ApiError`` naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


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
