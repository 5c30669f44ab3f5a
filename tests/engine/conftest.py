"""The tiny Llama that the engine tests of overlapped steps and sampling parameters share."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from tandem.testing.random_checkpoint import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A tiny GQA Llama checkpoint directory and its transformers model (modules with a
    ``tiny`` of their own use theirs)."""
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model
