"""Tensor parallelism over NCCL on two GPUs: the tiny families' greedy tokens, with the decode
steps in CUDA graphs (their all-reduces captured), equal transformers' in float32; and the
engine runs the decode steps of a TP=2 model in graphs. Skipped on fewer than two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_tensor_parallel import CASES
from tests.random_checkpoint import random_prompts
from tests.reference import hf_greedy, run_engine

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("case", [c for c, (_, size, _) in CASES.items() if size == 2])
def test_greedy_tokens_equal_transformers_with_graphs(case: str, tmp_path: Path) -> None:
    name, size, changes = CASES[case]
    hf_model = saved_tiny_model(name, tmp_path, **changes)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            device="cuda",
            dtype="float32",
            kv_cache_memory_gb=0.05,
            max_num_seqs=8,
            tensor_parallel_size=size,
        )
    )
    try:
        assert engine.runner.decode_graphs is not None  # decode steps replay graphs
        prompts = random_prompts(8)
        ours = run_engine(engine, prompts, max_tokens=24)
    finally:
        engine.close()
    assert ours == [hf_greedy(hf_model, p, 24) for p in prompts]
