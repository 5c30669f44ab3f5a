"""Every message that crosses the engine socket. This file is the protocol.

Servers hold a DEALER socket, the engine a ROUTER socket; each ZeroMQ message is
one frame holding one encoded message (the ROUTER adds the peer identity frame).

Server -> engine: HandshakeRequest, GenerateRequest, EmbedRequest, AbortRequest, StatsRequest,
ReadReceipt.
Engine -> server: HandshakeReply, TokenOutputs, Embedding, ErrorReply, EngineStats.

docs/architecture.md walks through the life of a request in these terms.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.codec import Message, by_position

# Bumped on any incompatible change to the messages below; checked at the handshake.
# 2: log-probabilities (SamplingParams.logprobs, RequestOutput.logprobs), presence and
#    frequency penalties, logit bias, token counters in EngineStats.
# 3: structured outputs (SamplingParams.structured_output), refused with invalid_request.
# 4: vLLM's sampling fields (min_p, repetition_penalty, min_tokens, bad_words,
#    allowed_token_ids, prompt_logprobs), RequestOutput.prompt_logprobs and
#    HandshakeReply.sampling_defaults.
# 5: SamplingDefaults.max_tokens (generation_config.json's max_new_tokens),
#    RequestOutput.stop_token_id and .queue_time, ErrorCode.SHUTTING_DOWN (an engine draining
#    on SIGTERM), EngineStats.num_connected_servers.
# 6: EngineStats.num_draft_tokens and .num_accepted_tokens (speculative decoding).
# 7: RequestOutput, TokenLogprobs and PromptTokenLogprobs go as arrays of their fields
#    (codec.by_position), not maps.
# 8: GenerateRequest.scheduling (vLLM's priority, the user for fair turns),
#    ErrorCode.OVERLOADED (the engine's queue is full), EngineStats sent unasked as the
#    engine's heartbeat; EmbedRequest and Embedding (/v1/embeddings: a prompt's pooled last
#    hidden state).
# 9: StructuredOutputKind.STRUCTURAL_TAG (a grammar composed of parts: reasoning, tool calls,
#    a response format).
# 10: EngineStats.queue_full, sent whenever it changes (servers refuse by themselves while full).
# 11: RequestOutput.prefill_time (the servers' request_prefill_time histogram).
# 12: ReadReceipt (the bytes a server has read, for the engine's --max-unread-output-bytes),
#     and ErrorCode.NOT_READY with an empty request id: the engine dropped this server.
# 13: RequestOutput.prompt_logprobs in pieces: each output carries the prompt positions scored
#     since the request's last one (a prompt prefilled over several steps sends outputs with no
#     new tokens), not all of them with the first token.
# 14: HandshakeReply.max_requests_at_once: the most requests an idle engine takes at once, so
#     that a server refuses an HTTP request of more choices or inputs with a 400.
PROTOCOL_VERSION = 14
# The most alternatives a request may ask log-probabilities of, as OpenAI's top_logprobs.
MAX_TOP_LOGPROBS = 20
# The most token sequences a request's bad words may tokenize to, and their total tokens
# (vLLM's limits).
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOKENS = 1024
# The sampling values float32 holds finite: a temperature below vLLM's 1e-5 is greedy (the
# servers send 0), and a repetition penalty divides or multiplies logits.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6


class FinishReason:
    """Why a request stopped producing tokens (the OpenAI API's own words)."""

    STOP = "stop"  # an EOS or stop token was sampled (sent as RequestOutput.stop_token_id)
    LENGTH = "length"  # max_tokens or the model's context length was reached
    ABORT = "abort"  # the server aborted it, its server went away, or the engine stopped


class ErrorCode:
    PROTOCOL_VERSION = "protocol_version"  # handshake from an incompatible server
    INVALID_REQUEST = "invalid_request"  # bad parameters or a duplicate request id
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens can never fit
    # A request before the handshake; with no request id, the engine dropped this server (its
    # output unread past the engine's bound): handshake again.
    NOT_READY = "not_ready"
    SHUTTING_DOWN = "shutting_down"  # the engine is draining (SIGTERM) and takes no more
    OVERLOADED = "overloaded"  # past one of the engine's admission bounds: try again later


class StructuredOutputKind:
    """What a StructuredOutput's ``spec`` holds, and so what the output must be."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema (JSON text): the output is JSON it validates
    JSON_OBJECT = "json_object"  # no spec: the output is a JSON object
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON list of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF, as llama.cpp's) whose root rule the output matches
    # xgrammar's structural tag (JSON, as vLLM's structural_tag takes it): a format composed of
    # parts (literal text, free text, JSON schemas, regexes, grammars) in sequence or as
    # alternatives.
    STRUCTURAL_TAG = "structural_tag"


STRUCTURED_OUTPUT_KINDS = (
    StructuredOutputKind.JSON_SCHEMA,
    StructuredOutputKind.JSON_OBJECT,
    StructuredOutputKind.REGEX,
    StructuredOutputKind.CHOICE,
    StructuredOutputKind.GRAMMAR,
    StructuredOutputKind.STRUCTURAL_TAG,
)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token by the engine's grammar
    matcher. Frozen: the engine caches compiled grammars by it."""

    kind: str  # a StructuredOutputKind
    spec: str = ""

    def validate(self) -> str | None:
        """The reason this constraint is malformed, or None. Whether the schema, regex or
        grammar itself is valid is the grammar library's to say (the engine asks it)."""
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            return f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
        if self.kind == StructuredOutputKind.JSON_OBJECT:
            return None if not self.spec else "a json_object structured output takes no spec"
        if self.kind == StructuredOutputKind.CHOICE:
            try:
                choices = json.loads(self.spec)
            except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
                choices = None
            if not (
                isinstance(choices, list)
                and choices
                and all(isinstance(choice, str) for choice in choices)
            ):
                return "choice structured output must be a JSON list of strings, not empty"
            return None
        return None if self.spec else f"a {self.kind} structured output needs a spec"


@dataclass
class SamplingParams:
    """How to choose each next token. The defaults are greedy decoding.

    The engine applies them in vLLM's order: allowed_token_ids, bad words and min_tokens'
    bans, logit bias, then the penalties (repetition, frequency, presence); greedy rows take
    the argmax of that, sampled ones divide it by the temperature and cut it by min_p, then
    top-k and top-p.
    """

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # same seed and prompt -> same output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no log-probabilities; k: each new token's, and those of the k likeliest tokens.
    logprobs: int | None = None
    # OpenAI's: subtracted from the logit of every token already generated, once
    # (presence) or once per time it was (frequency). 0 is off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias as two parallel lists: added to these tokens' logits.
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    # None: free text; otherwise each token is sampled among those the constraint allows.
    structured_output: StructuredOutput | None = None
    # vLLM's: only tokens whose probability is at least min_p times the likeliest one's
    # (after the temperature) may be sampled. 0 is off.
    min_p: float = 0.0
    # vLLM's (Hugging Face's): every token of the prompt or the output so far has its logit
    # divided by this if positive, multiplied by it if not. 1 is off.
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids cannot be sampled before this many output tokens.
    min_tokens: int = 0
    # vLLM's bad_words, tokenized by the server: the last token of each sequence cannot be
    # sampled right after the others (a one-token sequence never).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # None: any token; otherwise only these may be sampled.
    allowed_token_ids: list[int] | None = None
    # None: none; k: each prompt token's log-probability given the ones before it (the
    # first has none) and the k likeliest tokens' at its position.
    prompt_logprobs: int | None = None

    def for_choice(self, index: int, *, prompt_logprobs_once: bool = False) -> SamplingParams:
        """The parameters of choice ``index`` of a request's n: a seeded request's choices
        each take a seed of their own, in turn (seed, seed + 1, ...). ``prompt_logprobs_once``:
        the answer shows the prompt's log-probabilities once, the first choice's, so the
        others' requests do not compute them."""
        changes: dict[str, Any] = {}
        if self.seed is not None:
            changes["seed"] = (self.seed + index) % 2**63
        if index and prompt_logprobs_once and self.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None
        return dataclasses.replace(self, **changes) if changes else self

    def validate(self) -> str | None:
        """The reason these parameters are unusable, or None."""
        if self.max_tokens < 1:
            return "max_tokens must be at least 1"
        # Within float32's reach (the sampler's): a temperature or repetition penalty near 0
        # overflows the logits it divides to inf, then NaN, and a top_p that rounds to 0 kept
        # no token; their tokens were garbage. Servers send vLLM's greedy for temperatures
        # below MIN_TEMPERATURE.
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            return (
                f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE}"
            )
        if not 0 < self.top_p <= 1:
            return "top_p must be in (0, 1]"
        if self.top_k < 0:
            return "top_k must be non-negative"
        if self.seed is not None and not 0 <= self.seed < 2**63:
            return "seed must be in [0, 2**63)"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                return f"{name} must be in [0, {MAX_TOP_LOGPROBS}]"
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            return "presence_penalty and frequency_penalty must be in [-2, 2]"
        if len(self.logit_bias_token_ids) != len(self.logit_bias_values):
            return "logit_bias_token_ids and logit_bias_values must be as long"
        if not all(-100 <= bias <= 100 for bias in self.logit_bias_values):
            return "logit_bias values must be in [-100, 100]"
        if not 0 <= self.min_p <= 1:
            return "min_p must be in [0, 1]"
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return (
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}]"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            return "min_tokens must be in [0, max_tokens]"
        words = self.bad_words_token_ids
        if not all(words) or len(words) > MAX_BAD_WORDS:
            return f"bad words may be {MAX_BAD_WORDS} token sequences at most, none empty"
        if sum(map(len, words)) > MAX_BAD_WORDS_TOKENS:
            return f"bad words may hold {MAX_BAD_WORDS_TOKENS} tokens in all"
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            return "allowed_token_ids must not be empty"
        if self.structured_output is not None:
            return self.structured_output.validate()
        return None

    def token_ids(self) -> list[list[int]]:
        """Every list of token ids these parameters hold, for the vocabulary check."""
        return [
            self.stop_token_ids,
            self.logit_bias_token_ids,
            self.allowed_token_ids or [],
            *self.bad_words_token_ids,
        ]


