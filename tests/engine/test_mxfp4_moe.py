"""The MXFP4 MoE kernels (engine/backends/triton/mxfp4_moe.py) against the float32 reference
of the dequantized experts (tandem/testing/kernel_reference.py) and the torch backend's
``moe_experts`` of the same packed experts (which dequantizes each used one).

Runs natively on CUDA and, without it, in Triton's interpreter (tests/conftest.py), whose
configuration is small on purpose: 16-row tiles, 64 columns and 64 of depth a step over a
hidden size and an intermediate size of three blocks of 32 (the last column and depth steps
half masked), the down projection's depth split in two. Triton's interpreter multiplies
bfloat16 wrongly, so off CUDA the 16-bit case is float16 (whose range holds these scales).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.mxfp4 import BLOCK, E2M1_VALUES, dequantize_mxfp4
from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton import moe_decode
from engine.backends.triton import mxfp4_moe as mxfp4_moe_module
from engine.backends.triton.fused_moe import MoeConfig
from engine.backends.triton.moe_decode import MoeDecodeConfig
from engine.backends.triton.mxfp4_moe import mxfp4_moe, mxfp4_moe_config
from engine.backends.triton.mxfp4_widen import e2m1_halves, widened_tile
from engine.roofline import DeviceRates
from tandem.bench import moe_kernel
from tandem.testing.kernel_reference import moe_experts_reference
from tests.engine.test_fused_moe import assert_rounding_close, route

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HALF = torch.bfloat16 if CUDA else torch.float16
HIDDEN, INTERMEDIATE = 96, 96  # three blocks each: a part-masked last step and column block


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def packed(num_experts: int, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 matrices as ``moe_experts`` takes them: bytes [E, rows, columns / 2] and
    scales [E, rows, columns / 32] of 2 ** -6 to 2 ** -3 (products of about unit size)."""
    codes = torch.randint(0, 256, (num_experts, rows, columns // 2), dtype=torch.uint8)
    scales = torch.randint(121, 125, (num_experts, rows, columns // BLOCK), dtype=torch.uint8)
    return codes.to(DEVICE), scales.to(DEVICE)


def experts(num_experts: int) -> dict[str, torch.Tensor]:
    w13, w13_scale = packed(num_experts, 2 * INTERMEDIATE, HIDDEN)
    w2, w2_scale = packed(num_experts, HIDDEN, INTERMEDIATE)
    return {"w13": w13, "w2": w2, "w13_scale": w13_scale, "w2_scale": w2_scale}


def dequantized(layer: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The same experts in ``dtype``, for the reference."""
    return {
        "w13": dequantize_mxfp4(layer["w13"].unflatten(-1, (-1, 16)), layer["w13_scale"], dtype),
        "w2": dequantize_mxfp4(layer["w2"].unflatten(-1, (-1, 16)), layer["w2_scale"], dtype),
        "w13_scale": None,
        "w2_scale": None,
    }


def gpt_oss_variant(num_experts: int, dtype: torch.dtype) -> dict[str, Any]:
    """gpt-oss's biases (large enough to move products past the clamp) and activation."""
    return {
        "w13_bias": (torch.randn(num_experts, 2 * INTERMEDIATE, device=DEVICE) * 4).to(dtype),
        "w2_bias": torch.randn(num_experts, HIDDEN, device=DEVICE).to(dtype),
        "activation": ClampedSwiGLU(alpha=1.702, limit=2.0),
    }


def assert_matches_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    layer: dict[str, torch.Tensor],
    expert_offset: int = 0,
    config: MoeConfig | MoeDecodeConfig | None = None,
    **gpt_oss: Any,
) -> torch.Tensor:
    """The kernels' output (``config``'s tiles if given, else the rule's) is within two
    units of x's dtype's rounding of the float32 reference of the dequantized experts, and
    within four of the torch backend's ``moe_experts`` of the packed ones
    (``test_fused_moe``'s tolerances)."""
    out = mxfp4_moe(x, weights, ids, **layer, expert_offset=expert_offset, config=config, **gpt_oss)
    assert out.dtype == x.dtype and out.shape == x.shape
    reference = moe_experts_reference(
        x, weights, ids, **dequantized(layer, x.dtype), expert_offset=expert_offset, **gpt_oss
    )
    assert_rounding_close(out, reference)
    theirs = TorchLayerOps().moe_experts(
        x, weights, ids, **layer, expert_offset=expert_offset, **gpt_oss
    )
    assert_rounding_close(out, theirs.float(), units=4.0)
    return out


@pytest.mark.parametrize("num_experts", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_mxfp4_moe_matches_reference(num_tokens: int, dtype: torch.dtype, num_experts: int) -> None:
    """Top 4 of 8 or of 32 with gpt-oss's biases and clamped SwiGLU: one token (a tile an
    expert), three, and forty (an expert's pairs over several tiles; at 8 experts' top 4,
    every expert picked; at 32, most experts no token picks at one token). Its biases and
    clamp change the output (the variant is used)."""
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE).to(dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, device=DEVICE), top_k=4)
    layer = experts(num_experts)
    variant = gpt_oss_variant(num_experts, dtype)
    out = assert_matches_reference(x, weights, ids, layer, **variant)
    assert (variant["w13_bias"].float().abs() > variant["activation"].limit).any()
    assert not torch.allclose(out, mxfp4_moe(x, weights, ids, **layer), atol=1e-2)
    # No atomics: the same bits run to run.
    assert torch.equal(out, mxfp4_moe(x, weights, ids, **layer, **variant))


@pytest.mark.parametrize("rule_tokens", [8, 40, 1000])
def test_mxfp4_moe_in_the_cuda_rules_tiles(
    rule_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA rule's tiles (16 rows and 128 of depth at a decode step's tokens, 64 rows,
    128 rows at a prefill's), given to 40 tokens' top 4 of 8 here: tiles taller than an
    expert's pairs and steps deeper than H."""
    monkeypatch.setattr(mxfp4_moe_module, "_INTERPRETED", False)
    config = mxfp4_moe_config(rule_tokens, 4, 8, 2880, 2880)
    assert isinstance(config, MoeConfig)
    assert config.block_m == {8: 16, 40: 64, 1000: 128}[rule_tokens]
    monkeypatch.undo()
    x = torch.randn(40, HIDDEN, device=DEVICE)
    weights, ids = route(torch.randn(40, 8, device=DEVICE), top_k=4)
    layer, variant = experts(8), gpt_oss_variant(8, x.dtype)
    assert_matches_reference(x, weights, ids, layer, config=config, **variant)


# The decode path's steps: the rule's here (interpreted, a block a step); 64 deep, each row's
# second step half masked, with and without the next step in flight; the CUDA rule's (a
# step deeper than the rows).
DECODE_CONFIGS = {
    "rule": None,
    "masked": MoeDecodeConfig(32, 64, 16, 64, 4, by_token=True, prefetch=True),
    "masked-unfetched": MoeDecodeConfig(32, 64, 16, 64, 4, by_token=True),
    "cuda-rule": "cuda",
}


def test_mxfp4_rule_takes_the_decode_path_at_a_few_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA rule at gpt-oss's experts (H = I = 2880, top 4): by token at up to E / 8
    pairs (20b's 32 experts: one token; 120b's 128: four), the grouped tiles beyond; steps
    of whole scale blocks that divide 2880 with little masked."""
    monkeypatch.setattr(moe_decode, "_INTERPRETED", False)
    monkeypatch.setattr(mxfp4_moe_module, "_INTERPRETED", False)
    for num_tokens, num_experts, decode in (
        (1, 32, True),
        (2, 32, False),
        (4, 128, True),
        (5, 128, False),
    ):
        config = mxfp4_moe_config(num_tokens, 4, num_experts, 2880, 2880)
        assert isinstance(config, MoeDecodeConfig) == decode
        if isinstance(config, MoeDecodeConfig):
            assert config.by_token and config.prefetch
            for step in (config.gate_up_depth, config.down_depth):
                assert step % 32 == 0 and -(-2880 // step) * step <= 1.125 * 2880


@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_mxfp4_decode_path_matches_reference(
    num_tokens: int, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At one token of gpt-oss's top 4 of 32 the rule takes the decode path by token
    (``moe_decode``), its MXFP4 steps widened in the kernels: against the reference with
    gpt-oss's biases and clamp, without them, and with other ranks' experts (offset 8 of
    32: a pick elsewhere adds nothing; a token none of whose picks is here comes out zero)."""
    if DECODE_CONFIGS[name] == "cuda":
        monkeypatch.setattr(moe_decode, "_INTERPRETED", False)
        config = moe_decode.moe_decode_config(4, mxfp4=True)
        monkeypatch.undo()
    elif CUDA:  # the small shape here is not where the CUDA rule takes this path
        config = DECODE_CONFIGS[name] or moe_decode.moe_decode_config(4, mxfp4=True)
    else:
        config = DECODE_CONFIGS[name] or mxfp4_moe_config(1, 4, 32, HIDDEN, INTERMEDIATE)
    assert isinstance(config, MoeDecodeConfig) and config.by_token
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE)
    weights, ids = route(torch.randn(num_tokens, 32, device=DEVICE), top_k=4)
    layer = experts(32)
    variant = gpt_oss_variant(32, x.dtype)
    out = assert_matches_reference(x, weights, ids, layer, config=config, **variant)
    assert torch.equal(out, mxfp4_moe(x, weights, ids, **layer, config=config, **variant))
    assert_matches_reference(x, weights, ids, layer, config=config)
    local = experts(8)
    ids[0] = torch.tensor([0, 9, 20, 15])  # 9 and 15 here
    if num_tokens > 1:
        ids[1] = torch.tensor([0, 1, 2, 3])  # none here
    local_variant = gpt_oss_variant(8, x.dtype)
    out = assert_matches_reference(
        x, weights, ids, local, expert_offset=8, config=config, **local_variant
    )
    if num_tokens > 1:
        assert (out[1] == 0).all()


def test_mxfp4_moe_without_biases_is_silu_gated() -> None:
    """Qwen-style experts (no biases, silu(gate) * up), as any ``moe_experts`` caller may pass."""
    x = torch.randn(5, HIDDEN, device=DEVICE)
    weights, ids = route(torch.randn(5, 8, device=DEVICE), top_k=2)
    assert_matches_reference(x, weights, ids, experts(8))


def test_mxfp4_moe_ties_and_experts_no_token_picks() -> None:
    """Every token's first pick is expert 3 of 16; its second, a tie between 11 and 12 at
    equal weights; thirteen experts get no pair."""
    logits = torch.zeros(40, 16, device=DEVICE)
    logits[:, 3] = 2.0
    logits[:, 11] = logits[:, 12] = 1.0
    weights, ids = route(logits, top_k=2)
    assert (ids[:, 0] == 3).all() and set(ids[:, 1].tolist()) <= {11, 12}
    x = torch.randn(40, HIDDEN, device=DEVICE)
    assert_matches_reference(x, weights, ids, experts(16), **gpt_oss_variant(16, x.dtype))


def test_mxfp4_moe_expert_offset_leaves_out_other_ranks_experts() -> None:
    """Experts 4-7 of 12 here (expert_offset 4): picks of the others add nothing, a token
    none of whose picks is here comes out zero (its down bias included), one token with
    two of its three picks here matches too."""
    weights, ids = route(torch.randn(24, 12, device=DEVICE), top_k=3)
    ids[0] = torch.tensor([0, 9, 11])  # no local pick
    ids[1] = torch.tensor([4, 5, 7])  # every pick local
    assert ((ids >= 4) & (ids < 8)).any() and ((ids < 4) | (ids >= 8)).any()
    x = torch.randn(24, HIDDEN, device=DEVICE)
    layer, variant = experts(4), gpt_oss_variant(4, x.dtype)
    out = assert_matches_reference(x, weights, ids, layer, expert_offset=4, **variant)
    assert (out[0] == 0).all()
    mixed = torch.tensor([[5, 9, 7]], device=DEVICE, dtype=torch.int32)
    assert_matches_reference(x[:1], weights[:1], mixed, layer, expert_offset=4, **variant)


@triton.jit
def _widen_kernel(w_ptr, s_ptr, out_ptr, DTYPE: tl.constexpr, ROWS: tl.constexpr) -> None:  # noqa: ANN001
    """``widened_tile`` of ROWS rows of 64 values (bytes at ``w_ptr``, scales at ``s_ptr``),
    stored [ROWS, 64]."""
    rows = tl.arange(0, ROWS)
    tile = widened_tile(w_ptr + rows * 32, s_ptr + rows * 2, rows < ROWS, 0, 64, DTYPE, ROWS, 64)
    tl.store(out_ptr + rows[None, :] * 64 + tl.arange(0, 64)[:, None], tile)


@triton.jit
def _e2m1_kernel(out_ptr) -> None:  # noqa: ANN001 (a pointer)
    codes = tl.arange(0, 16)
    tl.store(out_ptr + codes, e2m1_halves(codes) * 16384.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_widening_covers_every_code_and_extreme_scales_exactly(dtype: torch.dtype) -> None:
    """All 256 bytes (each row's low nibbles take all 16 codes, the high ones all 16 over
    the rows) at scales 2 ** -20 to 2 ** 20 widen to what ``dequantize_mxfp4`` gives, bit
    for bit, in float32 and in bfloat16."""
    rows = 8
    codes = torch.arange(256, dtype=torch.uint8).view(rows, 32)
    scales = torch.tensor([127 - 20, 127 + 20, 127, 100, 150, 126, 128, 107], dtype=torch.uint8)
    scales = scales.repeat_interleave(2).view(rows, 2)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    out = torch.empty(rows, 64, dtype=dtype, device=DEVICE)
    triton_dtype = tl.float32 if dtype == torch.float32 else tl.bfloat16
    _widen_kernel[(1,)](codes, scales, out, DTYPE=triton_dtype, ROWS=rows)
    expected = dequantize_mxfp4(codes.view(rows, 2, 16), scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), expected.view(bits))


def test_e2m1_values_are_the_format_table() -> None:
    """The bit arithmetic's 16 values (times the 2 ** 14 it leaves to the scales), signed
    zeros included, are the format's table."""
    out = torch.empty(16, dtype=torch.float32, device=DEVICE)
    _e2m1_kernel[(1,)](out)
    expected = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))


def test_the_kernel_benchmarks_mxfp4_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_kernels.py --moe SHAPE --quantization mxfp4 --moe-sweep``'s case, on the CPU
    (the GPU's timer replaced by a count): at one token of top 4 of 32 the rule's
    decode path by token, checked against the dequantized experts with each candidate; the
    bytes counted as MXFP4's. The sweep's by-token blocks are whole scale blocks a step."""
    for config in moe_kernel.mxfp4_decode_candidates():
        assert config.by_token and config.gate_up_depth % 32 == 0 and config.down_depth % 32 == 0
    # The interpreter's rule on a GPU too: the CUDA rule's steps are deeper than this shape.
    monkeypatch.setattr(moe_decode, "_INTERPRETED", True)
    monkeypatch.setattr(mxfp4_moe_module, "_INTERPRETED", True)
    monkeypatch.setattr(moe_kernel, "DEVICE", DEVICE)
    monkeypatch.setattr(moe_kernel, "DTYPE", HALF)  # float16 here: the interpreter's bf16 is off
    monkeypatch.setattr(
        moe_kernel, "mxfp4_decode_candidates", lambda: DECODE_CONFIGS_TIMED
    )  # a few: each is checked in the interpreter
    shape = moe_kernel.MoeShape(HIDDEN, INTERMEDIATE, 32, 32, 4, gpt_oss=True)
    layer, reference_layer = moe_kernel.random_mxfp4_layers(shape)
    assert layer["w13"].dtype == torch.uint8 and reference_layer["w13"].dtype == HALF
    runs: list[int] = []

    def count(run: Callable[[], None]) -> float:
        run()
        runs.append(1)
        return 1.0

    rates = DeviceRates(bytes_per_s=1e12, flops_per_s=1e15)
    result = moe_kernel.moe_case(shape, 1, layer, rates, count, True, reference_layer)
    assert result.config.startswith("token/")
    assert result.weight_bytes == int(result.touched * 3 * HIDDEN * INTERMEDIATE * (0.5 + 1 / 32))
    assert result.best is not None and len(result.best) == len(DECODE_CONFIGS_TIMED) + 1
    assert len(runs) == len(DECODE_CONFIGS_TIMED) + 2  # the rule, the grouped tiles, the rest


DECODE_CONFIGS_TIMED = [
    MoeDecodeConfig(32, 64, 16, 64, 4, by_token=True, prefetch=True),
    MoeDecodeConfig(16, 32, 32, 32, 8, by_token=True, prefetch=True),
]
