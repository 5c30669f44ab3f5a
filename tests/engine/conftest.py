"""The tiny Llama that the engine tests of overlapped steps and sampling parameters share, and
the unrelated draft model of the speculation tests."""

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


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of the tiny checkpoints' vocabulary, unlike every family's model: its
    drafts are nearly all wrong."""
    directory = tmp_path_factory.mktemp("other-draft")
    save_tiny_llama(
        directory,
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
    )
    return directory
