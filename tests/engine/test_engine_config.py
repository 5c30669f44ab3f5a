"""Engine options that change what servers are told."""

from __future__ import annotations

from pathlib import Path

from engine.__main__ import parse_args
from engine.config import EngineConfig, from_arguments
from engine.llm_engine import LLMEngine
from tests.random_checkpoint import save_tiny_llama


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
