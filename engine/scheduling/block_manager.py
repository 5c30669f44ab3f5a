"""Hands out fixed-size KV cache blocks to requests, takes them back, and shares cached prefixes.

Prefix caching: a block whose every slot has been computed is keyed by its tokens and by the
key of the block before it, so a key names the whole prefix up to that block's end. A new
request whose prompt starts with keyed blocks takes them (reference counted) instead of
computing them again. A block nobody holds stays keyed while it waits in the free queue,
least recently freed first out, so a system prompt or an earlier turn of a conversation is
found again until its blocks are handed to someone else.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable

from engine.scheduling.request import Request

# The key of the (absent) block before a sequence's first one.
_NO_PARENT = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Free blocks in the order they are handed out: an ordered set, since a cached one
        # may leave it from anywhere when a new request finds its prefix there.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._key_of_block: dict[int, Hashable] = {}
        self._block_of_key: dict[Hashable, int] = {}
        self.num_hit_tokens = 0  # prompt tokens found in the cache instead of computed
        # Whether a draft model's cache holds each block's K/V (engine/speculative/
        # draft_model.py): set once the draft has computed all of a block's tokens, cleared
        # when the block is handed out for other tokens. A request that takes a cached
        # prefix takes the draft's K/V of it too, where the request that computed it drafted.
        self._draft_filled = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are reused when needed)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs to hold the K/V of all its tokens and drafts."""
        num_tokens = request.num_tokens + len(request.draft_token_ids)
        return max(0, self.blocks_for(num_tokens) - len(request.block_ids))

    def can_grow(self, request: Request) -> bool:
        return self.missing_blocks(request) <= len(self._free)

    def try_grow(self, request: Request) -> bool:
        """Give ``request`` enough blocks for every token it has now, if the free ones
        allow; whether it has them."""
        missing = self.missing_blocks(request)
        if missing > len(self._free):
            return False
        if missing:
            request.block_ids.extend(self._allocate() for _ in range(missing))
        return True

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` room for ``num_tokens`` tokens if the free blocks allow (a draft
        model writes its drafts' K/V before the scheduler grows the request); whether it has
        that room now."""
        missing = self.blocks_for(num_tokens) - len(request.block_ids)
        if missing > len(self._free):
            return False
        request.block_ids.extend(self._allocate() for _ in range(missing))
        return True

    def admit(self, request: Request) -> bool:
        """Give a waiting request its cached prefix and blocks for the rest, or, if they do
        not fit in the free blocks, nothing and False. Its computation starts after the
        prefix."""
        assert not request.block_ids
        cached, parent_key = self._cached_prefix(request)
        taken_from_free = sum(1 for block in cached if self._ref_counts[block] == 0)
        missing = self.blocks_for(request.num_tokens) - len(cached)
        if taken_from_free + missing > len(self._free):
            return False
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        request.block_ids = array("q", cached)
        request.num_keyed_blocks = len(cached)
        request.parent_key = parent_key
        request.num_cached_tokens = len(cached) * self.block_size
        self.num_hit_tokens += request.num_cached_tokens
        grown = self.try_grow(request)
        assert grown, "admit() counted the request's missing blocks"
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Key the blocks that the last step filled with computed tokens. Only tokens the host
        has read name a block: one still pending is keyed by a later call."""
        # Most steps fill no block: the check that costs least first (called for every
        # request each step).
        if (
            not self.prefix_caching
            or request.num_cached_tokens < (request.num_keyed_blocks + 1) * self.block_size
        ):
            return
        full = min(request.num_cached_tokens, request.num_known_tokens) // self.block_size
        while request.num_keyed_blocks < full:
            key = self._key(request.parent_key, request, request.num_keyed_blocks)
            # Two requests may compute the same block in one step: the first keeps the key.
            if key not in self._block_of_key:
                block = request.block_ids[request.num_keyed_blocks]
                self._block_of_key[key] = block
                self._key_of_block[block] = key
            request.parent_key = hash(key)
            request.num_keyed_blocks += 1

    def roll_back(self, request: Request, num_rejected: int) -> None:
        """Forget the K/V of a request's last ``num_rejected`` computed tokens (rejected
        drafts) and free the blocks its tokens no longer reach: the next token, the only one
        after its computed ones, is all it keeps room for. Those blocks are unkeyed and held
        by it alone; they go to the front of the free queue, so that reusing them evicts no
        cached prefix."""
        request.num_cached_tokens -= num_rejected
        keep = self.blocks_for(request.num_cached_tokens + 1)
        for block in request.block_ids[keep:]:
            self._ref_counts[block] -= 1
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        del request.block_ids[keep:]

    def draft_filled_tokens(self, request: Request) -> int:
        """How many of ``request``'s first tokens the draft's cache holds already: those of
        its leading blocks the draft filled (a cached prefix), short of its last token,
        whose logits the draft needs."""
        filled = 0
        for block in request.block_ids:
            if not self._draft_filled[block]:
                break
            filled += 1
        return min(filled * self.block_size, request.num_tokens - 1)

    def mark_draft_filled(self, request: Request, start: int, end: int) -> None:
        """The draft computed ``request``'s tokens [``start``, ``end``): the blocks that
        are whole by ``end`` hold its K/V."""
        for index in range(start // self.block_size, end // self.block_size):
            self._draft_filled[request.block_ids[index]] = True

    def release(self, request: Request) -> None:
        # Last blocks first into the free queue, so a prefix's first blocks, the likeliest
        # to be shared, are the last to be reused.
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
        request.block_ids = array("q")
        request.num_cached_tokens = 0
        request.num_draft_cached_tokens = 0  # a draft model's K/V were in these blocks too
        request.num_keyed_blocks = 0
        request.parent_key = _NO_PARENT

    def _allocate(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key_of_block.pop(block, None)
        if key is not None:
            del self._block_of_key[key]  # its contents are about to be overwritten
        self._ref_counts[block] = 1
        self._draft_filled[block] = False
        return block

    def _key(self, parent_key: int, request: Request, index: int) -> Hashable:
        """Block ``index`` of the request, named by its tokens and its parent's key."""
        start = index * self.block_size
        return (parent_key, tuple(request.token_ids_between(start, start + self.block_size)))

    def _cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The keyed blocks the request's tokens start with, and the last one's key hash. The
        last token is always left to compute (its logits are needed), so its block is never
        a shared one. A request that wants its prompt's log-probabilities takes none: it
        needs the logits of every prompt position (as vLLM does)."""
        blocks: list[int] = []
        parent_key = _NO_PARENT
        if not self.prefix_caching or request.needs_prompt_logprobs:
            return blocks, parent_key
        for index in range((request.num_tokens - 1) // self.block_size):
            key = self._key(parent_key, request, index)
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
            parent_key = hash(key)
        return blocks, parent_key
