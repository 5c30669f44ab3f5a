"""The one-row kernel's configurations (``engine/backends/triton/one_row_matmul.py``), each
timed on every batch-1 linear layer of the default models and of their tensor-parallel
shards: which one wins where, and by how much.

    python scripts/sweep_one_row.py [--shapes llama-3.2-1b llama-3.1-8b qwen3-0.6b]
                                    [--tensor-parallel 1 2 4] [--weights bf16 fp8]
                                    [--repeats 5]

Why: the engine lets Triton's autotuner time the configurations at start-up, and the
configurations sum a row in different orders. Two engine processes can then pick
differently, and a bf16 near-tie between two logits can go either way: the same model's
replicas gave different greedy tokens (`docs/benchmarks.md`, thirteenth session). This sweep
is the data for choosing by shape instead.

Each configuration runs alone (the autotuner given that one), timed by
``triton.testing.do_bench`` (L2 flushed before each call, as a step's other layers leave
it); the median of --repeats such timings, in µs. A table per weight dtype, then each
configuration's total over the layers against the sum of the per-layer bests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.testing

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from engine.backends.triton import one_row_matmul as one_row  # noqa: E402
from tests.random_checkpoint import SHAPES  # noqa: E402


def layers(shape: str, tensor_parallel: int) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, gated) of one rank's batch-1 linear layers: Q/K/V and gate/up split
    by columns, o and down by rows, the LM head by vocabulary."""
    config = SHAPES[shape][2]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    kv_heads = max(1, config["num_key_value_heads"] // tensor_parallel)
    q_width = heads * head_dim // tensor_parallel
    intermediate = config["intermediate_size"] // tensor_parallel
    return [
        ("qkv", q_width + 2 * kv_heads * head_dim, hidden, False),
        ("o", hidden, q_width, False),
        ("gate_up", 2 * intermediate, hidden, False),
        ("down", hidden, intermediate, True),
        ("lm_head", config["vocab_size"] // tensor_parallel, hidden, False),
    ]


def layer_inputs(
    channels: int, depth: int, gated: bool, weights: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A random row (gate and up halves when ``gated``), weight and its scales (fp8 codes)."""
    x = torch.randn(1, 2 * depth if gated else depth, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(channels, depth, device="cuda", dtype=torch.bfloat16)
    if weights == "fp8":
        return x, weight.to(torch.float8_e4m3fn), torch.ones(channels, device="cuda")
    return x, weight, None


def time_config(
    config: triton.Config,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    gated: bool,
    repeats: int,
) -> float:
    """Median µs of one_row_matmul on ``inputs`` with only ``config`` to choose from."""
    kernel = one_row._one_row_kernel
    kernel.configs = [config]
    kernel.cache.clear()
    x, weight, scale = inputs

    def run() -> None:
        one_row.one_row_matmul(x, weight, scale, gated=gated)

    return statistics.median(
        triton.testing.do_bench(run, warmup=5, rep=25) * 1000 for _ in range(repeats)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b"]
    )
    parser.add_argument("--tensor-parallel", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    configs = list(one_row._one_row_kernel.configs)
    names = [f"{c.kwargs['BLOCK_N']}/{c.kwargs['BLOCK_BYTES']}/{c.num_warps}w" for c in configs]
    print(f"{torch.cuda.get_device_name()}: configurations BLOCK_N/BLOCK_BYTES/warps, µs")
    for weights in args.weights:
        totals, best_total = [0.0] * len(configs), 0.0
        print(f"\n{weights} weights")
        print(f"{'layer':34} " + " ".join(f"{n:>12}" for n in names) + "  best   margin")
        for shape in args.shapes:
            for size in args.tensor_parallel:
                for name, channels, depth, gated in layers(shape, size):
                    if weights != "bf16" and name == "lm_head":
                        continue  # the LM head stays in the model's dtype
                    inputs = layer_inputs(channels, depth, gated, weights)
                    times = [time_config(c, inputs, gated, args.repeats) for c in configs]
                    ranked = sorted(range(len(times)), key=times.__getitem__)
                    margin = times[ranked[1]] / times[ranked[0]] - 1
                    totals = [t + u for t, u in zip(totals, times, strict=True)]
                    best_total += times[ranked[0]]
                    label = f"{shape} TP={size} {name} {channels}x{depth}"
                    print(
                        f"{label:34} "
                        + " ".join(f"{t:12.1f}" for t in times)
                        + f"  {names[ranked[0]]:>5} {margin:6.1%}"
                    )
        print(f"{'all layers':34} " + " ".join(f"{t:12.1f}" for t in totals))
        print(
            f"{'against the per-layer bests':34} "
            + " ".join(f"{t / best_total - 1:12.1%}" for t in totals)
        )


if __name__ == "__main__":
    main()
