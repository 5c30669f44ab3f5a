"""Data parallelism in the server: one ``EngineClient`` per engine replica, a replica per request.

Every replica serves the same model (checked at the handshake). Each request goes to one of the
replicas connected now: the one with the fewest of this server's requests in flight (ties taken
in turn), unless the prompt's leading token blocks were last sent to another replica that is not
much busier than that (prefix affinity: a conversation's next turn, or a prompt sharing a long
prefix, finds its prefix in that replica's cache). The load is counted here, from this server's
own requests, because it is exact and free; with several servers, each spreads its own share.

A replica that dies fails only its own requests in flight (its ``EngineClient`` does that), and
new requests go to the others; its client reconnects and handshakes by itself when an engine
comes back at its address, and from then on it is chosen again.

The pool owns this server's ``ServerMetrics`` (server/generation.py times each request with it,
/metrics renders it with every replica's stats): one set of latency histograms per server
process, whichever replica served. With CURVE, every replica is reached with the same keys: the
replicas share one engine key pair, and this server's public key is authorized by each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from protocol import (
    Embedding,
    EngineStats,
    HandshakeReply,
    RequestOutput,
    SamplingParams,
    Scheduling,
)
from server.engine_client import (
    ENGINE_SILENCE_S,
    CurveKeys,
    EngineClient,
    EngineUnavailable,
    HandshakeError,
    model_differences,
)
from server.metrics import ServerMetrics

# Prefix affinity keys the prompt's leading blocks of this many tokens (the engine's default
# block size; any size identifies a shared prefix), at most this many blocks of them.
AFFINITY_BLOCK_TOKENS = 16
_AFFINITY_MAX_BLOCKS = 256
# Prefixes remembered, least recently used forgotten first (a few MB).
_AFFINITY_CAPACITY = 100_000
# Affinity yields to the least loaded replica once the preferred one has more than this many
# more requests in flight, or a quarter more, whichever is larger.
_AFFINITY_MAX_EXTRA_REQUESTS = 4


@dataclasses.dataclass(eq=False)
class Replica:
    """One engine replica and this server's requests in flight on it."""

    index: int
    client: EngineClient
    in_flight: int = 0

    def __str__(self) -> str:
        return f"replica {self.index} ({self.client.address})"


