"""The fused MoE kernel against the memory wall and the GEMM rate: ``tandem bench kernels
--moe SHAPE``.

One mixture-of-experts layer's experts (``engine.backends.triton.fused_moe``, as the
Triton backend's ``moe_experts`` runs them) at a real model's shape, with random weights
(bf16, or FP8 codes with per-channel scales as ``--quantization fp8`` stores them) and a
random softmax top-k routing of T tokens, each T timed as a CUDA graph's replay (as the
engine's decode steps run; which also shows the kernels capture) after an L2 flush.
"Bytes" are the weights of the local experts the routing actually touched: at T = 1 only K
experts' (up to min(E, T * K)), which a batch-1 decode step must read; "of copy" their rate
over the device's measured copy bandwidth; "of roofline" the larger of that bound and the
products' FLOPs (2 per weight per routed pair, at the measured dense GEMM rate, or the FP8
one where the kernel quantizes the activations too: W8A8, past 16 tokens) over the time.
Each case's output is checked against the expert-by-expert float32 reference first.
"config" is the rule's (``moe_config``): tile rows / gate-up columns x depth / down columns x
depth, x splits of the down projection's depth; or, where it takes the decode path by pair
(``moe_decode``), "pair" / gate-up columns x depth / down channels x depth. With --moe-sweep,
each case also times the rule's neighbours (``candidates``; on the decode path, the grouped
kernels' configuration among them) and prints the fastest, for fitting the rule.

``--quantization mxfp4``: the experts as random MXFP4 bytes and scales, run by ``mxfp4_moe``
under its rule (``mxfp4_moe_config``) and checked against the same experts dequantized; their
bytes half a byte a value and a scale byte a block; the sweep's neighbours at a decode step's
pairs the by-token blocks of ``mxfp4_decode_candidates`` and the grouped tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.mxfp4 import BLOCK as MXFP4_BLOCK
from engine.backends.mxfp4 import dequantize_mxfp4
from engine.backends.triton.device import sm_count
from engine.backends.triton.fused_moe import (
    MoeConfig,
    MoeGemmConfig,
    fused_moe,
    grouped_config,
    moe_config,
    quantizes_activations,
)
from engine.backends.triton.moe_decode import MoeDecodeConfig, moe_decode_config
from engine.backends.triton.mxfp4_moe import grouped_mxfp4_config, mxfp4_moe, mxfp4_moe_config
from engine.quantization.linear_methods import quantize_per_channel
from engine.roofline import DeviceRates, StepTraffic, traffic_bound
from tandem.testing.cuda_graphs import captured_graph
from tandem.testing.kernel_reference import moe_experts_reference

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda")  # the CPU tests' interpreter runs the MXFP4 sweep on "cpu"


@dataclass(frozen=True)
class MoeShape:
    """A model's MoE layer as one rank holds it: ``local_experts`` of ``experts`` (expert
    parallelism: rank 0's, ids [0, local_experts)), each [2 * intermediate, hidden] and
    [hidden, intermediate], ``top_k`` picks a token."""

    hidden: int
    intermediate: int
    experts: int
    local_experts: int
    top_k: int
    gpt_oss: bool = False  # its experts' biases and clamped SwiGLU (the kernel's variant)


SHAPES = {
    "qwen3-30b-a3b": MoeShape(2048, 768, 128, 128, 8),
    "mixtral-8x7b": MoeShape(4096, 14336, 8, 8, 2),
    # Qwen3-235B-A22B at TP=4, both ways of splitting the experts: rank 0's 32 whole
    # experts (expert parallelism), or a quarter of each of the 128 (I / 4).
    "qwen3-235b-a22b-tp4-ep": MoeShape(4096, 1536, 128, 32, 8),
    "qwen3-235b-a22b-tp4": MoeShape(4096, 384, 128, 128, 8),
    "gpt-oss-20b": MoeShape(2880, 2880, 32, 32, 4, gpt_oss=True),
    "gpt-oss-120b": MoeShape(2880, 2880, 128, 128, 4, gpt_oss=True),
}
# gpt-oss's activation, as its config.json sets it
GPT_OSS_ACTIVATION = ClampedSwiGLU(alpha=1.702, limit=7.0)
TOKENS = (1, 8, 64, 256, 2048)
_SHOWN_CANDIDATES = 6  # --moe-sweep: the fastest and the next five
# A run's time in ms (``tandem.bench.kernels.time_ms``: a CUDA graph's replay, L2 flushed).
Timer = Callable[[Callable[[], None]], float]


@dataclass(frozen=True)
class MoeResult:
    touched: int  # local experts the routing picked
    config: str  # the rule's
    us: float
    weight_bytes: int
    copy_share: float
    roofline_share: float
    # --moe-sweep: the fastest candidates and their times, fastest first
    best: list[tuple[str, float]] | None


def describe(config: MoeConfig | MoeDecodeConfig) -> str:
    """tile rows / gate-up columns x depth / down columns x depth, x splits / warps and
    stages (gate/up's, then down's where they differ); by pair: "pair" (or "token", its
    gate/up programs a token's) / gate-up columns x depth / down channels x depth, then "p"
    where the loops prefetch, the warps and the register cap ("r-": none)"""
    if isinstance(config, MoeDecodeConfig):
        registers = config.max_registers or "-"
        return (
            f"{'token' if config.by_token else 'pair'}/{config.gate_up_columns}"
            f"x{config.gate_up_depth}/{config.down_rows}x{config.down_depth}"
            f"{'p' if config.prefetch else ''}/w{config.warps}r{registers}"
        )
    gate_up, down = config.gate_up, config.down
    launch = f"w{gate_up.warps}s{gate_up.stages}"
    if (down.warps, down.stages) != (gate_up.warps, gate_up.stages):
        launch += f",w{down.warps}s{down.stages}"
    return (
        f"{config.block_m}/{gate_up.block_n}x{gate_up.block_k}/{down.block_n}x{down.block_k}"
        f"x{down.split_k}/{launch}"
    )


def by_pair_candidates(config: MoeDecodeConfig) -> list[MoeDecodeConfig]:
    """By-pair blocks of ``config``'s products a step: narrower and wider gate/up programs
    (so shallower and deeper steps: 4 columns step 1,024 of H, which divides gpt-oss-20b's
    2,880 in three nearly whole steps where 2,048 takes two, the second 40% masked) and down
    programs; each by 8 warps and by 4 (twice the programs an SM holds at the kernels'
    register cap, each with its own step in flight: a program's start, reading its expert id
    before its weights, then overlaps another's reads)."""
    step = 2 * config.gate_up_columns * config.gate_up_depth
    down_step = config.down_rows * config.down_depth
    by_pair = [
        MoeDecodeConfig(columns, step // (2 * columns), rows, down_step // rows, warps, **loops)
        for columns, rows in ((2, 2), (8, 8), (2, 8), (8, 2), (4, 8))
        for warps in (8, 4)
        for loops in ({}, {"prefetch": True, "max_registers": None})
    ]
    # A gate/up program a token's columns, walking its picks: one wave of programs at one
    # token, each a stream of K picks' rows; with and without the next step in flight, and
    # the register cap (the prefetched step's registers) or none.
    by_token = [
        MoeDecodeConfig(
            columns,
            depth,
            config.down_rows,
            config.down_depth,
            warps,
            by_token=True,
            prefetch=prefetch,
            max_registers=registers,
        )
        for columns, depth in ((2, 2048), (4, 1024), (8, 512), (4, 2048), (2, 1024), (1, 2048))
        for warps in (8, 4)
        for prefetch in (False, True)
        for registers in (config.max_registers, None)
    ]
    return by_pair + by_token


def candidates(
    rule: MoeConfig | MoeDecodeConfig, grouped: MoeConfig, by_pair: MoeDecodeConfig | None
) -> list[MoeConfig | MoeDecodeConfig]:
    """Neighbours of the rule's configuration, for ``--moe-sweep``: by pair, the grouped
    kernels' (``grouped``) and narrower and wider blocks of the same products a step; at
    decode tiles (16 or 32 rows) other column widths, depths and splits, and at 16 rows (a
    few tokens, where the rule left the by-pair path, for its masked steps) ``by_pair``'s
    blocks too (None: the by-pair path cannot take these weights); at prefill tiles the
    other height and widths and warps."""
    if isinstance(rule, MoeDecodeConfig):
        return [grouped, *by_pair_candidates(rule)]
    if rule.block_m <= 32:
        depth = rule.gate_up.block_k
        near = by_pair_candidates(by_pair) if by_pair and rule.block_m <= 16 else []
        return near + [
            MoeConfig(
                rule.block_m,
                MoeGemmConfig(gate_n, block_k, 1, 4, stages),
                MoeGemmConfig(down_n, block_k, split, 4, stages),
            )
            for gate_n in (16, 32, 64, 128)
            for down_n, split in ((32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 1), (128, 4))
            for block_k, stages in ((depth, 4), (depth // 2, 5))
        ]
    depth = rule.gate_up.block_k
    return [
        MoeConfig(
            block_m,
            MoeGemmConfig(gate_n, depth, 1, warps, stages),
            MoeGemmConfig(down_n, depth, 1, warps, stages),
        )
        for block_m in (64, 128)
        for gate_n, down_n in ((64, 128), (128, 128), (128, 256))
        for warps, stages in ((4, 4), (8, 3), (8, 4))
    ]


def mxfp4_decode_candidates() -> list[MoeDecodeConfig]:
    """MXFP4's by-token blocks around its rule's (``moe_decode_config(mxfp4=True)``): gate/up
    columns by depths of whole scale blocks (1,024 and 512 divide gpt-oss's 2,880 with little
    masked, 2,048 not), down channels by depth, 4 or 8 warps, the next step in flight."""
    return [
        MoeDecodeConfig(
            columns,
            depth,
            rows,
            down_depth,
            warps,
            by_token=True,
            prefetch=True,
            max_registers=None,
        )
        for columns, depth in ((4, 1024), (2, 1024), (8, 1024), (8, 512), (4, 512), (2, 2048))
        for rows, down_depth in ((8, 256), (4, 512), (16, 128), (8, 512))
        for warps in (4, 8)
    ]


def gpt_oss_variant(shape: MoeShape) -> dict[str, Any]:
    """A gpt-oss shape's random biases and its activation (the experts' keywords); none for
    another shape."""
    if not shape.gpt_oss:
        return {}
    experts, hidden, intermediate = shape.local_experts, shape.hidden, shape.intermediate
    return {
        "w13_bias": torch.randn(experts, 2 * intermediate, device=DEVICE, dtype=DTYPE),
        "w2_bias": torch.randn(experts, hidden, device=DEVICE, dtype=DTYPE) * 0.1,
        "activation": GPT_OSS_ACTIVATION,
    }


def random_mxfp4_layers(shape: MoeShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rank's experts as MXFP4 bytes and scales (``mxfp4_moe``'s keywords; scales 2 ** -8
    to 2 ** -6, for products of about unit size over thousands of depth), and the same
    dequantized to bf16 (the reference's); a gpt-oss shape's with their biases and
    activation."""
    experts, hidden, intermediate = shape.local_experts, shape.hidden, shape.intermediate

    def packed(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(
            0, 256, (experts, rows, columns // 2), dtype=torch.uint8, device=DEVICE
        )
        blocks = (experts, rows, columns // MXFP4_BLOCK)
        scales = torch.randint(119, 122, blocks, dtype=torch.uint8, device=DEVICE)
        return codes, scales

    w13, w13_scale = packed(2 * intermediate, hidden)
    w2, w2_scale = packed(hidden, intermediate)
    variant = gpt_oss_variant(shape)
    mxfp4 = {"w13": w13, "w2": w2, "w13_scale": w13_scale, "w2_scale": w2_scale} | variant
    bf16 = {
        "w13": dequantize_mxfp4(w13.unflatten(-1, (-1, 16)), w13_scale, DTYPE),
        "w2": dequantize_mxfp4(w2.unflatten(-1, (-1, 16)), w2_scale, DTYPE),
        "w13_scale": None,
        "w2_scale": None,
    } | variant
    return mxfp4, bf16


def random_layer(shape: MoeShape, fp8: bool) -> dict[str, Any]:
    """The rank's experts, random, in bf16 or as FP8 codes with per-channel scales; a
    gpt-oss shape's with their biases and activation (``fused_moe``'s keywords)."""
    experts, hidden, intermediate = shape.local_experts, shape.hidden, shape.intermediate
    w13 = torch.randn(experts, 2 * intermediate, hidden, device=DEVICE, dtype=DTYPE)
    w2 = torch.randn(experts, hidden, intermediate, device=DEVICE, dtype=DTYPE)
    w13 *= hidden**-0.5
    w2 *= intermediate**-0.5
    layer = gpt_oss_variant(shape)
    if not fp8:
        return layer | {"w13": w13, "w2": w2, "w13_scale": None, "w2_scale": None}
    for name, weight in (("w13", w13), ("w2", w2)):
        codes = torch.empty(weight.shape, dtype=FP8, device=DEVICE)
        scale = torch.empty(weight.shape[:2], device=DEVICE)
        for expert in range(experts):  # one at a time: float32 copies of a few at most
            codes[expert], scale[expert] = quantize_per_channel(weight[expert], FP8)
        layer[name], layer[f"{name}_scale"] = codes, scale
    return layer


def random_routing(num_tokens: int, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of random logits over all the model's experts, renormalized."""
    logits = torch.randn(num_tokens, shape.experts, device=DEVICE)
    weights, ids = logits.softmax(-1).topk(shape.top_k)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def assert_matches_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    layer: dict[str, Any],
) -> None:
    """``fused_moe``'s ``out`` within two units of bf16's rounding of the float32 reference,
    in norm. Absolute, not relative: where no pick is local (a rank's experts at a few tokens)
    the reference is all zeros, and so must the output be, exactly.

    W8A8 (FP8 weights past 16 tokens): against the reference with the activations quantized
    alike, plus a tenth of what quantizing them changes. The kernel's sums (Hopper's FP8 MMA
    accumulates with fewer bits than float32) may put an activation on the other side of a
    bf16 rounding, and then of an e4m3 one: a few codes one step off, far less than that tenth
    (on the CPU, float64 against float32 sums: under a hundredth of bf16's rounding), while a
    missing scale or quantization costs it several times over."""
    num_tokens = x.shape[0]
    w13 = layer["w13"]
    assert w13 is not None
    w8a8 = quantizes_activations(num_tokens, w13.dtype)
    reference = moe_experts_reference(x, weights, ids, **layer, quantize_activations=w8a8)
    error = (out.float() - reference).norm().item()
    rounding = (reference.to(out.dtype).float() - reference).norm().item()
    allowance = 0.0
    if w8a8:
        unquantized = moe_experts_reference(x, weights, ids, **layer)
        allowance = (reference - unquantized).norm().item() / 10
    assert error <= 2 * rounding + allowance, (
        f"{num_tokens} tokens: error {error:.3g} > 2 x rounding {rounding:.3g} + {allowance:.3g}"
    )


def assert_replays_for_any_routing(
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    reference_layer: dict[str, Any],
    shape: MoeShape,
    num_tokens: int,
) -> None:
    """``experts(x, weights, ids)`` captured in a CUDA graph for one random routing of
    ``num_tokens`` tokens, replayed for another and for the most uneven one (every token's
    picks the same K experts: one expert's pairs over several tiles, the others' none): each
    replay's output equals an eager run's on the same inputs, bit for bit, and the reference's
    of ``reference_layer``. Nothing in the captured launches may depend on the routing."""
    x = torch.randn(num_tokens, shape.hidden, device=DEVICE, dtype=DTYPE)
    weights, ids = random_routing(num_tokens, shape)
    graph, captured = captured_graph(lambda: experts(x, weights, ids))
    uneven = torch.arange(shape.top_k, device=DEVICE, dtype=torch.int32).expand_as(ids)
    for new_ids in (random_routing(num_tokens, shape)[1], uneven):
        x.copy_(torch.randn_like(x))
        weights.copy_(random_routing(num_tokens, shape)[0])
        ids.copy_(new_ids)
        graph.replay()
        eager = experts(x, weights, ids)
        assert torch.equal(captured, eager)
        assert_matches_reference(captured, x, weights, ids, reference_layer)


def moe_case(
    shape: MoeShape,
    num_tokens: int,
    layer: dict[str, Any],
    rates: DeviceRates,
    time_ms: Timer,
    sweep: bool = False,
    reference_layer: dict[str, Any] | None = None,
) -> MoeResult:
    """Check, then time one layer's experts at ``num_tokens`` tokens with the rule's
    configuration (and, sweeping, each candidate's). MXFP4 experts (a uint8 ``w13``) run
    ``mxfp4_moe``, checked against ``reference_layer`` (theirs dequantized)."""
    reference_layer = reference_layer or layer
    x = torch.randn(num_tokens, shape.hidden, device=DEVICE, dtype=DTYPE)
    weights, ids = random_routing(num_tokens, shape)
    w13 = layer["w13"]
    assert w13 is not None
    mxfp4 = w13.dtype == torch.uint8
    experts = mxfp4_moe if mxfp4 else fused_moe
    assert_matches_reference(experts(x, weights, ids, **layer), x, weights, ids, reference_layer)

    local = ids[ids < shape.local_experts]
    touched = local.unique().numel()
    # MXFP4: half a byte a value and a scale byte a block
    value_bytes = 0.5 + 1 / MXFP4_BLOCK if mxfp4 else w13.dtype.itemsize
    weight_bytes = int(touched * 3 * shape.hidden * shape.intermediate * value_bytes)
    flops = 2 * local.numel() * 3 * shape.hidden * shape.intermediate
    w8a8 = quantizes_activations(num_tokens, w13.dtype)
    sizes = (num_tokens, shape.top_k, shape.local_experts, shape.hidden, shape.intermediate)
    if mxfp4:
        rule: MoeConfig | MoeDecodeConfig = mxfp4_moe_config(*sizes)
        grouped = grouped_mxfp4_config(*sizes[:3])
        neighbours = (
            [grouped, *mxfp4_decode_candidates()]
            if isinstance(rule, MoeDecodeConfig)
            else candidates(rule, grouped, None)
        )
    else:
        shape_args = (*sizes, sm_count(x.device), w13.dtype, FP8 if w8a8 else DTYPE)
        rule = moe_config(*shape_args)
        by_pair = None if w8a8 else moe_decode_config(shape.top_k)  # weight-only by pair
        neighbours = candidates(rule, grouped_config(*shape_args), by_pair)

    def timed(config: MoeConfig | MoeDecodeConfig) -> float:
        def run() -> None:
            experts(x, weights, ids, **layer, config=config)

        try:
            if isinstance(config, MoeDecodeConfig):  # its variants checked, not only the rule's
                out = experts(x, weights, ids, **layer, config=config)
                assert_matches_reference(out, x, weights, ids, reference_layer)
            return time_ms(run)
        except triton.runtime.errors.OutOfResources:  # a candidate's stages overflow
            return float("inf")

    ms = timed(rule)
    best = None
    if sweep:
        best = sorted(((describe(c), timed(c) * 1e3) for c in neighbours), key=lambda b: b[1])[
            :_SHOWN_CANDIDATES
        ]
    seconds = ms / 1e3
    traffic = StepTraffic(weight_bytes, 0, flops) if w8a8 else StepTraffic(weight_bytes, flops, 0)
    bound = traffic_bound(traffic, rates)
    return MoeResult(
        touched,
        describe(rule),
        ms * 1e3,
        weight_bytes,
        weight_bytes / seconds / rates.bytes_per_s,
        bound / seconds,
        best,
    )


def run_moe(
    shape_names: list[str],
    tokens: list[int],
    weights: str,
    rates: DeviceRates,
    time_ms: Timer,
    sweep: bool = False,
) -> None:
    """Print the table for each shape, its experts' ``weights`` "bf16", "fp8" or "mxfp4"
    (sweeping: with the fastest candidate's time)."""
    print(
        f"\n{'shape':>24} {'weights':>7} {'T':>5} {'experts':>7} {'config':>27} "
        f"{'us':>9} {'MB':>8} {'GB/s':>7} {'of copy':>8} {'of roofline':>11}"
        + (f" {'best candidate':>27} {'us':>9}" if sweep else "")
    )
    for name in shape_names:
        shape = SHAPES[name]
        if weights == "mxfp4":
            layer, reference_layer = random_mxfp4_layers(shape)
        else:
            layer = reference_layer = random_layer(shape, weights == "fp8")
        for num_tokens in tokens:
            result = moe_case(shape, num_tokens, layer, rates, time_ms, sweep, reference_layer)
            best = f" {result.best[0][0]:>27} {result.best[0][1]:9.1f}" if result.best else ""
            print(
                f"{name:>24} {weights:>7} {num_tokens:5d} "
                f"{result.touched:7d} {result.config:>27} {result.us:9.1f} "
                f"{result.weight_bytes / 1e6:8.1f} "
                f"{result.weight_bytes / (result.us / 1e6) / 1e9:7.0f} "
                f"{result.copy_share:8.0%} {result.roofline_share:11.0%}{best}"
            )
            if result.best:
                print(
                    "    next fastest: " + ", ".join(f"{d} {us:.1f}" for d, us in result.best[1:])
                )
        del layer, reference_layer
        torch.cuda.empty_cache()
