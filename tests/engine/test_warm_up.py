"""The start-up warm-up (engine/warm_up.py) leaves the engine exact: its fake requests'
writes into block 0 and its sampled tokens change nothing a real request computes.
(tests/gpu/test_warm_up.py checks on CUDA that it compiles every kernel variant.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.warm_up import warm_up
from tests.random_checkpoint import random_prompts
from tests.reference import hf_greedy, run_engine


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
    warm_up(engine.runner, max_num_seqs=8)  # CUDA runs it at start-up; the CPU does not
    prompts = random_prompts(8)
    assert run_engine(engine, prompts, max_tokens=16) == [
        hf_greedy(hf_model, p, 16) for p in prompts
    ]
    assert engine.block_manager.num_free_blocks == 64