class PrefixAffinity:
    """Which replica was last sent each prompt prefix, by chained hashes of its full blocks."""

    def __init__(self, capacity: int = _AFFINITY_CAPACITY) -> None:
        self._capacity = capacity
        self._replica_of: OrderedDict[int, int] = OrderedDict()

    @staticmethod
    def keys(prompt_ids: Sequence[int]) -> list[int]:
        """One key per full leading block; each covers its block and all before it."""
        keys: list[int] = []
        key = 0
        full = min(len(prompt_ids) // AFFINITY_BLOCK_TOKENS, _AFFINITY_MAX_BLOCKS)
        for start in range(0, full * AFFINITY_BLOCK_TOKENS, AFFINITY_BLOCK_TOKENS):
            key = hash((key, *prompt_ids[start : start + AFFINITY_BLOCK_TOKENS]))
            keys.append(key)
        return keys

    def lookup(self, keys: list[int]) -> int | None:
        """The replica last sent the longest of these prefixes, if any was."""
        for key in reversed(keys):
            replica = self._replica_of.get(key)
            if replica is not None:
                return replica
        return None

    def record(self, keys: list[int], replica: int) -> None:
        for key in keys:
            self._replica_of[key] = replica
            self._replica_of.move_to_end(key)
        while len(self._replica_of) > self._capacity:
            self._replica_of.popitem(last=False)


class EnginePool:
    """Sends each request to one engine replica and hands it the outputs, like one client;
    ``metrics`` times each request (server/generation.py observes, /metrics reads)."""

    def __init__(
        self,
        addresses: Sequence[str],
        client_name: str = "tandem-server",
        curve: CurveKeys | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("at least one engine address is needed")
        self.metrics = ServerMetrics()
        self.replicas = [
            Replica(index, EngineClient(address, client_name, curve))
            for index, address in enumerate(addresses)
        ]
        self._affinity = PrefixAffinity()
        self._turn = itertools.count()  # breaks ties between equally loaded replicas

    async def connect(self, timeout: float) -> HandshakeReply:
        """Connects to every replica and handshakes, each within ``timeout`` s; their models
        must be the same. Raises ``HandshakeError``."""
        replies = await asyncio.gather(
            *(replica.client.connect(timeout) for replica in self.replicas)
        )
        first = replies[0]
        for replica, reply in zip(self.replicas[1:], replies[1:], strict=True):
            differences = model_differences(first, reply)
            if differences:
                raise HandshakeError(
                    f"the engine replicas do not serve the same model: {self.replicas[0]} and "
                    f"{replica} differ in {', '.join(differences)} ({first.model_name} and "
                    f"{reply.model_name}); start every replica with the same model and options"
                )
        self.metrics.model_name = first.model_name
        # A request's choices may spread over the replicas, so only more than they all take
        # at once is never admitted.
        bounds = [reply.max_requests_at_once for reply in replies]
        total = sum(bound for bound in bounds if bound is not None)
        return dataclasses.replace(first, max_requests_at_once=None if None in bounds else total)

    async def close(self) -> None:
        await asyncio.gather(*(replica.client.close() for replica in self.replicas))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        scheduling: Scheduling,
        merge_outputs: bool = False,
        observe: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``EngineClient.generate`` on the replica chosen for the prompt. Raises
        ``EngineUnavailable`` (naming the replica) if none is connected or this one is lost."""
        replica = self._choose(prompt_token_ids)
        replica.in_flight += 1
        try:
            outputs = replica.client.generate(
                request_id, prompt_token_ids, sampling, scheduling, merge_outputs, observe
            )
            async with aclosing(outputs):
                async for output in outputs:
                    yield output
        except EngineUnavailable as exc:
            raise EngineUnavailable(f"replica {replica.index}: {exc}") from exc
        finally:
            replica.in_flight -= 1

    def fail_requests(self, error: Exception) -> None:
        """Ends every request in flight on every replica with ``error``."""
        for replica in self.replicas:
            replica.client.fail_requests(error)

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> Embedding:
        """``EngineClient.embed`` on the replica chosen for the prompt."""
        replica = self._choose(prompt_token_ids)
        replica.in_flight += 1
        try:
            return await replica.client.embed(request_id, prompt_token_ids)
        except EngineUnavailable as exc:
            raise EngineUnavailable(f"replica {replica.index}: {exc}") from exc
        finally:
            replica.in_flight -= 1

    @property
    def queue_full(self) -> bool:
        """Whether every connected replica's queue is full, by its last stats (each sends them
        the moment that changes): a request now would be refused (server/admission_gate.py)."""
        ready = [replica for replica in self.replicas if replica.client.ready]
        return bool(ready) and all(replica.client.queue_full for replica in ready)

    async def stats(self, timeout: float) -> list[EngineStats | None]:
        """Each replica's stats, None for one not answering within ``timeout`` s."""
        return await asyncio.gather(*(replica.client.stats(timeout) for replica in self.replicas))

    def _choose(self, prompt_token_ids: list[int]) -> Replica:
        ready = [replica for replica in self.replicas if replica.client.ready]
        if not ready:
            addresses = ", ".join(replica.client.address for replica in self.replicas)
            raise EngineUnavailable(f"no engine is connected (at {addresses})")
        # An engine connected but silent (stuck, or its host gone without a word) would keep
        # a request waiting for ever, and its frames piling up unsent: another, else a 503.
        ready = [replica for replica in ready if replica.client.alive]
        if not ready:
            raise EngineUnavailable(
                f"no engine has been heard from for {ENGINE_SILENCE_S:.0f} s (its heartbeat)"
            )
        if len(self.replicas) == 1:
            return ready[0]
        # A replica whose queue is full would refuse: another one, if any is not.
        ready = [replica for replica in ready if not replica.client.queue_full] or ready
        turn = next(self._turn)
        least = min(ready, key=lambda r: (r.in_flight, (r.index - turn) % len(self.replicas)))
        keys = self._affinity.keys(prompt_token_ids)
        preferred = self._affinity.lookup(keys)
        chosen = least
        if preferred is not None:
            candidate = self.replicas[preferred]
            allowed = max(_AFFINITY_MAX_EXTRA_REQUESTS, least.in_flight // 4)
            # Only among the replicas left above: not a silent one, nor a full one while
            # another is not.
            if candidate in ready and candidate.in_flight - least.in_flight <= allowed:
                chosen = candidate
        self._affinity.record(keys, chosen.index)
        return chosen
