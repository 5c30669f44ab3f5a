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
        self._prompt_tokens = engine.scheduler.num_prefill_tokens
        self._generated_tokens = engine.num_generated_tokens
        self._hit_tokens = engine.block_manager.num_hit_tokens

    def maybe_log(self) -> None:
        """Log the rates since the last line once ``interval_s`` has passed, unless idle."""
        now = time.monotonic()
        elapsed = now - self._since
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        prompt = self.engine.scheduler.num_prefill_tokens - self._prompt_tokens
        generated = self.engine.num_generated_tokens - self._generated_tokens
        hits = self.engine.block_manager.num_hit_tokens - self._hit_tokens
        self._since, self._prompt_tokens = now, self.engine.scheduler.num_prefill_tokens
        self._generated_tokens = self.engine.num_generated_tokens
        self._hit_tokens = self.engine.block_manager.num_hit_tokens
        if prompt == 0 and generated == 0:
            return  # idle: nothing worth a line
        stats = self.engine.stats()
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
