"""The one-row QKV projection with RoPE and the cache write in its epilogue
(``one_row_qkv_rotary_store``) against the kernels it replaces at batch 1: the one-row
product, the bias added as ``with_bias`` adds it, then ``rotary_store_kv``. Equal to the
bit, on CUDA (bfloat16) and in the interpreter (float32), so a batch-1 step computes what it
computed before the fusion (but for a head whose half is not a multiple of the rule's
channel pairs, whose sums may take another layout on CUDA); the kernels it replaces are
held to float32 references in tests/engine/test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.attention import Rotary
from engine.backends.deferred_norm import DeferredNorm, LinearInput
from engine.backends.pytorch import with_bias
from engine.backends.triton import one_row_qkv_rotary_store, rotary_store_kv
from engine.backends.triton.backend import TritonLayerOps
from engine.backends.triton.one_row_matmul import one_row_matmul
from engine.backends.triton.one_row_qkv import one_row_qkv_config
from engine.quantization.linear_methods import quantize_per_channel
from tests.engine.test_kernels import BLOCK_SIZE, CUDA, DEVICE, DTYPE, FP8, make_rotary, randn


def unfused(
    x: LinearInput,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    caches: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    rotary: Rotary,
    num_heads: int,
) -> torch.Tensor:
    """q as the two kernels leave it: the projection, normed per head (if ``rotary`` says)
    and rotated in place."""
    _, _, num_kv_heads, head_dim = caches[0].shape
    # The QKV kernel's configuration, which sums as the product alone then sums.
    config = one_row_qkv_config(
        *weight.shape, weight.dtype, isinstance(x, DeferredNorm), rotary.q_norm is not None
    )
    qkv = with_bias(one_row_matmul(x, weight, scale, config=config), bias)
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q = q.view(1, num_heads, head_dim)
    k, v = (t.view(1, num_kv_heads, head_dim) for t in (k, v))
    rotary_store_kv(q, k, v, *caches, slot_mapping, positions, rotary)
    return q


SHAPES = [
    (2, 1, 64, "deferred norm", False, None, 21),
    (4, 2, 32, "row", True, None, 3),
    (6, 2, 32, "deferred norm, no residual", True, FP8, 30),
    (4, 4, 16, "fp8 weight", False, None, 17),
    # Half a head (3) not a multiple of the rule's channel pairs: fewer channels a program
    # than the unfused kernel's, which on CUDA may sum in another layout.
    (3, 1, 6, "row", False, None, 5),
    (4, 2, 32, "fp8 weight", True, FP8, 0),
    (2, 1, 32, "deferred norm", False, None, -1),  # a CUDA graph's padding row
]
# RoPE alone and Qwen3's Q/K norms at every shape; Gemma's (rounded once, 1 + weight), which
# differ only in the head's last program, at two.
NORMS = [("rope", False, None), ("qk-norm", True, None)]
CASES = [
    pytest.param(*shape, head_norms, offset, id=f"{name}-{index}")
    for name, head_norms, offset in NORMS
    for index, shape in enumerate(SHAPES)
] + [pytest.param(*SHAPES[index], True, 1.0, id=f"gemma-qk-norm-{index}") for index in (0, 2)]


@pytest.mark.parametrize(
    (
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "input_kind",
        "bias",
        "cache_dtype",
        "slot",
        "head_norms",
        "norm_offset",
    ),
    CASES,
)
def test_one_row_qkv_rotary_store(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    input_kind: str,
    bias: bool,
    cache_dtype: torch.dtype | None,
    slot: int,
    head_norms: bool,
    norm_offset: float | None,
) -> None:
    """With ``head_norms`` (Qwen3's per-head Q/K RMSNorms; Gemma's with ``norm_offset``),
    each head's last program to store its channels norms the whole head; the counts it
    keeps are zero again after a launch, for the next (the kernel runs twice)."""
    depth, num_blocks, max_positions = 100, 2, 50  # K off every chunk: the last is partial
    channels = (num_heads + 2 * num_kv_heads) * head_dim
    x = randn(1, depth)
    weight, scale = randn(channels, depth), None
    if input_kind == "fp8 weight":
        weight, scale = quantize_per_channel(weight.float(), FP8)
    row: LinearInput = x
    streams = []
    if input_kind.startswith("deferred norm"):
        residual = None if "no residual" in input_kind else randn(1, depth)
        norm_weight = (1.0 + 0.5 * torch.randn(depth, device=DEVICE)).to(DTYPE)
        ops = TritonLayerOps()  # the ops that defer norms, whose kernel computes an unfused one
        row = DeferredNorm(x, residual, norm_weight, 1e-5, ops)
        twin = DeferredNorm(x, residual, norm_weight, 1e-5, ops)  # the unfused kernels' own
        streams = [row.stream, twin.stream]
    bias_t = randn(channels) if bias else None
    rotary = make_rotary(head_dim, head_norms, max_positions, norm_offset)
    positions = torch.tensor([37], device=DEVICE)
    slot_mapping = torch.tensor([slot], device=DEVICE)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    dtype = cache_dtype or DTYPE

    def caches() -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.full(shape, float("nan"), device=DEVICE).to(dtype) for _ in range(2))

    fused_caches, unfused_caches = caches(), caches()
    for _ in range(2 if head_norms else 1):
        got = one_row_qkv_rotary_store(
            row, weight, scale, bias_t, *fused_caches, slot_mapping, positions, rotary
        )
    expected = unfused(
        twin if streams else x,
        weight,
        scale,
        bias_t,
        unfused_caches,
        slot_mapping,
        positions,
        rotary,
        num_heads,
    )
    assert got.shape == (1, num_heads, head_dim) and got.dtype == DTYPE
    # Exact; within a rounding where the fused kernel takes fewer channels a program on CUDA,
    # or sums a head's squares in another order.
    exact = not CUDA or (head_dim % 4 == 0 and not head_norms)
    tolerance = {"atol": 0, "rtol": 0} if exact else {}
    torch.testing.assert_close(got, expected, **tolerance)
    for fused_cache, unfused_cache in zip(fused_caches, unfused_caches, strict=True):
        # The slots nobody wrote still NaN in both (all of them for slot -1).
        torch.testing.assert_close(
            fused_cache.float(), unfused_cache.float(), **tolerance, equal_nan=True
        )
        assert fused_cache.float().flatten(0, 1).isnan().all(-1).all(-1).sum() == (
            num_blocks * BLOCK_SIZE - (slot >= 0)
        )
    if streams:
        torch.testing.assert_close(streams[0], streams[1], atol=0, rtol=0)
