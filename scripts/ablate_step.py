"""What each part of a decode step costs inside its CUDA graph: the step timed with that
part's kernels left out of the captured graph.

    python scripts/ablate_step.py --model DIR --load-format dummy --without attention
                                  [--batch 1] [--context 512] [--steps 50] [--rounds 5]

``profile_step.py`` times each kernel, but with dependent launches a kernel's time includes
its wait for the one before, and with plain launches (``TANDEM_PDL=0``) each kernel's ramp
and tail, which the graph's dependent launches overlap. What a part costs the step is what
the step loses without it. The parts (``--without``, repeatable):

- ``none``: the step as it is, to compare against;
- ``attention``: the decode attention kernel (its output is its query);
- ``routing``: a mixture of experts' router product and routing (fixed experts, spread over
  the layer's, with equal weights);
- ``route-kernel``: the routing kernel alone (the router's product kept);
- ``experts``: a mixture of experts' expert kernels (the block's output is its input);
- ``head-norms``: the per-head Q/K norms of the batch-1 QKV kernel (Qwen3's, Gemma 3's:
  ``one_row_qkv.py``), whose head's last program norms it after the others' counts; the
  kernel projects and rotates without them, in the configuration the norms choose (the
  rule picks another without them). What moving the norms elsewhere (into attention, which
  reads each head whole) could win at most.

The tokens are garbage without a part; only the timing means anything. The rounds' median
and range are printed, in milliseconds a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from profile_step import MAX_NEW_TOKENS, start_requests

import engine.backends.triton.backend as triton_backend
from engine.backends.triton.one_row_matmul import row_operands
from engine.backends.triton.one_row_qkv import one_row_qkv_config
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import moe

PARTS = ("none", "attention", "routing", "route-kernel", "experts", "head-norms")


def fixed_routing(
    device: torch.device, experts: int, top_k: int
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """A routing that every token takes: ``top_k`` experts spread over ``experts``."""
    ids = (torch.arange(top_k, device=device, dtype=torch.int32) * (experts // top_k))[None]
    weights = torch.full((1, top_k), 1.0 / top_k, device=device, dtype=torch.float32)

    def route(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens == 1:
            return weights, ids
        return weights.expand(tokens, -1).contiguous(), ids.expand(tokens, -1).contiguous()

    return route


def leave_out(parts: list[str], device: torch.device, experts: int, top_k: int) -> None:
    """Patch the modules so that graphs captured from now on lack ``parts``' kernels."""
    route = fixed_routing(device, experts, top_k) if experts else None
    if "attention" in parts:
        triton_backend.paged_decode_attention = lambda q, *args, **kwargs: q
    if "routing" in parts:
        moe.SparseMoeBlock.route = lambda self, x: route(x.shape[0])
    if "route-kernel" in parts:
        triton_backend.TritonLayerOps.moe_route = lambda self, logits, top_k, renormalize: route(
            logits.shape[0]
        )
    if "experts" in parts:
        moe.FusedExperts.forward = lambda self, x, weights, ids: x
    if "head-norms" in parts:
        with_norms = triton_backend.one_row_qkv_rotary_store

        def without_head_norms(*args: Any) -> torch.Tensor:
            x, weight, scale, rotary = args[0], args[1], args[2], args[-1]
            channels, depth = weight.shape
            normed = row_operands(x, weight, scale).normed
            config = one_row_qkv_config(channels, depth, weight.dtype, normed, head_norms=True)
            unnormed = dataclasses.replace(rotary, q_norm=None, k_norm=None)
            return with_norms(*args[:-1], unnormed, config=config)

        triton_backend.one_row_qkv_rotary_store = without_head_norms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--quantization")
    parser.add_argument("--without", action="append", choices=PARTS, default=[])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=args.batch,
        max_model_len=args.context + MAX_NEW_TOKENS,
        quantization=args.quantization,
        load_format=args.load_format,
    )
    hf_config = json.loads((Path(args.model) / "config.json").read_text())
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0
    top_k = hf_config.get("num_experts_per_tok", 0)
    leave_out(args.without, torch.device(args.device), experts, top_k)
    engine = LLMEngine(config)
    start_requests(engine, args.batch, args.context)
    for _ in range(args.steps):
        engine.step()
    round_ms = []
    for _ in range(args.rounds):
        engine.sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        engine.sync()
        round_ms.append((time.perf_counter() - started) * 1e3 / args.steps)
    without = "+".join(args.without) or "none"
    print(
        f"without {without}: {statistics.median(round_ms):.4f} ms a step "
        f"({min(round_ms):.4f}-{max(round_ms):.4f}), batch {args.batch}, context {args.context}"
    )


if __name__ == "__main__":
    main()
