"""The MXFP4 MoE kernels (engine/backends/triton/mxfp4_moe.py) on CUDA at gpt-oss-20b's
experts' shape (hidden 2880, intermediate 2880, 32 experts, top 4, its biases and clamped
SwiGLU): against the float32 reference of the dequantized experts at 1, 8 and 256 tokens
(each tile rule's regime), the same bits run to run, and inside a CUDA graph captured for
one routing and replayed for others."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from engine.backends.triton.mxfp4_moe import mxfp4_moe
from tandem.bench.moe_kernel import (
    SHAPES,
    assert_matches_reference,
    assert_replays_for_any_routing,
    random_mxfp4_layers,
    random_routing,
)

SHAPE = SHAPES["gpt-oss-20b"]


@pytest.fixture(scope="module")
def layers() -> tuple[dict[str, Any], dict[str, Any]]:
    """The experts in MXFP4 (``mxfp4_moe``'s keywords) and the same dequantized to bf16 (the
    reference's), with gpt-oss's biases and activation."""
    torch.manual_seed(0)
    return random_mxfp4_layers(SHAPE)


@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_mxfp4_moe_at_gpt_oss_20b_shape(
    layers: tuple[dict[str, Any], dict[str, Any]], num_tokens: int
) -> None:
    mxfp4, bf16 = layers
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = random_routing(num_tokens, SHAPE)
    out = mxfp4_moe(x, weights, ids, **mxfp4)
    assert_matches_reference(out, x, weights, ids, bf16)
    # No atomics: the same sums in the same order, run to run.
    assert torch.equal(out, mxfp4_moe(x, weights, ids, **mxfp4))


@pytest.mark.parametrize("num_tokens", [1, 8, 256])
def test_mxfp4_moe_replays_in_a_cuda_graph_for_any_routing(
    layers: tuple[dict[str, Any], dict[str, Any]], num_tokens: int
) -> None:
    """``assert_replays_for_any_routing``, against the reference of the dequantized
    experts."""
    mxfp4, bf16 = layers
    torch.manual_seed(100 + num_tokens)
    experts = functools.partial(mxfp4_moe, **mxfp4)
    assert_replays_for_any_routing(experts, bf16, SHAPE, num_tokens)
