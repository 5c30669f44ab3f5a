"""GET /stats over data-parallel replicas: the live panel reads them as one engine."""

from __future__ import annotations

from protocol import EngineStats
from server.routes.stats import combined


def replica(pid: int, running: int, free: int, servers: int) -> EngineStats:
    return EngineStats(
        engine_pid=pid,
        engine_started_at=1.0,
        model_name="m",
        device="cuda:0",
        block_size=16,
        num_total_blocks=100,
        num_free_blocks=free,
        num_running=running,
        num_waiting=1,
        num_finished=10,
        num_prompt_tokens=1000,
        num_cached_prompt_tokens=500,
        num_generated_tokens=2000,
        num_connected_servers=servers,
    )


def test_replicas_counts_add_up_and_servers_are_not_counted_twice() -> None:
    both = combined([replica(1, 3, 40, 2), replica(2, 5, 10, 2)])
    assert (both.num_running, both.num_waiting, both.num_finished) == (8, 2, 20)
    assert (both.num_total_blocks, both.num_free_blocks) == (200, 50)
    assert (both.num_prompt_tokens, both.num_generated_tokens) == (2000, 4000)
    assert both.num_connected_servers == 2  # each server connects to every replica
    assert both.engine_pid == 1
