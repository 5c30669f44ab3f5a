"""The small-batch matmul kernels' configurations, each timed on the linear layers of the
default models and of their tensor-parallel shards, against the configuration the engine's
rule chooses: how much the rule leaves on the table, layer by layer.

    python scripts/sweep_matmul_configs.py [--shapes llama-3.2-1b llama-3.1-8b qwen3-0.6b]
                                           [--tensor-parallel 1 2 4] [--repeats 3]
                                           [--parts one-row tiled chain qkv] [--json FILE]
                                           [--qkv-weights bf16 fp8]

- one-row: ``one_row_matmul`` (a batch-1 step's linear layers and LM head), bf16 and fp8
  weights, each of ``ONE_ROW_CANDIDATES`` against ``one_row_config``'s pick; as the engine
  calls it: in bf16 the QKV, gate/up and LM head compute the norm before them as they read
  (``DeferredNorm``, with a residual), the down projection reads gate and up halves, and
  the LM head writes float32;
- tiled: the weight-only kernel over fp8 codes at a decode step's few rows (4, 16: split K)
  and over int8 codes at a prompt's many (32, 64, 256), each of ``tiled_candidates`` against
  ``tiled_config``'s pick; at one row, against the one-row kernel, which the engine takes for
  every batch-1 layer;
- chain: a whole model's one-row products (TP=1) in the engine's order, launched dependent
  in one CUDA graph as in a decode step, with the rule's configurations, then with each
  layer's configuration varied in turn (one pass of coordinate descent): in a chain a kernel
  overlaps the one before, which a kernel timed alone does not show;
- qkv (not in the default parts): the batch-1 QKV kernel with RoPE and the cache write
  (``one_row_qkv_rotary_store``; bf16 weights read a deferred norm's row, fp8 codes
  (``--qkv-weights fp8``) a normed row, as the engine hands them; Qwen3's per-head norms for
  the Qwen3 shapes, the MoE ones included), each candidate with the kernel's register cap
  and without, against ``one_row_qkv_config``'s pick: its programs fill a whole number of
  waves or leave a tail, which the cap (how many programs an SM holds) and the channels a
  program (how many programs) decide together;
  beside them the plain one-row product over the same weights (the rule's configuration):
  what the epilogue (RoPE, per-head norms, the cache write) adds.

Why rules and not a timer: the configurations sum in different orders, and Triton's
autotuner at start-up picked differently in different processes, so the same model's
replicas gave different greedy tokens (`docs/history/benchmarks-lab-notebook.md`).

Each call is timed by ``triton.testing.do_bench`` after an L2 flush (as a step's other layers
leave the cache), the median of --repeats such timings, in µs. The QKV kernel and the chains,
which take a few microseconds a launch, are timed as CUDA graph replays instead (launched from
Python one at a time, they run at the host's pace): the QKV kernel over copies of its weights
that together exceed the L2 cache, a copy a launch.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

from engine.backends.attention import Rotary
from engine.backends.deferred_norm import DeferredNorm
from engine.backends.triton.backend import TritonLayerOps
from engine.backends.triton.device import sm_count
from engine.backends.triton.one_row_matmul import (
    OneRowConfig,
    one_row_config,
    one_row_matmul,
)
from engine.backends.triton.one_row_qkv import (
    _MAX_REGISTERS,
    one_row_qkv_config,
    one_row_qkv_rotary_store,
)
from engine.backends.triton.quantized_matmul import (
    TiledConfig,
    tiled_config,
    tiled_matmul,
)
from tandem.testing.random_checkpoint import SHAPES, shape_dims

# (rows a program, bytes of a row a chunk, warps): 16 to 64 bytes a thread a chunk.
ONE_ROW_CANDIDATES = [
    OneRowConfig(n, b, w)
    for n, b, w in (
        (2, 2048, 4),
        (2, 4096, 4),
        (4, 1024, 4),
        (4, 2048, 4),
        (4, 2048, 8),
        (4, 4096, 8),
        (8, 512, 4),
        (8, 1024, 4),
        (8, 1024, 8),
        (8, 2048, 8),
        (16, 256, 4),
        (16, 512, 8),
    )
]
SPLIT_ROWS = (1, 4, 16)  # fp8 weight-only: a decode step of up to 16 sequences
MANY_ROWS = (32, 64, 256)  # int8 weight-only: every step
Layer = tuple[str, int, int, bool]


def tiled_candidates(rows: int) -> list[TiledConfig]:
    """Narrow column blocks with splits of K for a few rows; tall tiles for many."""
    narrow = [
        TiledConfig(16, n, k, split, w, s)
        for n, k, w, s in (
            (16, 256, 4, 4),
            (32, 256, 4, 4),
            (64, 128, 4, 4),
            (64, 256, 4, 3),
            (128, 128, 4, 3),
            (32, 512, 8, 3),
        )
        for split in ((1, 2, 4, 8) if rows <= 16 else (1,))
    ]
    tall = [
        TiledConfig(m, n, 64, 1, w, s)
        for m, n, w, s in ((64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3))
        if m <= rows
    ]
    return narrow + tall


def layers(shape: str, tensor_parallel: int) -> list[Layer]:
    """(name, N, K, gated) of one rank's linear layers: Q/K/V and gate/up split by columns,
    o and down by rows, the LM head by vocabulary."""
    d = shape_dims(shape)
    kv_heads = max(1, d.kv_heads // tensor_parallel)
    q_width = d.heads * d.head_dim // tensor_parallel
    intermediate = d.intermediate // tensor_parallel
    return [
        ("qkv", q_width + 2 * kv_heads * d.head_dim, d.hidden, False),
        ("o", d.hidden, q_width, False),
        ("gate_up", 2 * intermediate, d.hidden, False),
        ("down", d.hidden, intermediate, True),
        ("lm_head", SHAPES[shape][2]["vocab_size"] // tensor_parallel, d.hidden, False),
    ]


def takes_deferred_norm(name: str, weight_dtype: torch.dtype) -> bool:
    """Whether the engine hands layer ``name`` a deferred norm at one row
    (engine/models/layers.py): the LM head, and in bf16 the QKV and gate/up too (fp8 and int8
    projections take their norm from its own kernel)."""
    return name == "lm_head" or (name in ("qkv", "gate_up") and weight_dtype.itemsize > 1)


def weight(channels: int, depth: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random weight in ``dtype`` (bf16, or fp8 / int8 codes with unit scales)."""
    values = torch.randn(channels, depth, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        return values, None
    codes = values.to(torch.float8_e4m3fn) if dtype == "fp8" else values.clamp(-4, 4).to(torch.int8)
    return codes, torch.ones(channels, device="cuda")


def median_us(call: Callable[[], object], repeats: int) -> float:
    return statistics.median(
        triton.testing.do_bench(call, warmup=3, rep=10) * 1000 for _ in range(repeats)
    )


def graph_us(forward: Callable[[], object], repeats: int, replays: int = 20) -> float:
    """µs a replay of ``forward``'s launches captured in one CUDA graph (launched dependent,
    as in the engine's decode graph), the median of ``repeats`` timings of ``replays``
    replays: the device's time alone, where a kernel of a few microseconds launched from
    Python one at a time is timed at the host's pace."""
    forward()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(times)


def label(config: OneRowConfig | TiledConfig) -> str:
    if isinstance(config, OneRowConfig):
        return f"{config.rows}/{config.chunk_bytes}/{config.warps}w"
    c = config
    return f"{c.block_m}x{c.block_n}x{c.block_k}/s{c.split_k}/{c.warps}w{c.stages}"


def run_normed(
    row: Callable[[], DeferredNorm],
    codes: torch.Tensor,
    out_dtype: torch.dtype | None,
    config: OneRowConfig,
) -> torch.Tensor:
    """A deferred norm of the row (a new one a call: each writes its stream), then the
    product."""
    return one_row_matmul(row(), codes, out_dtype=out_dtype, config=config)


def sweep_one_row(shape_layers: list[tuple[str, Layer]], repeats: int) -> list[dict]:
    records = []
    for dtype in ("bf16", "fp8"):
        for where, (name, channels, depth, gated) in shape_layers:
            if dtype != "bf16" and name == "lm_head":
                continue  # the LM head stays in the model's dtype
            codes, scale = weight(channels, depth, dtype)
            x = torch.randn(1, 2 * depth if gated else depth, device="cuda", dtype=torch.bfloat16)
            out_dtype = torch.float32 if name == "lm_head" else None
            normed = takes_deferred_norm(name, codes.dtype)
            if normed:
                row = functools.partial(
                    DeferredNorm, x, torch.randn_like(x), x[0], 1e-5, TritonLayerOps()
                )
                run = functools.partial(run_normed, row, codes, out_dtype)
            else:
                run = functools.partial(
                    one_row_matmul, x, codes, scale, gated=gated, out_dtype=out_dtype
                )
            rule = one_row_config(channels, depth, codes.dtype, normed)
            times = {
                label(c): median_us(functools.partial(run, config=c), repeats)
                for c in [*ONE_ROW_CANDIDATES, rule]
            }
            records.append(
                {
                    "part": "one-row",
                    "dtype": dtype,
                    "layer": f"{where} {name}",
                    "N": channels,
                    "K": depth,
                    "gated": gated,
                    "rows": 1,
                    "times": times,
                    "rule": label(rule),
                }
            )
            report(records[-1])
    return records


def sweep_tiled(shape_layers: list[tuple[str, Layer]], repeats: int) -> list[dict]:
    records = []
    processors = sm_count(torch.device("cuda"))
    for dtype, row_counts in (("fp8", SPLIT_ROWS), ("int8", MANY_ROWS)):
        for where, (name, channels, depth, _gated) in shape_layers:
            if name == "lm_head":
                continue
            codes, scale = weight(channels, depth, dtype)
            for rows in row_counts:
                x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)

                run = functools.partial(tiled_matmul, x, codes, scale)
                rule = tiled_config(rows, channels, depth, processors)
                times = {
                    label(c): median_us(functools.partial(run, config=c), repeats)
                    for c in [*tiled_candidates(rows), rule]
                }
                record = {
                    "part": "tiled",
                    "dtype": dtype,
                    "layer": f"{where} {name}",
                    "N": channels,
                    "K": depth,
                    "gated": False,
                    "rows": rows,
                    "times": times,
                    "rule": label(rule),
                }
                if rows == 1:
                    one_row = median_us(functools.partial(one_row_matmul, x, codes, scale), repeats)
                    record["one_row_us"] = one_row
                records.append(record)
                report(record)
    return records


