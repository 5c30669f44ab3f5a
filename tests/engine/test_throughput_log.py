"""The engine's periodic throughput line."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.service.throughput_log import ThroughputLog
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import run_engine


@pytest.fixture
def engine(tmp_path: Path) -> LLMEngine:
    save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_gb=0.01))


def test_a_line_of_rates_after_work_and_none_when_idle(
    engine: LLMEngine, caplog: pytest.LogCaptureFixture
) -> None:
    log = ThroughputLog(engine, interval_s=1e-9)
    prompts = random_prompts(3)
    run_engine(engine, prompts, max_tokens=5)
    assert engine.scheduler.num_prefill_tokens == sum(len(p) for p in prompts)
    assert engine.num_generated_tokens == 3 * 5
    with caplog.at_level(logging.INFO, logger="engine.service.throughput_log"):
        log.maybe_log()
        log.maybe_log()  # nothing happened since the first line
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    match = re.fullmatch(
        r"prompt ([\d.]+) tok/s, generation ([\d.]+) tok/s, 0 running, 0 waiting, "
        r"KV cache 0\.0% used, prefix cache hits 0\.0% of prompt tokens",
        line,
    )
    assert match is not None, line
    assert float(match[1]) > float(match[2]) > 0  # more prompt tokens than generated ones


def test_interval_zero_logs_nothing(engine: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    log = ThroughputLog(engine, interval_s=0)
    run_engine(engine, random_prompts(2), max_tokens=3)
    with caplog.at_level(logging.INFO, logger="engine.service.throughput_log"):
        log.maybe_log()
    assert not caplog.records