@dataclass
class SamplingDefaults:
    """The model's own sampling defaults (its generation_config.json, as vLLM reads it by
    default): what a server uses for a field a request leaves out. None: no default here."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: the most a request generates by default


@dataclass
class HandshakeRequest(Message):
    """First message of every server: checks versions and asks for the model's facts."""

    TYPE: ClassVar[str] = "handshake"
    protocol_version: int
    client_name: str = ""


@dataclass
class HandshakeReply(Message):
    """Everything a stateless server needs to serve this engine's model."""

    TYPE: ClassVar[str] = "handshake_reply"
    protocol_version: int
    model_name: str
    tokenizer_json: str  # the content of a Hugging Face tokenizer.json
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]  # ids that end generation unless ignore_eos
    max_model_len: int  # prompt + output tokens of one request
    engine_pid: int
    engine_started_at: float  # unix time the engine process started
    # For the fields a request leaves out (the engine's --generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # The most requests (choices, embedding inputs) the engine takes at once when idle, its
    # places and its queue (--max-num-seqs + --max-queued-requests): a server refuses an HTTP
    # request of more with a 400, since the engine would refuse the excess every time it is
    # tried (a 429 whose retries all fail). None: no bound known.
    max_requests_at_once: int | None = None


@dataclass(frozen=True)
class Scheduling:
    """Where a request waits in the engine's queue. ``priority`` is vLLM's: lower runs
    earlier, taken only by an engine with ``--scheduling-policy priority``. Within a priority,
    the requests of different ``user``s take turns (the n choices of one request share it), so
    that no one user's many requests keep the others waiting."""

    priority: int = 0
    user: str = ""


