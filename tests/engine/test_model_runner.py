"""The model runner's start-up facts (the cache it sized, the context length it allows) and
the choice of backend, on the CPU."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.backends import BACKENDS, create_backend
from engine.config import EngineConfig, add_arguments, from_arguments
from engine.llm_engine import LLMEngine
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy, run_engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def make_engine(directory: Path, **overrides: int | str | None) -> LLMEngine:
    settings = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


def test_max_model_len_is_capped_by_the_cache(tiny: tuple[Path, HFLlama]) -> None:
    """The model's 512 positions, but 30 blocks of 4 tokens: one length, everywhere."""
    engine = make_engine(tiny[0], num_kv_blocks=30)
    assert engine.runner.num_kv_blocks == engine.block_manager.num_blocks == 30
    assert engine.runner.max_model_len == engine.max_model_len == 120
    assert engine.handshake_reply().max_model_len == 120


def test_max_model_len_beyond_the_cache_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    with pytest.raises(ValueError, match="max_model_len 200 exceeds the KV cache's 120 tokens"):
        make_engine(tiny[0], num_kv_blocks=30, max_model_len=200)
    assert make_engine(tiny[0], num_kv_blocks=30, max_model_len=100).max_model_len == 100


def test_an_unknown_backend_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    with pytest.raises(ValueError, match="unknown backend 'cudnn', not one of torch, triton"):
        make_engine(tiny[0], backend="cudnn")


def test_the_backends_old_name_still_names_it(tiny: tuple[Path, HFLlama]) -> None:
    """``attention_backend`` (``--attention-backend``), ``backend``'s name before it chose
    every kernel, is taken for it, as a keyword and as a flag."""
    assert EngineConfig(attention_backend="triton").backend == "triton"
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    for flag in ("--attention-backend", "--backend"):
        assert from_arguments(EngineConfig, parser.parse_args([flag, "torch"])).backend == "torch"
    with pytest.raises(ValueError, match="attention_backend is backend's old name"):
        EngineConfig(backend="torch", attention_backend="triton")
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        make_engine(tiny[0], attention_backend="cudnn")
    assert make_engine(tiny[0], attention_backend="torch").runner.backend.name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(BACKENDS) == {"torch", "triton"}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_backend("triton", torch.device("cpu"))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter; tests/gpu runs these kernels on CUDA",
)
def test_triton_backend_generates_as_transformers(tiny: tuple[Path, HFLlama]) -> None:
    """--backend triton through the whole engine: chunked prefills, mixed steps
    (the prefill kernel) and pure decode steps (the decode kernel), run by Triton's CPU
    interpreter."""
    directory, hf_model = tiny
    engine = make_engine(directory, backend="triton", max_num_seqs=4, max_num_batched_tokens=16)
    prompts = random_prompts(3)
    assert run_engine(engine, prompts, max_tokens=6) == [hf_greedy(hf_model, p, 6) for p in prompts]
