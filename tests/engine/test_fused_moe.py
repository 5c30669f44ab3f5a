"""The fused MoE kernels (engine/backends/triton/fused_moe.py) against the expert-by-expert
float32 reference (tandem/testing/kernel_reference.py), and against the torch backend's
``moe_experts`` where it multiplies alike.

Runs natively on CUDA and, without it, in Triton's interpreter (tests/conftest.py), where
the configuration is small on purpose: 16-row tiles, the down projection's depth split in
two, the alignment's pairs cut into chunks of a few and its tiles labelled by several
programs, so that these small shapes take every path the real ones do. A decode step's few
pairs take the by-pair path (engine/backends/triton/moe_decode.py) by the rule; its tests
also give it more tokens (its configuration passed), where pairs share experts. FP8 weights past 16
tokens take the W8A8 path (activations quantized per row, FP8 x FP8 products), which the
interpreter runs too. Triton's interpreter multiplies bfloat16 wrongly, so off CUDA the
16-bit case is float16.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton import fused_moe as fused_moe_module
from engine.backends.triton.fused_moe import (
    fused_moe,
    grouped_config,
    moe_config,
    quantizes_activations,
)
from engine.backends.triton.moe_decode import MoeDecodeConfig, moe_decode_config
from engine.quantization.linear_methods import quantize_per_channel
from tandem.testing.kernel_reference import moe_experts_reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HALF = torch.bfloat16 if CUDA else torch.float16
HIDDEN, INTERMEDIATE = 48, 40  # not multiples of the tiles: every edge mask
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def experts(num_experts: int, dtype: torch.dtype, fp8: bool) -> dict[str, torch.Tensor | None]:
    """Random experts' w13 [E, 2I, H] and w2 [E, H, I] in ``dtype``, or as float8 codes with
    per-channel scales, as ``moe_experts`` takes them."""
    w13 = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, device=DEVICE) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTERMEDIATE, device=DEVICE) / INTERMEDIATE**0.5
    if not fp8:
        return {"w13": w13.to(dtype), "w2": w2.to(dtype), "w13_scale": None, "w2_scale": None}
    codes13, scale13 = quantize_per_channel(w13.flatten(0, 1), FP8)
    codes2, scale2 = quantize_per_channel(w2.flatten(0, 1), FP8)
    return {
        "w13": codes13.view(w13.shape),
        "w2": codes2.view(w2.shape),
        "w13_scale": scale13.view(num_experts, 2 * INTERMEDIATE),
        "w2_scale": scale2.view(num_experts, HIDDEN),
    }


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, top-k, renormalized (Qwen3-MoE's and Mixtral's routing): float32 weights
    and int32 ids [T, K]."""
    weights, ids = logits.float().softmax(-1).topk(top_k)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def assert_matches_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    layer: dict[str, torch.Tensor | None],
    expert_offset: int = 0,
    config: MoeDecodeConfig | None = None,
    **gpt_oss: Any,
) -> torch.Tensor:
    """The kernel's output in x's dtype is within two units of x's dtype's rounding of the
    float32 reference (W8A8, past 16 tokens of FP8 weights: with the activations quantized as
    the kernel quantizes them), overall and element by element (float32: a few epsilons, the
    sums' order); and within as much of the torch backend's where both multiply alike (it
    reads FP8 weights weight-only at any size). ``gpt_oss``: its biases and activation
    (``LayerOps.moe_experts``' keywords). ``config``: the decode path's, whatever the rule
    would take."""
    out = fused_moe(x, weights, ids, **layer, expert_offset=expert_offset, config=config, **gpt_oss)
    assert out.dtype == x.dtype and out.shape == x.shape
    w8a8 = quantizes_activations(x.shape[0], layer["w13"].dtype)
    reference = moe_experts_reference(
        x, weights, ids, **layer, expert_offset=expert_offset, quantize_activations=w8a8, **gpt_oss
    )
    assert_rounding_close(out, reference)
    if not w8a8:
        theirs = TorchLayerOps().moe_experts(
            x, weights, ids, **layer, expert_offset=expert_offset, **gpt_oss
        )
        assert_rounding_close(out, theirs.float(), units=4.0)
    return out


def assert_rounding_close(out: torch.Tensor, reference: torch.Tensor, units: float = 2.0) -> None:
    assert not out.isnan().any(), "NaN in the output"
    eps = torch.finfo(out.dtype).eps * (8 if out.dtype == torch.float32 else 1)
    out = out.float()
    rounding = (reference.to(out.dtype).float() - reference).norm().item()
    rounding = max(rounding, eps * reference.norm().item())
    error = (out - reference).norm().item()
    assert error <= units * rounding, f"error {error:.3g} > {units} x rounding {rounding:.3g}"
    worst = (out - reference).abs().max().item()
    bound = units * 4 * eps * reference.abs().max().item()
    assert worst <= bound, f"an element is off by {worst:.3g} > {bound:.3g}"


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 40])
def test_fused_moe_matches_reference(num_tokens: int, dtype: torch.dtype, fp8: bool) -> None:
    """One token and two (one tile an expert, one chunk of pairs) and 40 (top-2 of 8: tiles of
    several tokens, an expert's pairs over more than one tile, several chunks)."""
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    weights, ids = route(torch.randn(num_tokens, 8, device=DEVICE), top_k=2)
    assert_matches_reference(x, weights, ids, experts(8, dtype, fp8))