@dataclass
class GenerateRequest(Message):
    """Generate tokens after a prompt. Request ids are unique per server."""

    TYPE: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    scheduling: Scheduling = field(default_factory=Scheduling)


@dataclass
class EmbedRequest(Message):
    """Run a prompt through the model, prefill only, and answer with its last hidden state
    pooled as the model's pooling says (its sentence-transformers config, else the last
    token's, vLLM's default for a causal LM) and L2-normalized: an ``Embedding``. Aborted
    by an AbortRequest like a generation; its id shares their namespace."""

    TYPE: ClassVar[str] = "embed"
    request_id: str
    prompt_token_ids: list[int]


@dataclass
class Embedding(Message):
    """An EmbedRequest's answer (a refusal is an ErrorReply)."""

    TYPE: ClassVar[str] = "embedding"
    request_id: str
    embedding: list[float]  # unit length (L2)
    num_prompt_tokens: int


@dataclass
class AbortRequest(Message):
    """Stop a request and free its cache now. Unknown ids are ignored."""

    TYPE: ClassVar[str] = "abort"
    request_id: str


@dataclass
class StatsRequest(Message):
    """Asks for an EngineStats (/stats and /metrics); the engine also sends one to every
    server each second unasked, its heartbeat (/health and /ready)."""

    TYPE: ClassVar[str] = "stats"


