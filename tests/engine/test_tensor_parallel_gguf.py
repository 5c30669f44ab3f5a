"""Tensor parallelism reading a quantized GGUF file in slices, on the CPU over gloo.

Apart from tests/engine/test_tensor_parallel.py: its engines live as long as its module, and a
process has one default process group at a time.
"""

from __future__ import annotations

from pathlib import Path

from engine.llm_engine import LLMEngine
from tandem.testing.reference import run_engine
from tests.engine.test_gguf_families import random_model, write_gguf
from tests.engine.test_tensor_parallel import engine_config


def test_a_quantized_gguf_file_splits_as_it_loads_whole(tmp_path: Path) -> None:
    """Each rank dequantizes only its rows of the quantized matrices (llama's Q and K rows
    restored head by head) and cuts its columns from the rest: TP=2 on a file of mixed
    quantization types generates TP=1's greedy tokens."""
    path = write_gguf(tmp_path / "llama.gguf", random_model("llama"), "llama", mixed_types=True)
    prompts = [[5, 60, 7], list(range(100, 140))]  # ids of the byte-level vocabulary
    one_rank = run_engine(LLMEngine(engine_config(path, 1)), prompts, max_tokens=10)
    engine = LLMEngine(engine_config(path, 2))
    try:
        assert run_engine(engine, prompts, max_tokens=10) == one_rank
    finally:
        engine.close()
