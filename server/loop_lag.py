"""How late this server's event loop runs what is ready: a task that asks to wake every
``INTERVAL_S`` and records how much later it woke (``tandem:event_loop_lag_seconds``).

Every hop of a request through a server waits in its one event loop: the request's arrival,
the engine's outputs read from the socket and handed to their requests, each chunk written.
Under load the loop is busy with every stream's tokens, and each of those hops waits behind
them; this histogram shows that wait apart from the engine's.
"""

from __future__ import annotations

import asyncio
import time

from server.metrics import ServerMetrics

INTERVAL_S = 0.05


async def sample_loop_lag(metrics: ServerMetrics) -> None:
    """Runs until cancelled."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(INTERVAL_S)
        late = time.monotonic() - asked - INTERVAL_S
        metrics.event_loop_lag.labels(metrics.model_name).observe(max(0.0, late))
