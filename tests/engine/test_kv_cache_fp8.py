"""--kv-cache-dtype fp8: the cache holds float8 e4m3 (a quarter of float32's bytes, half of
bf16's), attention reads it as the model's dtype, and generations stay close to the
model's: the tiny model's greedy tokens are, step by step, mostly transformers' choice after
the same tokens, as a cache read wrong (or not at all) would not make them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import run_engine, stepwise_agreement


@pytest.fixture(scope="module")
def diverse_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    directory = tmp_path_factory.mktemp("tiny-diverse")
    model = save_tiny_llama(
        directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2
    )
    return directory, model


def engine(directory: Path, kv_cache_dtype: str) -> LLMEngine:
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        block_size=4,
        kv_cache_memory_gb=0.001,
        kv_cache_dtype=kv_cache_dtype,
    )
    return LLMEngine(config)


def test_fp8_cache_holds_four_times_float32s_tokens_and_generates_alike(
    diverse_tiny: tuple[Path, LlamaForCausalLM],
) -> None:
    directory, hf_model = diverse_tiny
    fp8, model_dtype = engine(directory, "fp8"), engine(directory, "auto")
    assert fp8.runner.kv_dtype == torch.float8_e4m3fn
    assert fp8.runner.model.layers[0].self_attn.cache.key.dtype == torch.float8_e4m3fn
    assert fp8.runner.num_kv_blocks // 4 == model_dtype.runner.num_kv_blocks
    prompts = random_prompts(8)
    ours = run_engine(fp8, prompts, max_tokens=16)
    agreement = stepwise_agreement(hf_model, prompts, ours)
    print(f"\nfp8 KV cache: {agreement:.2f} of greedy tokens are transformers' choice")
    assert agreement >= 0.6
