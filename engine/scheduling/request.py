"""A request's state inside the engine, from admission to its last token."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.scheduling.draft_acceptance import DraftAcceptance
from engine.scheduling.draft_pause import DraftPause
from protocol import PromptTokenLogprobs, SamplingParams, Scheduling

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestStatus(enum.Enum):
    COMPILING = enum.auto()  # waits for its grammar (structured outputs); not scheduled yet
    WAITING = enum.auto()  # queued; no cache blocks
    RUNNING = enum.auto()  # has blocks; decodes every step
    FINISHED = enum.auto()


@dataclass(eq=False)
class Request:
    """One generation. ``client`` is the server's socket identity; ids are unique per client."""

    client: bytes
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # the request's own seed, or one the engine drew for it
    # Its priority and user: where it waits in the queue (engine/scheduling/waiting_queue.py).
    scheduling: Scheduling = field(default_factory=Scheduling)
    output_token_ids: list[int] = field(default_factory=list)
    # Its cache blocks, in order: int64 in an array (not a list), so that a step packs a
    # batch's block tables by joining their buffers (engine/execution/batch.py), not item by item.
    block_ids: array[int] = field(default_factory=lambda: array("q"))
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache
    num_scheduled_tokens: int = 0  # tokens the current step computes, from num_cached_tokens
    # Tokens sampled by a step still in flight (overlapped steps), not yet read by the host:
    # they count in num_tokens but are not in output_token_ids. pending_row is the newest
    # one's row in that step's sampled tokens, where the next step's input is taken from.
    num_pending_tokens: int = 0
    pending_row: int = -1
    # Its prompt, output and pending tokens: len(prompt_token_ids) + len(output_token_ids) +
    # num_pending_tokens, kept as they change (add_pending_token, read_pending_token,
    # append_output_tokens). An attribute, not a property: the scheduler, packing and the read
    # of results take it four times a request each step, and a property's call cost a large
    # batch's step a tenth of the host's time.
    num_tokens: int = field(init=False)
    # Speculative decoding: tokens proposed to follow its last one, which the current step
    # verifies (the step computes them after the last token); empty without speculation.
    draft_token_ids: list[int] = field(default_factory=list)
    # With a draft model: its first tokens whose K/V are in the draft's cache (which shares
    # this request's blocks); never a draft, always tokens the request has.
    num_draft_cached_tokens: int = 0
    # When drafts for it do not pay, it is not drafted for a while; how often its drafts
    # were accepted, by their source (engine/speculative/adaptive.py reads both).
    draft_pause: DraftPause = field(default_factory=DraftPause)
    draft_acceptance: DraftAcceptance = field(default_factory=DraftAcceptance)
    num_keyed_blocks: int = 0  # leading blocks keyed for prefix caching (BlockManager)
    parent_key: int = 0  # hash of the last keyed block's key
    status: RequestStatus = RequestStatus.WAITING
    # With sampling.prompt_logprobs: how many of prompt tokens 1, 2, ... have their entries
    # read, and those read since its last output, which sends them (each step's, not all at
    # once: one output of a long prompt's would hold up every other request's).
    num_scored_prompt_tokens: int = 0
    unsent_prompt_logprobs: list[PromptTokenLogprobs] = field(default_factory=list)
    # With a presence, frequency or repetition penalty: its slot of the seen tokens' tables
    # on the device, and how many of its output tokens the slot has counted, a pending one
    # included (engine/execution/seen_tokens.py).
    seen_tokens_slot: int | None = None
    num_seen_tokens: int = 0
    # Its prompt and output as int32 ids in one byte string, num_byte_tokens of them, which
    # the n-gram proposer (speculative decoding) searches and extends as the output grows.
    token_bytes: bytearray | None = None
    num_byte_tokens: int = 0
    # Whether sampling does more than temperature, top-k and top-p for it (penalties, logit
    # bias, bans, allowed tokens, min_p): known at arrival, so that a step of requests that
    # do not checks one flag each (engine/execution/batch.py).
    shapes_logits: bool = field(init=False)
    # A presence, frequency or repetition penalty, one of those (engine/execution/seen_tokens.py).
    penalized: bool = field(init=False)
    # Its sampling parameters' token lists, made once at arrival as the host reads them for
    # each token (sets) and a step packs them (int64 arrays, each id once): a request's body
    # holds millions of ids, which scanned or converted every step would slow every step of
    # the batch. allowed_token_set (engine/sampling/token_restrictions.py) and
    # allowed_token_array None: every token is allowed. A token repeated in the logit bias
    # gets the sum of its values, as the sampler's accumulating sum would give it.
    stop_token_set: frozenset[int] = field(init=False)
    # The tokens that finish it when sampled: its stop tokens, and the model's end-of-sequence
    # tokens unless it ignores them (the engine adds those at arrival).
    finish_token_set: frozenset[int] = field(init=False)
    stop_token_array: np.ndarray = field(init=False)
    allowed_token_set: frozenset[int] | None = field(init=False)
    allowed_token_array: np.ndarray | None = field(init=False)
    logit_bias_token_array: np.ndarray = field(init=False)
    logit_bias_value_array: np.ndarray = field(init=False)  # float32
    # Its structured output's matcher: it has accepted every token of output_token_ids
    # (never a pending one). None: free text.
    grammar: xgr.GrammarMatcher | None = None
    # time.monotonic() at arrival and when first admitted: its queue time, sent with its
    # first output (the servers' request_queue_time histogram).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        s = self.sampling
        self.penalized = bool(
            s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1
        )
        self.shapes_logits = bool(
            self.penalized
            or s.logit_bias_token_ids
            or s.allowed_token_ids is not None
            or s.bad_words_token_ids
            or s.min_tokens
            or s.min_p
        )
        self.stop_token_set = frozenset(s.stop_token_ids)
        self.finish_token_set = self.stop_token_set
        self.stop_token_array = np.fromiter(self.stop_token_set, np.int64, len(self.stop_token_set))
        allowed = s.allowed_token_ids
        self.allowed_token_set = None if allowed is None else frozenset(allowed)
        self.allowed_token_array = None if allowed is None else np.unique(_int64(allowed))
        self.logit_bias_token_array, where = np.unique(
            _int64(s.logit_bias_token_ids), return_inverse=True
        )
        self.logit_bias_value_array = np.bincount(
            where, s.logit_bias_values, len(self.logit_bias_token_array)
        ).astype(np.float32)
        self.num_tokens = (
            len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens
        )

    def add_pending_token(self, row: int) -> None:
        """A step sampled its next token, at ``row`` of the step's tokens, not yet read."""
        self.num_pending_tokens += 1
        self.num_tokens += 1
        self.pending_row = row

    def read_pending_token(self) -> None:
        """The host read its oldest pending token (appended next, unless it ends the request)."""
        self.num_pending_tokens -= 1
        self.num_tokens -= 1

    def append_output_tokens(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self.num_tokens += len(tokens)

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.request_id)

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens the host has read."""
        return self.num_tokens - self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt log-probabilities and has not sampled its first token: its
        prefill must score every prompt position, so it may take no cached blocks."""
        return self.sampling.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def has_all_tokens(self) -> bool:
        """Every token it may generate is sampled (the last maybe still on the device): it
        finishes when the host reads that token, with nothing left to compute."""
        return self.num_output_tokens >= self.sampling.max_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def scheduled_token_ids(self) -> list[int]:
        """The tokens the current step computes: known ones, a pending one, then the drafts.
        A pending token (a decode's input, still on the device) reads as 0: the runner fills
        it in on the device."""
        start = self.num_cached_tokens
        known = self.token_ids_between(start, start + self.num_scheduled_tokens)
        if not self.draft_token_ids:
            return known + [0] * (self.num_scheduled_tokens - len(known))
        # A request with drafts has no pending token: its last step was read to draft them.
        return known + self.draft_token_ids


def _int64(token_ids: list[int]) -> np.ndarray:
    return np.asarray(token_ids, np.int64)
