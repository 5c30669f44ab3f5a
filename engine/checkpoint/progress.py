"""Progress of a weight load: a bar on a terminal, a log line elsewhere, nothing when quick."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger("engine.checkpoint")

# A load quicker than this shows nothing; a longer one shows its bar from this point on.
QUIET_SECONDS = 1.0

Item = TypeVar("Item")


def with_progress(items: Iterator[Item], total: int | None, name: str) -> Iterator[Item]:
    """Yield `items`, showing how far the load of `name` has come."""
    start = time.monotonic()
    count = 0
    # Off a terminal (a server's log, CI) a bar would write a line per redraw: log once instead.
    on_terminal = sys.stderr.isatty()
    with tqdm(
        items,
        total=total,
        desc=f"loading {name}",
        unit=" tensors",
        delay=QUIET_SECONDS,
        disable=not on_terminal,
        file=sys.stderr,
    ) as bar:
        for item in bar:
            count += 1
            yield item
    elapsed = time.monotonic() - start
    if not on_terminal and elapsed >= QUIET_SECONDS:
        logger.info("loaded %d tensors of %s in %.1f s", count, name, elapsed)
