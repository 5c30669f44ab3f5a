"""Prefix affinity's memory: which replica was last sent each prompt prefix."""

from __future__ import annotations

from server.engine_pool import AFFINITY_BLOCK_TOKENS, PrefixAffinity

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
