"""A token bucket: how many requests a client may send, refilled at a steady rate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """Up to ``capacity`` tokens, ``rate`` more a second; each request takes one."""

    capacity: float
    rate: float
    tokens: float = field(init=False)
    updated: float = field(init=False)

    def __post_init__(self) -> None:
        if self.capacity <= 0 or self.rate <= 0:
            raise ValueError("capacity and rate must be positive")
        self.tokens = self.capacity
        self.updated = time.monotonic()

    def refill(self, now: float) -> None:
        """Add the tokens earned since the last update, up to the capacity."""
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def try_take(self, count: float = 1.0) -> bool:
        """Take ``count`` tokens if there are enough; whether it did."""
        self.refill(time.monotonic())
        if self.tokens < count:
            return False
        self.tokens -= count
        return True

    def wait_time(self, count: float = 1.0) -> float:
        """Seconds until ``count`` tokens are there (0 if they are now)."""
        self.refill(time.monotonic())
        missing = count - self.tokens
        return max(0.0, missing / self.rate)


class RateLimiter:
    """One bucket per client, made on the client's first request."""

    def __init__(self, capacity: float, rate: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.buckets: dict[str, TokenBucket] = {}

    def bucket(self, client: str) -> TokenBucket:
        if client not in self.buckets:
            self.buckets[client] = TokenBucket(self.capacity, self.rate)
        return self.buckets[client]

    def allow(self, client: str) -> bool:
        """Whether ``client`` may send a request now (it takes a token if so)."""
        return self.bucket(client).try_take()

    def retry_after(self, client: str) -> float:
        """Seconds ``client`` should wait before its next request."""
        return self.bucket(client).wait_time()

    def forget_idle(self, idle_seconds: float) -> int:
        """Drop the buckets of clients idle for ``idle_seconds``; how many were dropped."""
        now = time.monotonic()
        idle = [c for c, b in self.buckets.items() if now - b.updated > idle_seconds]
        for client in idle:
            del self.buckets[client]
        return len(idle)
