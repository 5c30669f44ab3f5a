"""The fused MoE kernels on CUDA at the real models' shapes (tandem/bench/moe_kernel.py's
SHAPES: Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B's TP=4 rank, both splits, and
gpt-oss-20b and 120b with their biases and clamped SwiGLU), bf16 and FP8 weights: against the
expert-by-expert float32 reference at a decode's and a prefill's token counts, and inside a
CUDA graph, captured for one routing and replayed for others. The decode path by pair
(``moe_decode``: the rule's at one token) also at 2 and 4 tokens, its configuration given,
where pairs share experts."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.backends.triton.fused_moe import fused_moe
from engine.backends.triton.moe_decode import moe_decode_config, takes_decode_path
from tandem.bench.moe_kernel import (
    SHAPES,
    MoeShape,
    assert_matches_reference,
    assert_replays_for_any_routing,
    random_layer,
    random_routing,
)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request: pytest.FixtureRequest) -> MoeShape:
    return SHAPES[request.param]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_moe_at_real_shapes(shape: MoeShape, fp8: bool) -> None:
    torch.manual_seed(0)
    layer = random_layer(shape, fp8)
    for num_tokens in (1, 8, 64, 256, 2048):
        x = torch.randn(num_tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = random_routing(num_tokens, shape)
        out = fused_moe(x, weights, ids, **layer)
        assert_matches_reference(out, x, weights, ids, layer)
        # No atomics: the same sums in the same order, run to run.
        assert torch.equal(out, fused_moe(x, weights, ids, **layer))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_path_at_real_shapes(shape: MoeShape, fp8: bool) -> None:
    """By pair at 1, 2 and 4 tokens (FP8 weight-only): against the reference, the same bits
    run to run (no atomics, no partial sums); at one token it is the rule's path but where
    its steps would mask much of the last one (gpt-oss-20b's H)."""
    torch.manual_seed(2)
    layer = random_layer(shape, fp8)
    takes = takes_decode_path(1, shape.top_k, shape.local_experts, shape.hidden, shape.intermediate)
    assert takes == (shape.hidden % 2048 == 0)
    config = moe_decode_config(shape.top_k)
    for num_tokens in (1, 2, 4):
        x = torch.randn(num_tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = random_routing(num_tokens, shape)
        out = fused_moe(x, weights, ids, **layer, config=config)
        assert_matches_reference(out, x, weights, ids, layer)
        assert torch.equal(out, fused_moe(x, weights, ids, **layer, config=config))


@pytest.mark.parametrize(
    ("num_tokens", "fp8"),
    [(1, False), (1, True), (64, False), (64, True)],
    ids=["1", "1-fp8", "64", "64-w8a8"],
)
def test_fused_moe_replays_in_a_cuda_graph_for_any_routing(
    shape: MoeShape, num_tokens: int, fp8: bool
) -> None:
    """``assert_replays_for_any_routing``. One token: the decode path by pair (bf16, FP8
    widened). FP8 weights at 64 tokens: W8A8, the activations' quantization kernels captured
    too."""
    torch.manual_seed(1)
    layer = random_layer(shape, fp8)
    experts = functools.partial(fused_moe, **layer)
    assert_replays_for_any_routing(experts, layer, shape, num_tokens)
