"""GET /stats: the engine's state as the web chat's live panel shows it, once a second.

The engine's own numbers (protocol's ``EngineStats``; with data-parallel replicas, theirs
combined) plus the two ratios a person reads off them. Throughputs are differences between
two readings, so the page takes them from its consecutive polls: a route that kept the last
reading would mix up several pages.
"""

from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol import EngineStats
from server.engine_pool import EnginePool
from server.errors import ApiError

# An engine slower than this to answer shows as offline (its steps may take a while on CPU).
_STATS_TIMEOUT_S = 2.0


# Counts that add up over replicas; the rest of EngineStats names one engine.
_SUMMED = (
    "num_total_blocks",
    "num_free_blocks",
    "num_running",
    "num_waiting",
    "num_finished",
    "num_prompt_tokens",
    "num_cached_prompt_tokens",
    "num_generated_tokens",
    "num_preemptions",
    "num_draft_tokens",
    "num_accepted_tokens",
)


def combined(replicas: list[EngineStats]) -> EngineStats:
    """The replicas' state as one engine's: their counts summed, the first one's identity,
    and as connected servers the most any replica has (each server connects to every one)."""
    return dataclasses.replace(
        replicas[0],
        **{name: sum(getattr(s, name) for s in replicas) for name in _SUMMED},
        num_connected_servers=max(s.num_connected_servers for s in replicas),
    )


class Stats:
    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    async def stats(self, request: Request) -> Response:
        answering = [s for s in await self._pool.stats(_STATS_TIMEOUT_S) if s is not None]
        if not answering:
            raise ApiError(503, "The engine is not answering.", code="engine_unavailable")
        stats = combined(answering)
        looked_up = stats.num_prompt_tokens + stats.num_cached_prompt_tokens
        return JSONResponse(
            {
                **dataclasses.asdict(stats),
                "replicas_answering": len(answering),
                "time": time.time(),  # when read, for the page's rates
                "kv_cache_usage": 1 - stats.num_free_blocks / max(stats.num_total_blocks, 1),
                # Since the engine started: the share of prompt tokens the cache held.
                "prefix_cache_hit_rate": stats.num_cached_prompt_tokens / max(looked_up, 1),
            },
            headers={"Cache-Control": "no-store"},
        )