# Bytes of weights the QKV sweep cycles through, one copy a launch: more than an H100's or
# H200's L2 (50-60 MB), so that each launch reads its weights from memory as a step does.
_QKV_SWEEP_WEIGHT_BYTES = 256 << 20


def run_qkv(
    row: Callable[[], DeferredNorm],
    copies: list[torch.Tensor],
    arguments: tuple,
    rotary: Rotary,
    config: OneRowConfig,
    registers: int | None,
) -> None:
    """A deferred norm of the row (a new one a launch), then the QKV kernel, over each copy
    of the weights in turn."""
    for codes in copies:
        one_row_qkv_rotary_store(
            row(), codes, *arguments, rotary, config=config, max_registers=registers
        )


def run_product(
    row: Callable[[], DeferredNorm | torch.Tensor],
    copies: list[torch.Tensor],
    scale: torch.Tensor | None,
    config: OneRowConfig,
) -> None:
    """The row (a deferred norm of it in bf16), then the one-row product alone, over each
    copy."""
    for codes in copies:
        one_row_matmul(row(), codes, scale, config=config)


def sweep_qkv(
    shapes: list[str], tensor_parallel: list[int], repeats: int, weight_dtypes: list[str]
) -> list[dict]:
    records = []
    for shape, dtype in itertools.product(shapes, weight_dtypes):
        config_class = SHAPES[shape][0]
        d = shape_dims(shape)
        hidden, head_dim = d.hidden, d.head_dim
        head_norms = "Qwen3" in config_class.__name__
        for size in tensor_parallel:
            num_heads = d.heads // size
            num_kv_heads = max(1, d.kv_heads // size)
            channels = (num_heads + 2 * num_kv_heads) * head_dim
            codes, scale = weight(channels, hidden, dtype)
            count = max(2, _QKV_SWEEP_WEIGHT_BYTES // (codes.numel() * codes.element_size()))
            copies = [codes, *(weight(channels, hidden, dtype)[0] for _ in range(count - 1))]
            x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
            normed = takes_deferred_norm("qkv", codes.dtype)
            residual = torch.randn_like(x)
            row: Callable[[], DeferredNorm | torch.Tensor] = (
                functools.partial(DeferredNorm, x, residual, x[0], 1e-5, TritonLayerOps())
                if normed
                else functools.partial(torch.Tensor.clone, x)
            )
            cache_shape = (4, 16, num_kv_heads, head_dim)
            caches = [torch.zeros(cache_shape, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
            tables = torch.rand(256, head_dim, device="cuda")
            norm = torch.ones(head_dim, device="cuda", dtype=torch.bfloat16) if head_norms else None
            rotary = Rotary(tables, tables, norm, norm, 1e-6)
            step = [torch.tensor([value], device="cuda") for value in (5, 100)]  # slot, position

            run = functools.partial(run_qkv, row, copies, (scale, None, *caches, *step), rotary)
            rule = one_row_qkv_config(channels, hidden, codes.dtype, normed, head_norms)
            times = {
                f"{label(c)}/{registers or 'any'}r": graph_us(
                    functools.partial(run, config=c, registers=registers), repeats
                )
                / len(copies)
                for c in [*ONE_ROW_CANDIDATES, rule]
                for registers in (_MAX_REGISTERS, None)
            }
            # The same weights read by the plain one-row product (the rule's configuration,
            # no RoPE, norms or cache write): what the epilogue adds to the reads.
            product = functools.partial(run_product, row, copies, scale, rule)
            record = {
                "part": "qkv",
                "product_us": graph_us(product, repeats) / len(copies),
                "weight_bytes": codes.numel() * codes.element_size(),
                "dtype": dtype,
                "layer": f"{shape} TP={size} qkv",
                "N": channels,
                "K": hidden,
                "gated": False,
                "rows": 1,
                "times": times,
                "rule": f"{label(rule)}/{_MAX_REGISTERS}r",
            }
            records.append(record)
            report(record)
    return records


Policy = dict[str, OneRowConfig]


class OneRowChain:
    """A batch-1 step's one-row products for a whole model (TP=1), in the engine's order and
    variants, captured in one CUDA graph: what the kernels cost launched dependent one after
    the other, as in the engine's decode graph (less attention, the rotary kernel and fp8's
    norm kernels)."""

    def __init__(self, shape: str, dtype: str) -> None:
        config = SHAPES[shape][2]
        self.layers = {name: (n, k, gated) for name, n, k, gated in layers(shape, 1)}
        self.hidden = config["hidden_size"]
        self.weights = [
            {
                name: weight(n, k, dtype)
                for name, (n, k, _) in self.layers.items()
                if name != "lm_head"
            }
            for _ in range(config["num_hidden_layers"])
        ]
        self.lm_head = weight(*self.layers["lm_head"][:2], "bf16")[0]
        self.norm_weight = torch.ones(self.hidden, device="cuda", dtype=torch.bfloat16)
        self.x = torch.randn(1, self.hidden, device="cuda", dtype=torch.bfloat16)

    def weight_dtype(self, name: str) -> torch.dtype:
        return self.lm_head.dtype if name == "lm_head" else self.weights[0][name][0].dtype

    def rule(self) -> Policy:
        """The configurations the engine's rule gives these layers."""
        policy = {}
        for name, (n, k, _) in self.layers.items():
            dtype = self.weight_dtype(name)
            policy[name] = one_row_config(n, k, dtype, takes_deferred_norm(name, dtype))
        return policy

    def input_row(self, name: str, x: torch.Tensor, residual: torch.Tensor | None) -> tuple:
        """The row layer ``name`` reads, and the residual stream after it."""
        if not takes_deferred_norm(name, self.weight_dtype(name)):
            return x, x if residual is None else residual
        row = DeferredNorm(x, residual, self.norm_weight, 1e-5, TritonLayerOps())
        return row, row.stream

    def forward(self, policy: Policy) -> torch.Tensor:
        x, residual = self.x, None
        q_width = self.layers["o"][1]
        for layer in self.weights:
            row, residual = self.input_row("qkv", x, residual)
            qkv = one_row_matmul(row, *layer["qkv"], config=policy["qkv"])
            o = one_row_matmul(qkv[:, :q_width], *layer["o"], config=policy["o"])
            row, residual = self.input_row("gate_up", o, residual)
            gate_up = one_row_matmul(row, *layer["gate_up"], config=policy["gate_up"])
            x = one_row_matmul(gate_up, *layer["down"], gated=True, config=policy["down"])
        row, _ = self.input_row("lm_head", x, residual)
        return one_row_matmul(row, self.lm_head, out_dtype=torch.float32, config=policy["lm_head"])

    def time_us(self, policy: Policy, repeats: int) -> float:
        return graph_us(functools.partial(self.forward, policy), repeats)


def sweep_chains(shapes: list[str], repeats: int) -> list[dict]:
    """Per shape and weight dtype: the rule's chain, then one pass of coordinate descent
    (each layer's configuration in turn, the others held): how far the rule is from the best
    the chain finds."""
    records = []
    for shape in shapes:
        for dtype in ("bf16", "fp8"):
            chain = OneRowChain(shape, dtype)
            rule = chain.rule()
            rule_us = chain.time_us(rule, repeats)
            best, best_us = dict(rule), rule_us
            for name in chain.layers:
                for candidate in ONE_ROW_CANDIDATES:
                    trial = best | {name: candidate}
                    trial_us = chain.time_us(trial, repeats)
                    if trial_us < best_us:
                        best, best_us = trial, trial_us
            record = {
                "part": "chain",
                "shape": shape,
                "dtype": dtype,
                "rule_us": rule_us,
                "best_us": best_us,
                "rule": {name: label(c) for name, c in rule.items()},
                "best": {name: label(c) for name, c in best.items()},
            }
            print(
                f"chain {shape:14} {dtype:4}: rule {rule_us:8.1f} us, best found {best_us:8.1f} us "
                f"({rule_us / best_us - 1:+.1%}); rule {record['rule']}; best {record['best']}",
                flush=True,
            )
            records.append(record)
            del chain
            torch.cuda.empty_cache()
    return records


def report(record: dict) -> None:
    times = record["times"]
    best = min(times, key=times.get)
    rule = times[record["rule"]]
    line = (
        f"{record['part']:7} {record['dtype']:4} {record['layer']:28} {record['N']:>6}x"
        f"{record['K']:<6} rows {record['rows']:>3}: best {best:>20} {times[best]:8.1f} us, "
        f"rule {record['rule']:>20} {rule:8.1f} us ({rule / times[best] - 1:+.1%})"
    )
    if "one_row_us" in record:
        line += f"; the one-row kernel (the engine's) {record['one_row_us']:.1f} us"
    if "product_us" in record:
        gbps = record["weight_bytes"] / times[best] / 1e3
        line += f"; the product alone {record['product_us']:.1f} us; best reads {gbps:,.0f} GB/s"
    print(line, flush=True)


def summarize(records: list[dict]) -> None:
    """Per part and dtype: the rule's total time against the per-layer bests' and against
    each single configuration's."""
    print("\nTotals over the layers (µs): rule, per-layer best, rule's loss")
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for record in records:
        rows = record["rows"] if record["part"] == "tiled" else 1
        groups.setdefault((record["part"], record["dtype"], rows), []).append(record)
    for (part, dtype, rows), group in groups.items():
        rule = sum(r["times"][r["rule"]] for r in group)
        best = sum(min(r["times"].values()) for r in group)
        print(
            f"{part:7} {dtype:4} rows {rows:>3}: rule {rule:9.1f}  best {best:9.1f}  "
            f"{rule / best - 1:+6.1%}  ({len(group)} layers)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"]
    )
    parser.add_argument("--tensor-parallel", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["one-row", "tiled", "chain"],
        choices=["one-row", "tiled", "chain", "qkv"],
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every timing here")
    parser.add_argument(
        "--qkv-weights", nargs="+", default=["bf16"], choices=["bf16", "fp8"], help="qkv's"
    )
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}")
    shape_layers = [
        (f"{shape} TP={size}", layer)
        for shape in args.shapes
        for size in args.tensor_parallel
        for layer in (layers(shape, size) if {"one-row", "tiled"} & set(args.parts) else [])
    ]
    records = []
    if "one-row" in args.parts:
        records += sweep_one_row(shape_layers, args.repeats)
    if "tiled" in args.parts:
        records += sweep_tiled(shape_layers, args.repeats)
    if "qkv" in args.parts:
        records += sweep_qkv(args.shapes, args.tensor_parallel, args.repeats, args.qkv_weights)
    summarize([r for r in records if r["part"] != "chain"])
    if "chain" in args.parts:
        records += sweep_chains(args.shapes, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
