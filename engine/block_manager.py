"""Hands out fixed-size KV cache blocks to requests and takes them back."""

from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs to hold the K/V of all its tokens."""
        return max(0, self.blocks_for(request.num_tokens) - len(request.block_ids))

    def can_grow(self, request: Request) -> bool:
        return self.missing_blocks(request) <= len(self._free)

    def grow(self, request: Request) -> None:
        """Give ``request`` enough blocks for every token it has now."""
        missing = self.missing_blocks(request)
        if missing > len(self._free):
            raise RuntimeError("grow() without can_grow(): the scheduler must check first")
        request.block_ids.extend(self._free.popleft() for _ in range(missing))

    def release(self, request: Request) -> None:
        self._free.extend(request.block_ids)
        request.block_ids = []
        request.num_cached_tokens = 0