def test_fused_moe_ties_and_experts_no_token_picks() -> None:
    """Every token's first pick is expert 3 of 16 (40 pairs: three tiles of 16, the last
    part-filled); its second, a tie between 11 and 12 that top-k breaks, at a tie's equal
    weight with the other tied; thirteen experts get no pair."""
    num_tokens = 40
    logits = torch.zeros(num_tokens, 16, device=DEVICE)
    logits[:, 3] = 2.0
    logits[:, 11] = logits[:, 12] = 1.0
    weights, ids = route(logits, top_k=2)
    assert (ids[:, 0] == 3).all() and set(ids[:, 1].tolist()) <= {11, 12}
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    assert_matches_reference(x, weights, ids, experts(16, torch.float32, fp8=False))


def gpt_oss_variant(num_experts: int, dtype: torch.dtype) -> dict[str, Any]:
    """gpt-oss's biases (large enough to move products past the clamp) and activation."""
    return {
        "w13_bias": (torch.randn(num_experts, 2 * INTERMEDIATE, device=DEVICE) * 4).to(dtype),
        "w2_bias": torch.randn(num_experts, HIDDEN, device=DEVICE).to(dtype),
        "activation": ClampedSwiGLU(alpha=1.702, limit=2.0),
    }


@pytest.mark.parametrize(
    ("num_tokens", "fp8"), [(1, False), (1, True), (20, True)], ids=["1", "1-fp8", "20-w8a8"]
)
def test_fused_moe_gpt_oss_epilogue(num_tokens: int, fp8: bool) -> None:
    """gpt-oss's variant: the gate/up biases and the clamped SwiGLU in the first kernel's
    epilogue, the down bias added once however the depth is split (or once a pick, by
    pair), times the routing weight; top-4 of 8, float16 (one token: by pair, FP8 widened;
    FP8 at 20 tokens: W8A8, the bias apart from the activation's scale). Its biases and
    clamp change the output (the variant is used)."""
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(HALF)
    weights, ids = route(torch.randn(num_tokens, 8, device=DEVICE), top_k=4)
    layer = experts(8, HALF, fp8)
    variant = gpt_oss_variant(8, HALF)
    out = assert_matches_reference(x, weights, ids, layer, **variant)
    assert (variant["w13_bias"].float().abs() > variant["activation"].limit).any()
    assert not torch.allclose(out, fused_moe(x, weights, ids, **layer), atol=1e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
def test_fused_moe_expert_offset_leaves_out_other_ranks_experts(fp8: bool) -> None:
    """Experts 4-7 of 12 on this rank (expert_offset 4): picks of 0-3 and 8-11 add nothing,
    and a token all of whose picks are elsewhere comes out zero; at 24 tokens and at one."""
    num_tokens, top_k = 24, 3
    weights, ids = route(torch.randn(num_tokens, 12, device=DEVICE), top_k)
    ids[0] = torch.tensor([0, 9, 11])  # no local pick
    ids[1] = torch.tensor([4, 5, 7])  # every pick local
    assert ((ids >= 4) & (ids < 8)).any() and ((ids < 4) | (ids >= 8)).any()
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    layer = experts(4, torch.float32, fp8)
    out = assert_matches_reference(x, weights, ids, layer, expert_offset=4)
    assert (out[0] == 0).all()
    # One token, two of its three picks here.
    mixed = torch.tensor([[5, 9, 7]], device=DEVICE, dtype=torch.int32)
    assert_matches_reference(x[:1], weights[:1], mixed, layer, expert_offset=4)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 20])
def test_fused_moe_all_picks_elsewhere_gives_exact_zeros(num_tokens: int, fp8: bool) -> None:
    """A rank none of whose experts any token picked (expert parallelism at a few tokens):
    no pair is placed, no GEMM program has rows, and the output is exact zeros, not whatever
    the unwritten buffers held."""
    layer = experts(4, torch.float32, fp8)
    weights, ids = route(torch.randn(num_tokens, 8, device=DEVICE), top_k=2)
    ids = torch.where(ids < 4, ids + 8, ids)  # global ids 4-11 and 12-15: none in [0, 4)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    out = fused_moe(x, weights, ids, **layer, expert_offset=0)
    assert torch.equal(out, torch.zeros_like(x))


