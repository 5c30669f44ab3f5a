"""A physical lower bound on a run's time, from the steps the engine actually ran.

Each step (one forward pass) must at least move its bytes through the device's memory and
do its arithmetic; it takes no less than the larger of the two:

- bytes over the measured copy bandwidth: every weight the step reads (the decoder layers
  and final norm always, the LM head when the step computes logits, one embedding row a
  token), the K/V of the cache that its queries attend to (written by earlier steps), and
  the K/V it writes. A mixture of experts' layer reads only the experts its tokens are routed
  to: min(E, T * k) of its E experts at T tokens of k experts each (a token's k at batch 1,
  all of them once T * k reaches E, as if the router spread the tokens evenly);
- FLOPs over the measured dense bf16 GEMM rate: two a weight a token in the layers' matrix
  products (of an expert's, for the k experts a token goes through), two a head weight a
  logits row, and four a (query, key) pair a head a
  dimension in attention (QK^T and PV), causal and within a layer's sliding window. The
  products of FP8 weights (``--quantization fp8``, multiplied in FP8 past a few tokens) count
  at the measured FP8 GEMM rate, about twice as fast on Hopper. MXFP4 experts
  (``--quantization mxfp4``) weigh half a byte a value and a scale byte a block of 32, and
  multiply at the bf16 rate (the kernels widen them to bf16).

A step's new tokens attend to K/V they wrote themselves, which a fused kernel need not read
back: only the keys cached before the step count as read. Activations count for nothing, so
the bound is below any real step; "% of roofline" is the bound over the time measured.

The engine keeps a ``StepShape`` a step only when asked (``LLMEngine.step_shapes``, or the
engine process's ``--step-record`` file); benchmarks measure the two rates on their own
device at the start of the run (``measure_rates``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from engine.models.moe import FusedExperts
from engine.scheduling.request import Request


@dataclass(frozen=True)
class StepShape:
    """One forward pass as it ran: each sequence's new tokens and its context after them,
    and how many rows of logits it computed (sampled rows and scored prompt positions)."""

    query_lens: np.ndarray  # [B] int64
    context_lens: np.ndarray  # [B] int64, the new tokens included
    num_logits: int

    @classmethod
    def of(cls, batch: Sequence[Request], num_logits: int) -> StepShape:
        """The shape of ``batch``'s step, read after the runner launched it (its requests'
        cached tokens then include the step's)."""
        count = len(batch)
        return cls(
            np.fromiter((r.num_scheduled_tokens for r in batch), np.int64, count),
            np.fromiter((r.num_cached_tokens for r in batch), np.int64, count),
            num_logits,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @property
    def is_decode(self) -> bool:
        return bool((self.query_lens == 1).all())


def save_steps(path: str | Path, steps: Iterable[StepShape]) -> None:
    """Write ``steps`` as JSON: one [query_lens, context_lens, num_logits] list a step."""
    rows = [[s.query_lens.tolist(), s.context_lens.tolist(), s.num_logits] for s in steps]
    Path(path).write_text(json.dumps(rows))


def load_steps(path: str | Path) -> list[StepShape]:
    return [
        StepShape(np.array(q, np.int64), np.array(c, np.int64), n)
        for q, c, n in json.loads(Path(path).read_text())
    ]


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model costs per unit of work: bytes, FLOPs and the attention's
    shape, layer by layer."""

    layer_weight_bytes: int  # the decoder layers' and the final norm's weights
    head_weight_bytes: int  # the LM head (the embedding table when tied)
    embedding_row_bytes: int  # one token's embedding row
    layer_matmul_params: int  # elements of the layers' matrices: 2 FLOPs each a token
    head_params: int  # hidden_size * vocab_size: 2 FLOPs each a logits row
    kv_bytes_per_token: int  # one token's K and V in one layer
    attention_flops_per_pair: int  # 4 * num_heads * head_dim: a (query, key) pair in one layer
    windows: tuple[int | None, ...]  # each layer's sliding window; None: full attention
    fp8_matmul_params: int = 0  # of layer_matmul_params, those stored as FP8
    # A mixture of experts' experts, every layer's (apart from the layers' weights above): their
    # matrices' bytes and elements, how many experts a layer has and how many a token uses.
    expert_weight_bytes: int = 0
    expert_matmul_params: int = 0
    fp8_expert_matmul_params: int = 0  # of expert_matmul_params, those stored as FP8
    num_experts: int = 1
    experts_per_token: int = 0

    def expert_bytes(self, tokens: int) -> int:
        """The expert weights a step of ``tokens`` tokens reads at least: min(E, tokens * k)
        of each layer's E experts."""
        touched = min(self.num_experts, tokens * self.experts_per_token)
        return self.expert_weight_bytes * touched // self.num_experts

    def expert_flops(self, tokens: int) -> tuple[int, int]:
        """The FLOPs of ``tokens`` tokens through k experts each: in the model's dtype, and
        of FP8 experts."""
        per_token = 2 * self.experts_per_token * tokens
        fp8 = per_token * self.fp8_expert_matmul_params // self.num_experts
        return per_token * self.expert_matmul_params // self.num_experts - fp8, fp8

    @classmethod
    def of_model(cls, model: nn.Module, kv_dtype: torch.dtype) -> ModelCost:
        """The cost of a ``CausalLM`` (any device, the meta device included) whose K/V cache
        holds ``kv_dtype``. Matrices are the layers' 2-D parameters, whatever module holds
        them."""
        layers = model.layers
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        expert_params = [p for m in experts for p in (m.w13, m.w2)]
        # MXFP4 experts' scales (buffers) are read with their matrices.
        expert_scales = [s for m in experts if m.mxfp4 for s in (m.w13_scale, m.w2_scale)]
        in_experts = {id(p) for p in expert_params}
        layer_params = [
            p for layer in layers for p in layer.parameters() if id(p) not in in_experts
        ]
        norm_bytes = sum(p.numel() * p.element_size() for p in model.norm.parameters())
        embedding = model.embed_tokens.weight
        head = embedding if model.lm_head is None else model.lm_head.weight
        attention = layers[0].self_attn
        return cls(
            layer_weight_bytes=sum(p.numel() * p.element_size() for p in layer_params) + norm_bytes,
            head_weight_bytes=head.numel() * head.element_size(),
            embedding_row_bytes=embedding.shape[1] * embedding.element_size(),
            layer_matmul_params=sum(p.numel() for p in layer_params if p.dim() == 2),
            fp8_matmul_params=sum(
                p.numel() for p in layer_params if p.dim() == 2 and p.dtype == torch.float8_e4m3fn
            ),
            head_params=head.numel(),
            kv_bytes_per_token=2 * attention.num_kv_heads * attention.head_dim * kv_dtype.itemsize,
            attention_flops_per_pair=4 * attention.num_heads * attention.head_dim,
            windows=tuple(layer.self_attn.sliding_window for layer in layers),
            expert_weight_bytes=sum(
                p.numel() * p.element_size() for p in [*expert_params, *expert_scales]
            ),
            expert_matmul_params=sum(_matrix_values(p) for p in expert_params),
            fp8_expert_matmul_params=sum(
                p.numel() for p in expert_params if p.dtype == torch.float8_e4m3fn
            ),
            num_experts=experts[0].num_experts if experts else 1,
            experts_per_token=experts[0].experts_per_token if experts else 0,
        )


def _matrix_values(matrix: torch.Tensor) -> int:
    """The values an expert matrix holds: two a byte in MXFP4 (uint8), else one an element."""
    return matrix.numel() * (2 if matrix.dtype == torch.uint8 else 1)


def _visible_keys_below(n: np.ndarray, window: int | None) -> np.ndarray:
    """sum over k = 1..n of min(k, window): the keys the queries at positions 0..n-1 see."""
    if window is None:
        return n * (n + 1) // 2
    w = window
    return np.where(n <= w, n * (n + 1) // 2, w * (w + 1) // 2 + (n - w) * w)


class StepTraffic(NamedTuple):
    """What a step cannot do without."""

    num_bytes: int
    flops: int  # at the bf16 GEMM rate
    fp8_flops: int  # the FP8 weights' products, at the FP8 rate


def cache_read_bytes(step: StepShape, cost: ModelCost) -> int:
    """The K/V the step's attention reads from the cache: each sequence's cached tokens, as
    far back as each layer's window reaches (queries at positions cached.. see keys back to
    position - window + 1)."""
    cached = step.context_lens - step.query_lens
    tokens = sum(
        int((cached if window is None else np.minimum(cached, window - 1)).sum())
        for window in cost.windows
    )
    return tokens * cost.kv_bytes_per_token


def step_traffic(step: StepShape, cost: ModelCost) -> StepTraffic:
    """The bytes and FLOPs the step cannot do without."""
    tokens = step.num_tokens
    cached = step.context_lens - step.query_lens
    attention_pairs = 0
    for window in cost.windows:
        attention_pairs += int(
            (
                _visible_keys_below(step.context_lens, window) - _visible_keys_below(cached, window)
            ).sum()
        )
    kv_written_tokens = tokens * len(cost.windows)
    head = step.num_logits > 0
    weight_bytes = (
        cost.layer_weight_bytes
        + cost.expert_bytes(tokens)
        + (cost.head_weight_bytes if head else 0)
        + tokens * cost.embedding_row_bytes
    )
    kv_bytes = cache_read_bytes(step, cost) + kv_written_tokens * cost.kv_bytes_per_token
    expert_flops, fp8_expert_flops = cost.expert_flops(tokens)
    flops = (
        2 * (cost.layer_matmul_params - cost.fp8_matmul_params) * tokens
        + expert_flops
        + 2 * cost.head_params * step.num_logits
        + cost.attention_flops_per_pair * attention_pairs
    )
    fp8_flops = 2 * cost.fp8_matmul_params * tokens + fp8_expert_flops
    return StepTraffic(weight_bytes + kv_bytes, flops, fp8_flops)


@dataclass(frozen=True)
class DeviceRates:
    """What the device sustains, measured: copy bandwidth and dense GEMM rates."""

    bytes_per_s: float
    flops_per_s: float
    # FP8 products (rowwise scales, as the engine's W8A8 layers); None where none were
    # measured (the CPU, GPUs before Ada): FP8 layers then count at flops_per_s.
    fp8_flops_per_s: float | None = None

    def describe(self) -> str:
        gemm = f"GEMM {self.flops_per_s / 1e12:.1f}"
        if self.fp8_flops_per_s is not None:
            gemm += f", FP8 {self.fp8_flops_per_s / 1e12:.1f}"
        return f"copy {self.bytes_per_s / 1e9:.0f} GB/s, {gemm} TFLOP/s"


def traffic_bound(traffic: StepTraffic, rates: DeviceRates) -> float:
    """Seconds ``traffic`` takes at least: its bytes at the bandwidth or its FLOPs at the
    GEMM rates, whichever is longer."""
    arithmetic = traffic.flops / rates.flops_per_s + traffic.fp8_flops / (
        rates.fp8_flops_per_s or rates.flops_per_s
    )
    return max(traffic.num_bytes / rates.bytes_per_s, arithmetic)


def step_bound(step: StepShape, cost: ModelCost, rates: DeviceRates) -> float:
    """Seconds the step takes at least."""
    return traffic_bound(step_traffic(step, cost), rates)


def run_bound(steps: Iterable[StepShape], cost: ModelCost, rates: DeviceRates) -> float:
    """Seconds a run of ``steps`` takes at least: the sum of its steps' bounds."""
    return sum(step_bound(s, cost, rates) for s in steps)


def workload_bound(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    max_num_seqs: int,
    cost: ModelCost,
    rates: DeviceRates,
    prompts_cached: bool = False,
) -> float:
    """Seconds the workload takes at least, whatever steps an engine chooses: the larger of
    its bytes over the bandwidth and its FLOPs over the GEMM rates, over the whole run. Its
    bytes are every K/V read and write its tokens need, and the weights read once a step,
    for as few steps as can make its tokens: as many as its longest request has tokens (one
    step computes every prompt, each later one every running request's next token), and at
    least the output tokens over ``max_num_seqs``. With ``prompts_cached`` only each
    prompt's last token is computed, the rest found in the prefix cache. Computing and
    reading overlap across the whole run here, so the bound of an engine's own steps
    (``run_bound``) is never below it."""
    prompts = np.asarray(prompt_lens, np.int64)
    outputs = np.asarray(output_lens, np.int64)
    computed = np.ones_like(prompts) if prompts_cached else prompts
    steps = [StepShape(computed, prompts, len(prompts))]
    for t in range(1, int(outputs.max())):
        live = outputs > t
        batch = int(live.sum())
        steps.append(StepShape(np.ones(batch, np.int64), prompts[live] + t, batch))
    traffic = [step_traffic(step, cost) for step in steps]
    more_steps = max(0, -(-int(outputs.sum()) // max_num_seqs) - len(steps))
    total = StepTraffic(
        sum(t.num_bytes for t in traffic)
        + more_steps
        * (cost.layer_weight_bytes + cost.expert_bytes(max_num_seqs) + cost.head_weight_bytes),
        sum(t.flops for t in traffic),
        sum(t.fp8_flops for t in traffic),
    )
    return traffic_bound(total, rates)


def share_of_roofline(bound_s: float, measured_s: float) -> str:
    return f"{bound_s / measured_s:.0%}"


def uneven_routing_note(cost: ModelCost, shares: Iterable[float]) -> str | None:
    """What a benchmark prints under its shares where one is above 100% for a mixture of
    experts: the bound counts min(E, T * k) experts a layer (the tokens spread evenly), which a
    step whose tokens went to fewer (random weights' routing is uneven) does not read; None
    otherwise."""
    if cost.num_experts == 1 or all(share <= 1 for share in shares):
        return None
    return (
        "(a share above 100%: the bound has a layer's tokens reach min(E, tokens x k) "
        "experts, as if routed evenly; this run's reached fewer: random weights route unevenly)"
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run``, after one untimed."""
    run()
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        started = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def measure_rates(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> DeviceRates:
    """Copy bandwidth (a device-to-device copy reads and writes every byte) and the rate of
    a large square matrix product in ``dtype`` (and in FP8 where the GPU has FP8 products),
    each the best of a few timings. On CUDA, 1 GiB copies and 8192-wide products; smaller on
    the CPU, where they only make the benchmarks' arithmetic testable."""
    cuda = device.type == "cuda"
    elements = (1 << 29) if cuda else (1 << 22)
    source = torch.empty(elements, dtype=dtype, device=device)
    target = torch.empty_like(source)
    copies = 10

    def copy() -> None:
        for _ in range(copies):
            target.copy_(source)

    copy_s = _best_seconds(copy, device, 3) / copies
    n = 8192 if cuda else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    products = 10 if cuda else 2

    def gemm() -> None:
        for _ in range(products):
            torch.mm(a, b)

    gemm_s = _best_seconds(gemm, device, 3) / products
    fp8_s = None
    if cuda and torch.cuda.get_device_capability(device) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b8 column-major
        ones_a = torch.ones(n, 1, device=device)
        ones_b = torch.ones(1, n, device=device)

        def fp8_gemm() -> None:
            for _ in range(products):
                torch._scaled_mm(a8, b8, scale_a=ones_a, scale_b=ones_b, out_dtype=dtype)

        fp8_s = _best_seconds(fp8_gemm, device, 3) / products
    return DeviceRates(
        2 * source.nbytes / copy_s,
        2 * n**3 / gemm_s,
        None if fp8_s is None else 2 * n**3 / fp8_s,
    )