@dataclass
class ReadReceipt(Message):
    """The bytes of the engine's frames this server has read since the last HandshakeReply
    (that reply not counted). The engine drops a server whose output sent and not read by
    this count would pass its ``--max-unread-output-bytes``. Sent at each EngineStats received
    (the heartbeat, every second), and before a handshake again once the engine said it
    dropped this server (else the reply would pass the bound again); a peer that never sends
    one counts as reading nothing."""

    TYPE: ClassVar[str] = "read_receipt"
    bytes_read: int


@by_position
@dataclass
class TokenLogprobs:
    """A generated token's log-probability under the model (its raw distribution, before
    temperature and top-k/top-p), and the likeliest tokens' ids and log-probabilities."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@by_position
@dataclass
class PromptTokenLogprobs:
    """A prompt token's log-probability given the tokens before it, its rank among the
    vocabulary's (1: the likeliest; tokens as likely count before it), and the likeliest
    tokens' ids and log-probabilities at its position."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@by_position
@dataclass
class RequestOutput:
    """New tokens of one request since its last output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # a FinishReason once the request is done
    num_prompt_tokens: int
    num_output_tokens: int  # all tokens generated so far, the new ones included
    # One per new token when the request asked for them (SamplingParams.logprobs).
    logprobs: list[TokenLogprobs] | None = None
    # When the request asked (SamplingParams.prompt_logprobs): the entries of the prompt
    # tokens scored since its last output, following those sent before (None: none were).
    # Over its outputs up to the first token's they make one per prompt token after the
    # first; a prompt prefilled over several steps sends outputs with no new tokens for
    # them, each step's as it is read (not all in one, which would take the engine, then the
    # server, seconds to encode and decode for a long prompt, every other request waiting).
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    # With finish_reason stop: the EOS or stop token that ended the request, which is not
    # among the new tokens (a server shows its text only with include_stop_str_in_output).
    stop_token_id: int | None = None
    # With the first token's output: seconds from the engine's receipt of the request to its
    # first step (vLLM's queue time). None on the others.
    queue_time: float | None = None
    # With the first token's output: seconds from the request's first step to this output's
    # making, just before it is sent (vLLM's prefill time): its prompt's steps and, with
    # overlapped steps, the step after them, which reads the token. None on the others.
    prefill_time: float | None = None


@dataclass
class TokenOutputs(Message):
    """One engine step's outputs for all of one server's requests."""

    TYPE: ClassVar[str] = "outputs"
    outputs: list[RequestOutput]


@dataclass
class ErrorReply(Message):
    """A request (or, with an empty request_id, a message) the engine refused."""

    TYPE: ClassVar[str] = "error"
    request_id: str
    code: str  # an ErrorCode
    message: str


@dataclass
class EngineStats(Message):
    """The engine's state: liveness, identity, and cache use."""

    TYPE: ClassVar[str] = "engine_stats"
    engine_pid: int
    engine_started_at: float
    model_name: str
    device: str
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_finished: int  # requests finished since start, aborted ones included
    # Counters since start, for throughput and cache-efficiency monitoring.
    num_prompt_tokens: int = 0  # prompt tokens computed (not those found in the cache)
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: draft tokens verified, and those of them accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Peers connected to the engine's socket now: the servers (the service's count).
    num_connected_servers: int = 0
    # A request arriving now would be refused (--max-queued-requests): the servers refuse by
    # themselves meanwhile. Sent at once whenever it changes, not only at the heartbeat.
    queue_full: bool = False
