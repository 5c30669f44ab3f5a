"""The start-up warm-up (engine/execution/warm_up.py) leaves the engine exact: its fake requests'
writes into block 0 and its sampled tokens change nothing a real request computes.
(tests/gpu/test_warm_up.py checks on CUDA that it compiles every kernel variant.) And what
start-up made is frozen out of Python's full collections."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.execution.warm_up import warm_up
from engine.llm_engine import LLMEngine
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import hf_greedy, run_engine


@pytest.mark.parametrize(
    "speculative",
    [{}, {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}],
    ids=["plain", "ngram"],  # with speculation it also runs verify steps
)
def test_greedy_generation_after_warm_up_matches_transformers(
    tiny: tuple[Path, LlamaForCausalLM], speculative: dict[str, Any]
) -> None:
    directory, hf_model = tiny
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=4,
            max_num_seqs=8,
            max_model_len=128,
            num_kv_blocks=64,
            **speculative,
        )
    )
    # CUDA runs it at start-up; the CPU does not
    warm_up(engine.runner, max_num_seqs=8, max_num_batched_tokens=128)
    prompts = random_prompts(8)
    assert run_engine(engine, prompts, max_tokens=16) == [
        hf_greedy(hf_model, p, 16) for p in prompts
    ]
    assert engine.block_manager.num_free_blocks == 64


def test_start_up_objects_are_frozen_out_of_full_collections(
    tiny: tuple[Path, LlamaForCausalLM],
) -> None:
    """What start-up made is out of the collector's sight, so the first full collection
    after start walks only what requests made since: before, it walked every module's and
    the model's objects and stalled a fresh engine's step by 100-135 ms (H200 machine)."""
    directory, _ = tiny
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", block_size=4))
    tracked = len(gc.get_objects())  # the three generations, not the frozen ones
    assert gc.get_freeze_count() > 10_000 > tracked
    run_engine(engine, random_prompts(4), max_tokens=4)
    collected_over: list[int] = []

    def count_generation_2(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            collected_over.append(len(gc.get_objects(2)) + len(gc.get_objects(1)))

    gc.callbacks.append(count_generation_2)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(count_generation_2)
    assert collected_over and collected_over[0] < 10_000
