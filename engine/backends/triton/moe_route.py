"""A mixture of experts' routing in one kernel: each token's top-k experts of its router
logits and their weights (``moe_route`` of the layer ops).

PyTorch routes in five or six kernels (the float32 cast, softmax, top-k, the renormalizing
sum and division, the ids' cast), each a few microseconds of a batch-1 decode step's
graph for a few hundred bytes of work, once a layer: at 48 MoE layers they cost more than
the router's own product. Here a program per token reads its row of logits once and
writes its k ids and weights.

The top k are taken one at a time, each the largest logit left (ties to the lowest expert
id), so the ids come most probable first as ``torch.topk`` gives them. The softmax's
denominator is over every expert, or over the k chosen when renormalizing (the chosen
probabilities divided by their sum: the same weights, exponentials of the same logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Program per token: its ``TOP_K`` experts' ids (int32) and float32 weights."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < NUM_EXPERTS
    logits = tl.load(
        logits_ptr + token * NUM_EXPERTS + experts, mask=valid, other=-float("inf")
    ).to(tl.float32)
    exponentials = tl.exp(logits - tl.max(logits, axis=0))  # 0 past the experts
    remaining = logits
    # Each expert's place among the chosen, TOP_K for the others.
    place = tl.full([BLOCK_E], TOP_K, tl.int32)
    for k in tl.static_range(TOP_K):
        expert = tl.argmax(remaining, 0, tie_break_left=True)
        place = tl.where(experts == expert, k, place)
        remaining = tl.where(experts == expert, -float("inf"), remaining)
    chosen = place < TOP_K
    if RENORMALIZE:
        denominator = tl.sum(tl.where(chosen, exponentials, 0.0), axis=0)
    else:
        denominator = tl.sum(exponentials, axis=0)
    out = token * TOP_K + place
    tl.store(weights_ptr + out, exponentials / denominator, mask=chosen)
    tl.store(ids_ptr + out, experts, mask=chosen)


# One warp: a program's top k is a chain of k + 2 reductions over the experts (the max, k
# argmaxes, the sum), each within the warp by shuffles, where more warps add an exchange
# through shared memory and a barrier to each. At batch 1 the routing kernel is a link in
# the step's chain of latencies, once an MoE layer (docs/benchmarks.md, Mixtures of experts).
_ROUTE = OneVariantKernel(_route_kernel, num_warps=1)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts of contiguous router logits [T, E]: float32 weights
    and int32 ids, [T, top_k] each, the most probable first (``TorchLayerOps.moe_route``'s)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block = triton.next_power_of_2(num_experts)
    _ROUTE.launch(
        (num_tokens,),
        router_logits.device,
        router_logits,
        weights,
        ids,
        num_experts,
        top_k,
        block,
        renormalize,
        # Everything it specializes on: the constexprs, the logits' dtype and alignment
        # (new allocations, the outputs, are aligned).
        variant=(
            num_experts,
            top_k,
            renormalize,
            router_logits.dtype,
            router_logits.data_ptr() % 16 == 0,
        ),
    )
    return weights, ids
