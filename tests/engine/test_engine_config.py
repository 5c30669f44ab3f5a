"""Engine options that change what servers are told."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.__main__ import parse_args
from engine.config import EngineConfig, from_arguments
from engine.llm_engine import LLMEngine
from protocol import SamplingDefaults
from tandem.testing.random_checkpoint import save_tiny_llama
from tandem.testing.reference import run_engine


def test_served_model_name_replaces_the_checkpoints(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = EngineConfig(
        model=str(tmp_path), device="cpu", kv_cache_memory_gb=0.01, served_model_name="my-model"
    )
    assert LLMEngine(config).handshake_reply().model_name == "my-model"
    args = parse_args(["--model", str(tmp_path), "--served-model-name", "my-model"])
    assert args.served_model_name == "my-model"
    assert parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_every_engine_option_is_a_flag_with_the_fields_default() -> None:
    assert from_arguments(EngineConfig, parse_args([])) == EngineConfig()
    args = parse_args(["--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5", "--no-overlap-steps"])
    config = from_arguments(EngineConfig, args)
    assert (config.max_num_seqs, config.kv_cache_memory_gb, config.overlap_steps) == (8, 0.5, False)
    assert parse_args(["--enforce-eager"]).enforce_eager is True


def test_the_default_batch_grows_with_the_gpus_tensor_parallelism_adds() -> None:
    assert EngineConfig(device="cpu").max_num_seqs == 256
    assert EngineConfig(device="cpu", tensor_parallel_size=4).max_num_seqs == 1024
    assert EngineConfig(device="cpu", tensor_parallel_size=4, max_num_seqs=64).max_num_seqs == 64
    args = parse_args(["--tensor-parallel-size", "2"])
    assert from_arguments(EngineConfig, args).max_num_seqs == 512


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    """As vLLM's --generation-config: auto (the checkpoint's), vllm (none), or a directory's.
    A value equal to transformers' own default is no recommendation (vLLM reads the file's
    difference from those); one the engine could not use is left out."""
    checkpoint = tmp_path / "model"
    save_tiny_llama(checkpoint, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    generation_config = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 50,  # transformers' default
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_new_tokens": 300,  # vLLM's default max_tokens
        "eos_token_id": 255,
    }
    (checkpoint / "generation_config.json").write_text(json.dumps(generation_config))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(
        # the last three unusable
        json.dumps({"top_k": 20, "top_p": 0, "temperature": "hot", "max_new_tokens": 0})
    )

    def defaults(generation_config: str) -> SamplingDefaults:
        config = EngineConfig(
            model=str(checkpoint),
            device="cpu",
            kv_cache_memory_gb=0.01,
            generation_config=generation_config,
        )
        return LLMEngine(config).handshake_reply().sampling_defaults

    assert defaults("auto") == SamplingDefaults(
        temperature=0.6, top_p=0.9, min_p=0.05, repetition_penalty=1.1, max_tokens=300
    )
    assert defaults("vllm") == SamplingDefaults()
    assert defaults(str(other)) == SamplingDefaults(top_k=20)
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        defaults(str(tmp_path))
    assert parse_args(["--generation-config", "vllm"]).generation_config == "vllm"


def test_dummy_load_format_needs_no_weight_files(tmp_path: Path) -> None:
    """vLLM's --load-format dummy: random weights of config.json's shape, for benchmarks of
    shapes whose files are not at hand; without it, the missing files are named."""
    save_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    (tmp_path / "model.safetensors").unlink()
    config = EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        LLMEngine(config)
    engine = LLMEngine(replace(config, load_format="dummy"))
    assert [len(tokens) for tokens in run_engine(engine, [[1, 2, 3]], max_tokens=4)] == [4]
