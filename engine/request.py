"""A request's state inside the engine, from admission to its last token."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol import SamplingParams


class RequestStatus(enum.Enum):
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
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache
    num_scheduled_tokens: int = 0  # tokens the current step computes, from num_cached_tokens
    num_keyed_blocks: int = 0  # leading blocks keyed for prefix caching (BlockManager)
    parent_key: int = 0  # hash of the last keyed block's key
    status: RequestStatus = RequestStatus.WAITING

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.request_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def scheduled_token_ids(self) -> list[int]:
        """The tokens the current step computes."""
        start = self.num_cached_tokens
        return self.token_ids_between(start, start + self.num_scheduled_tokens)
