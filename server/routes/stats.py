"""GET /stats: the engine's state as the web chat's live panel shows it, once a second.

The engine's own numbers (protocol's ``EngineStats``) plus the two ratios a person reads
off them. Throughputs are differences between two readings, so the page takes them from
its consecutive polls: a route that kept the last reading would mix up several pages.
"""

from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.engine_client import EngineClient
from server.errors import ApiError

# An engine slower than this to answer shows as offline (its steps may take a while on CPU).
_STATS_TIMEOUT_S = 2.0


class Stats:
    def __init__(self, client: EngineClient) -> None:
        self._client = client

    async def stats(self, request: Request) -> Response:
        stats = await self._client.stats(_STATS_TIMEOUT_S)
        if stats is None:
            raise ApiError(503, "The engine is not answering.", code="engine_unavailable")
        looked_up = stats.num_prompt_tokens + stats.num_cached_prompt_tokens
        return JSONResponse(
            {
                **dataclasses.asdict(stats),
                "time": time.time(),  # when read, for the page's rates
                "kv_cache_usage": 1 - stats.num_free_blocks / max(stats.num_total_blocks, 1),
                # Since the engine started: the share of prompt tokens the cache held.
                "prefix_cache_hit_rate": stats.num_cached_prompt_tokens / max(looked_up, 1),
            },
            headers={"Cache-Control": "no-store"},
        )