def test_decode_path_is_the_rule_at_a_few_pairs() -> None:
    """One token's picks always (distinct experts); more tokens while their pairs are at most
    E / 8 (duplicates rare): Qwen3-30B-A3B's shape up to 2 tokens, Mixtral's and
    gpt-oss-20b's at one; never W8A8."""

    def by_pair(num_tokens: int, top_k: int, experts: int, dtype: torch.dtype) -> bool:
        config = moe_config(num_tokens, top_k, experts, 2048, 768, 132, dtype, dtype)
        return isinstance(config, MoeDecodeConfig)

    assert by_pair(1, 8, 128, HALF) and by_pair(2, 8, 128, HALF) and not by_pair(3, 8, 128, HALF)
    assert by_pair(1, 2, 8, HALF) and not by_pair(2, 2, 8, HALF)
    assert by_pair(1, 4, 32, HALF) and not by_pair(2, 4, 32, HALF)
    assert by_pair(1, 8, 128, FP8) and not by_pair(64, 8, 4096, FP8)


def test_grouped_programs_spread_evenly_over_the_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few tokens' grouped kernels narrow their gate/up programs and split the down depth
    where wider ones would run more on some SMs than on others: gpt-oss-20b at one token
    (4 pairs: 180 programs of 64 columns on 132 SMs) takes 32 columns and two splits, while
    Qwen3-30B-A3B at 8 tokens and Mixtral at 2 keep 64 columns and one split. (The GPU's
    rule: interpreted, the kernels take small tiles whatever the shape.)"""
    monkeypatch.setattr(fused_moe_module, "_INTERPRETED", False)

    def grouped(tokens: int, top_k: int, experts: int, hidden: int, inter: int) -> tuple:
        config = grouped_config(tokens, top_k, experts, hidden, inter, 132, HALF, HALF)
        return config.gate_up.block_n, config.down.split_k

    assert grouped(1, 4, 32, 2880, 2880) == (32, 2)
    assert grouped(8, 8, 128, 2048, 768) == (64, 1)
    assert grouped(2, 2, 8, 4096, 14336) == (64, 1)


# The by-pair path's kernel variants: a gate/up program a pair or a token's (walking its
# picks), each loop's next step loaded before the one loaded is reduced or not.
DECODE_VARIANTS = {
    "by-pair": {},
    "by-token": {"by_token": True},
    "by-token-prefetch": {"by_token": True, "prefetch": True},
    "by-pair-prefetch": {"prefetch": True},
}


def decode_config(top_k: int, variant: str) -> MoeDecodeConfig:
    return replace(moe_decode_config(top_k), **DECODE_VARIANTS[variant])


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_decode_path_matches_reference(
    num_tokens: int, dtype: torch.dtype, fp8: bool, variant: str
) -> None:
    """By pair, top-3 of 8 (the picks padded to 4 in the down kernel's block): one token, and
    five whose 15 pairs share experts (each pair reads its expert's weights, each token's
    program sums its own picks)."""
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    weights, ids = route(torch.randn(num_tokens, 8, device=DEVICE), top_k=3)
    layer = experts(8, dtype, fp8)
    config = decode_config(3, variant)
    out = assert_matches_reference(x, weights, ids, layer, config=config)
    # No atomics, no partial sums: the same bits run to run.
    assert torch.equal(out, fused_moe(x, weights, ids, **layer, config=config))


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
def test_decode_path_in_the_cuda_rules_blocks(fp8: bool) -> None:
    """The CUDA rule's block shapes (2 gate/up columns of each half, 8 down channels a
    program), at depths the interpreter takes quickly: one token's top-3."""
    layer = experts(8, torch.float32, fp8)
    x = torch.randn(1, HIDDEN, device=DEVICE)
    weights, ids = route(torch.randn(1, 8, device=DEVICE), top_k=3)
    assert_matches_reference(x, weights, ids, layer, config=MoeDecodeConfig(2, 32, 8, 16, 4))


def test_decode_path_ties_and_experts_no_token_picks() -> None:
    """The ties test's routing (expert 3 first, a tie of 11 and 12 second, thirteen of 16
    experts unpicked) by pair at 6 tokens."""
    logits = torch.zeros(6, 16, device=DEVICE)
    logits[:, 3] = 2.0
    logits[:, 11] = logits[:, 12] = 1.0
    weights, ids = route(logits, top_k=2)
    x = torch.randn(6, HIDDEN, device=DEVICE)
    layer = experts(16, torch.float32, fp8=False)
    assert_matches_reference(x, weights, ids, layer, config=moe_decode_config(2))


@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
def test_decode_path_leaves_out_other_ranks_experts(fp8: bool, variant: str) -> None:
    """Experts 4-7 of 12 here, by pair at 4 tokens of top-3: a token with no local pick comes
    out exact zeros, one with every pick local and two mixed match the reference."""
    weights, ids = route(torch.randn(4, 12, device=DEVICE), top_k=3)
    ids[0] = torch.tensor([0, 9, 11])  # no local pick
    ids[1] = torch.tensor([4, 5, 7])  # every pick local
    ids[2] = torch.tensor([5, 9, 7])
    ids[3] = torch.tensor([1, 6, 8])
    x = torch.randn(4, HIDDEN, device=DEVICE)
    layer = experts(4, torch.float32, fp8)
    out = assert_matches_reference(
        x, weights, ids, layer, expert_offset=4, config=decode_config(3, variant)
    )
    assert (out[0] == 0).all()
