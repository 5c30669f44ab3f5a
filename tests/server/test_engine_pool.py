"""Prefix affinity's memory: which replica was last sent each prompt prefix; which replica
a request goes to."""

from __future__ import annotations

import asyncio
import time

import pytest

from protocol import EngineStats
from server.engine_client import ENGINE_SILENCE_S, EngineUnavailable
from server.engine_pool import AFFINITY_BLOCK_TOKENS, EnginePool, PrefixAffinity

BLOCK = AFFINITY_BLOCK_TOKENS


def test_a_longer_prompt_finds_the_replica_of_its_longest_known_prefix() -> None:
    affinity = PrefixAffinity()
    system = list(range(2 * BLOCK))
    conversation = system + [7] * BLOCK
    other_conversation = system + [9] * BLOCK
    affinity.record(affinity.keys(conversation), 1)
    affinity.record(affinity.keys(other_conversation), 0)  # the system prompt's blocks: 0
    next_turn = conversation + [8] * (BLOCK + 3)
    assert affinity.lookup(affinity.keys(next_turn)) == 1
    assert affinity.lookup(affinity.keys(system + [5] * BLOCK)) == 0
    assert affinity.lookup(affinity.keys([9] * 4 * BLOCK)) is None
    assert affinity.keys(list(range(BLOCK - 1))) == []  # no full block: no affinity


def test_the_least_recently_used_prefixes_are_forgotten() -> None:
    affinity = PrefixAffinity(capacity=2 * 3)
    prompts = [[p] * 2 * BLOCK for p in range(3)]  # two keys each
    for replica, prompt in enumerate(prompts):
        affinity.record(affinity.keys(prompt), replica)
    affinity.record(affinity.keys(prompts[0]), 0)  # used again: now the most recent
    affinity.record(affinity.keys([5] * 2 * BLOCK), 1)  # pushes the least recent out
    assert affinity.lookup(affinity.keys(prompts[0])) == 0
    assert affinity.lookup(affinity.keys(prompts[1])) is None
    assert affinity.lookup(affinity.keys(prompts[2])) == 2


def test_a_silent_engine_gets_no_new_request() -> None:
    """An engine connected but not heard from for ENGINE_SILENCE_S (stuck, or its host gone
    without closing the connection) would keep a request waiting for ever: the pool refuses
    it at once (a 503), and sends again once it hears the engine."""
    pool = EnginePool(["tcp://127.0.0.1:9"])  # never connected: its state set by hand
    client = pool.replicas[0].client
    client._ready = True
    client.last_heard = time.monotonic() - ENGINE_SILENCE_S - 1
    with pytest.raises(EngineUnavailable, match="heard from"):
        pool._choose([1, 2, 3])
    client.last_heard = time.monotonic()  # a heartbeat
    assert pool._choose([1, 2, 3]) is pool.replicas[0]
    asyncio.run(pool.close())


def test_prefix_affinity_never_chooses_a_silent_or_full_replica() -> None:
    """The replica that last saw a prompt's prefix gets it again only if it could take it:
    not one silent past its heartbeat, nor one whose queue is full while another's is not."""
    pool = EnginePool(["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"])  # states set by hand
    first, second = (replica.client for replica in pool.replicas)
    for client in (first, second):
        client._ready = True
        client.last_heard = time.monotonic()
    prompt = list(range(2 * BLOCK))
    pool._affinity.record(pool._affinity.keys(prompt), 0)
    assert pool._choose(prompt) is pool.replicas[0]  # its prefix's replica, both idle
    first.last_heard = time.monotonic() - ENGINE_SILENCE_S - 1
    assert pool._choose(prompt) is pool.replicas[1]
    first.last_heard = time.monotonic()
    first.last_stats = EngineStats(1, 0.0, "m", "cpu", 16, 64, 64, 0, 8, 0, queue_full=True)
    assert pool._choose(prompt) is pool.replicas[1]
    asyncio.run(pool.close())
