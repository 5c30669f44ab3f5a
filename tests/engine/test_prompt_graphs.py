"""Which prompt steps are captured as CUDA graphs (engine/execution/prompt_graphs.py), by the
model's size: the whole ladder up to a step's budget for a small model, whose eager prompt
steps wait on the host's launches; up to 512 tokens for a large one, whose device time hides
them. And which graph a step replays. The graphs themselves run in
tests/gpu/test_cuda_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends import create_backend
from engine.execution.prompt_graphs import (
    ALWAYS_CAPTURED_TOKENS,
    LARGE_PROMPT_GRAPH_SEQS,
    PROMPT_GRAPH_MAX_FLOPS,
    PROMPT_GRAPH_SEQS,
    PROMPT_GRAPH_TOKENS,
    least_graph,
    prompt_graph_lengths,
)
from engine.models import build_model, load_checkpoint
from engine.roofline import ModelCost
from tandem.testing.random_checkpoint import save_random_config


def shape_cost(shape: str, directory: Path) -> ModelCost:
    """The cost of ``shape``'s model, built on the meta device."""
    save_random_config(directory, shape)
    config = load_checkpoint(str(directory)).config
    meta = torch.device("meta")
    model = build_model(config, create_backend("torch", meta), 1, meta, torch.bfloat16)
    return ModelCost.of_model(model, torch.bfloat16)


@pytest.mark.parametrize(
    ("shape", "largest"),
    [("qwen3-0.6b", 8192), ("llama-3.2-1b", 4096), ("llama-3.1-8b", 512)],
)
def test_the_ladder_goes_on_while_a_step_computes_little(
    shape: str, largest: int, tmp_path: Path
) -> None:
    cost = shape_cost(shape, tmp_path)
    lengths = prompt_graph_lengths(8192, cost)
    assert lengths == [n for n in PROMPT_GRAPH_TOKENS if n <= largest]
    beyond = [n for n in PROMPT_GRAPH_TOKENS if n > largest]
    for n in beyond:  # the first count left out computes more than the bound
        assert 2 * n * cost.layer_matmul_params > PROMPT_GRAPH_MAX_FLOPS
    # A step's budget caps the ladder; the shortest counts are always captured.
    assert prompt_graph_lengths(1000, cost) == [n for n in PROMPT_GRAPH_TOKENS if n <= 512]
    huge = ModelCost(**{**cost.__dict__, "layer_matmul_params": 10**12})
    assert prompt_graph_lengths(8192, huge)[-1] == ALWAYS_CAPTURED_TOKENS


def test_a_mixture_of_experts_counts_the_experts_a_token_uses(tmp_path: Path) -> None:
    """Qwen3-30B-A3B: its 128 experts' 29 G parameters would stop the ladder at 512; the 8 a
    token uses (some 3 G parameters with attention) take it further."""
    cost = shape_cost("qwen3-30b-a3b", tmp_path)
    lengths = prompt_graph_lengths(8192, cost)
    assert lengths[-1] == 1024
    assert 2 * 1024 * (cost.layer_matmul_params + cost.expert_matmul_params) > 8e12


def test_a_step_takes_the_least_graph_that_holds_its_tokens_and_sequences() -> None:
    """Up to 512 tokens a graph takes 8 sequences (and logits rows), past it 32: a step of
    few tokens but many sequences takes a longer graph, one of too many none."""
    lengths = [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert least_graph(lengths, 100, 3) == 128
    assert least_graph(lengths, 512, PROMPT_GRAPH_SEQS) == 512
    assert least_graph(lengths, 100, PROMPT_GRAPH_SEQS + 1) == 1024
    assert least_graph(lengths, 1500, LARGE_PROMPT_GRAPH_SEQS) == 2048
    assert least_graph(lengths, 100, LARGE_PROMPT_GRAPH_SEQS + 1) is None
    assert least_graph(lengths, 2049, 1) is None
    assert least_graph(lengths[:6], 100, PROMPT_GRAPH_SEQS + 1) is None  # a large model's
