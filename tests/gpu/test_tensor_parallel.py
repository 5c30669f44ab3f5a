"""Tensor parallelism over NCCL on two or four GPUs: the tiny families' greedy tokens, with the
decode steps in CUDA graphs (their all-reduces captured), equal transformers' in float32; and
the 8B's real layer shapes (two layers) at TP=2 and TP=1, both equal to transformers', so to
each other. The small all-reduces go through symmetric memory (one kernel), the rest through
NCCL. The first
engine of the process maps symmetric memory; the later ones run on NCCL alone, and start
(``symmetric_all_reduce.mappings_in_this_process`` says why): ``-k gpt-oss`` alone in a
process takes gpt-oss's biased one-row all-reduce. Skipped on fewer GPUs than a case's
ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed import symmetric_all_reduce
from engine.llm_engine import LLMEngine
from tandem.testing.random_checkpoint import random_prompts, save_random_model
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_tensor_parallel import CASES

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_with_graphs(case: str, tmp_path: Path) -> None:
    name, size, changes = CASES[case]
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    hf_model = saved_tiny_model(name, tmp_path, **changes)
    first_in_process = symmetric_all_reduce.mappings_in_this_process == 0
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
        # The first engine's small all-reduces take one kernel, not NCCL's ring.
        assert (engine.runner.tp.symmetric_all_reduce is not None) == first_in_process
        prompts = random_prompts(8)
        ours = run_engine(engine, prompts, max_tokens=24)
        # Alone, its decode steps are one row: the row-parallel products' one-row kernel,
        # which all-reduces its own output where the one-kernel all-reduce is mapped (a
        # bias, gpt-oss's o projection's, added once: rank 0's).
        alone = run_engine(engine, prompts[:1], max_tokens=24)
    finally:
        engine.close()
    expected = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours == expected
    assert alone == expected[:1]


def test_real_shaped_greedy_tokens_equal_one_gpu_and_transformers(tmp_path: Path) -> None:
    """The 8B's layers (hidden 4096, 32 query and 8 KV heads of 128, MLP 14,336, vocabulary
    128,256), two of them, in float32: each rank's products, all-reduces and the LM head's
    gather at a deployment's sizes (the tiny families' are a few dozen wide)."""
    hf_model = save_random_model(tmp_path, "llama-3.1-8b", torch.float32, num_hidden_layers=2)
    prompts = random_prompts(6, seed=3)
    expected = [hf_greedy(hf_model, p, 16) for p in prompts]
    for size in (2, 1):  # two ranks first: the process's first engine maps symmetric memory
        engine = LLMEngine(
            EngineConfig(
                model=str(tmp_path),
                device="cuda",
                dtype="float32",
                kv_cache_memory_gb=0.2,
                max_num_seqs=8,
                max_model_len=512,
                tensor_parallel_size=size,
            )
        )
        try:
            assert engine.runner.decode_graphs is not None
            assert run_engine(engine, prompts, max_tokens=16) == expected, f"TP={size}"
        finally:
            engine.close()
