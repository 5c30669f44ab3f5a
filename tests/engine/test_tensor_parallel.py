"""Tensor parallelism on the CPU: the engine in this process as rank 0, its workers real
processes it starts, over torch.distributed's gloo backend.

Every family's tiny checkpoint at TP=2, and one at TP=4 (more ranks than KV heads, so KV
heads are replicated; a vocabulary that does not divide by 4, so the last rank's is padded):
the logits of a packed prefill equal TP=1's and transformers', and greedy generations equal
transformers' token for token. A quantized GGUF file, read in slices, generates as it does
whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tandem.testing.random_checkpoint import VOCAB, random_prompts
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_model_parity import hf_prefill_logits

# One configuration of each family (tests/engine/test_model_families.py has them all), at TP=2;
# OLMo 2, whose Q/K norms span every rank's heads, also at TP=4.
CASES = {
    "llama": ("llama-llama3-rope-untied", 2, {}),
    "mistral": ("mistral-sliding-window", 2, {}),
    "qwen2": ("qwen2-biases-tied", 2, {}),
    "qwen3": ("qwen3-wide-heads", 2, {}),
    "gemma3": ("gemma3-untied-softcap", 2, {}),
    "olmo2": ("olmo2-gqa", 2, {}),
    # Each expert's intermediate features split over the ranks (docs/multi-gpu.md).
    "qwen3-moe": ("qwen3-moe-dense-middle", 2, {}),
    "mixtral": ("mixtral", 2, {}),
    # Each rank's heads' sinks; the output projection's and the experts' down biases added
    # once over the ranks.
    "gpt-oss": ("gpt-oss", 2, {}),
    # 4 query heads and 2 KV heads over 4 ranks; 258 = 4 * 65 - 2 ids.
    "olmo2-tp4": ("olmo2-gqa", 4, {"vocab_size": VOCAB + 2}),
}


def engine_config(directory: Path, tensor_parallel_size: int) -> EngineConfig:
    return EngineConfig(
        model=str(directory),
        device="cpu",
        block_size=4,
        kv_cache_memory_gb=0.01,
        tensor_parallel_size=tensor_parallel_size,
    )


@pytest.fixture(scope="module", params=list(CASES))
def parallel(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, PreTrainedModel, LLMEngine]]:
    """A tiny checkpoint, its transformers model and a tensor-parallel engine on it."""
    name, size, changes = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = saved_tiny_model(name, directory, **changes)
    engine = LLMEngine(engine_config(directory, size))
    yield directory, hf_model, engine
    engine.close()


def prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    """The logits at each prompt's last token, the prompts prefilled in one packed step
    (rank 0 sends it to the workers as any step); the requests are then aborted."""
    for i, prompt in enumerate(prompts):
        engine.add_request(b"logits", str(i), prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    assert len(batch) == len(prompts)
    logits = engine.runner.forward(batch).logits.clone()
    assert engine.abort_client(b"logits") == len(prompts)
    return logits


def test_prefill_logits_equal_one_rank_and_transformers(
    parallel: tuple[Path, PreTrainedModel, LLMEngine],
) -> None:
    directory, hf_model, engine = parallel
    prompts = random_prompts(5, seed=2)  # lengths 1 to 64: past the sliding windows too
    ours = prefill_logits(engine, prompts)
    one_rank = prefill_logits(LLMEngine(engine_config(directory, 1)), prompts)
    last_tokens = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    theirs = hf_prefill_logits(hf_model, prompts)[last_tokens]
    torch.testing.assert_close(ours, one_rank, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_greedy_generation_equals_transformers(
    parallel: tuple[Path, PreTrainedModel, LLMEngine],
) -> None:
    _, hf_model, engine = parallel
    prompts = random_prompts(5)  # decodes and prefills in the same steps
    ours = run_engine(engine, prompts, max_tokens=10)
    assert ours == [hf_greedy(hf_model, p, 10) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    saved_tiny_model("llama-llama3-rope-untied", tmp_path)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="the number of attention heads divisible by 8"):
        LLMEngine(engine_config(tmp_path, 8))
