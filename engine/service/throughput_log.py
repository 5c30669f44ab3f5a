"""A periodic log line of what the engine is doing, as operators of vLLM are used to:
prompt and generation tokens per second, requests running and waiting, KV cache in use,
and the share of prompt tokens found in the prefix cache."""

from __future__ import annotations

import logging
import time

from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class ThroughputLog:
    def __init__(self, engine: LLMEngine, interval_s: float) -> None:
        """``interval_s``: seconds between lines; 0 or less logs none."""
        self.engine = engine
        self.interval_s = interval_s
        self._since = time.monotonic()
        self._last = engine.stats()  # its counters, to take the next line's differences from

    def maybe_log(self) -> None:
        """Log the rates since the last line once ``interval_s`` has passed, unless idle."""
        now = time.monotonic()
        elapsed = now - self._since
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        stats, last = self.engine.stats(), self._last
        self._since, self._last = now, stats
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generated = stats.num_generated_tokens - last.num_generated_tokens
        hits = stats.num_cached_prompt_tokens - last.num_cached_prompt_tokens
        if prompt == 0 and generated == 0:
            return  # idle: nothing worth a line
        used = 1 - stats.num_free_blocks / stats.num_total_blocks
        logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, %d running, %d waiting, "
            "KV cache %.1f%% used, prefix cache hits %.1f%% of prompt tokens",
            prompt / elapsed,
            generated / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * used,
            100 * hits / max(hits + prompt, 1),
        )
