"""A mixture of experts' routing in one kernel: each token's top-k experts of its router
logits and their weights (``moe_route`` of the layer ops).

PyTorch routes in five or six kernels (the float32 cast, softmax, top-k, the renormalizing
sum and division, the ids' cast), each a few microseconds of a batch-1 decode step's
graph for a few hundred bytes of work, once a layer: at 48 MoE layers they cost more than
the router's own product. Here a program per token reads its row of logits once and
writes its k ids and weights.

At one token whose norm was left to the layer after it (a batch-1 decode step:
``engine.backends.deferred_norm``), ``moe_route_norm`` computes the norm, the router's
product and the routing in one kernel, where the norm's kernel, the router's and this one
took three, each a launch and a few microseconds for a few kilobytes. Each program reads the
row whole and normalizes it as the norm's kernel does (``add_and_normalize``, which stores
the stream: the same values from every program; the first also stores the normalized row
for the experts), then takes a few experts' rows of the router, their logits rounded to the
model's dtype as the router's product stores them; the last program to finish (a counter,
as the split decode's merge counts) reads every logit back and routes them.

The top k are taken one at a time, each the largest logit left (ties to the lowest expert
id), so the ids come most probable first as ``torch.topk`` gives them. The softmax's
denominator is over every expert, or over the k chosen when renormalizing (the chosen
probabilities divided by their sum: the same weights, exponentials of the same logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.deferred_norm import DeferredNorm, norm_arguments
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)
from engine.backends.triton.device import zeroed_counters
from engine.backends.triton.norm import add_and_normalize
from engine.backends.triton.one_variant import OneVariantKernel


@triton.jit
def _route(logits, experts, valid, weights_ptr, ids_ptr, TOP_K: tl.constexpr, RENORMALIZE):
    """One token's ``TOP_K`` experts of its float32 ``logits`` [BLOCK_E] (-inf past the
    experts): their ids (int32) and float32 weights, stored at ``ids_ptr``, ``weights_ptr``."""
    exponentials = tl.exp(logits - tl.max(logits, axis=0))  # 0 past the experts
    remaining = logits
    # Each expert's place among the chosen, TOP_K for the others.
    place = tl.full(logits.shape, TOP_K, tl.int32)
    for k in tl.static_range(TOP_K):
        expert = tl.argmax(remaining, 0, tie_break_left=True)
        place = tl.where(experts == expert, k, place)
        remaining = tl.where(experts == expert, -float("inf"), remaining)
    chosen = (place < TOP_K) & valid
    if RENORMALIZE:
        denominator = tl.sum(tl.where(chosen, exponentials, 0.0), axis=0)
    else:
        denominator = tl.sum(exponentials, axis=0)
    tl.store(weights_ptr + place, exponentials / denominator, mask=chosen)
    tl.store(ids_ptr + place, experts, mask=chosen)


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
    out = token * TOP_K
    _route(logits, experts, valid, weights_ptr + out, ids_ptr + out, TOP_K, RENORMALIZE)


_ROUTE = OneVariantKernel(_route_kernel)


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


# Router rows a program, by the product's width: at most this many values of the router's
# rows a program holds at once (2 of a 4,096-wide model's experts, 4 of a 2,048-wide one's).
_ROUTER_VALUES = 8192
_NORM_ROUTE_WARPS = 8


@triton.jit
def _norm_route_kernel(
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    normalized_ptr,
    router_ptr,
    bias_ptr,
    logits_ptr,
    weights_ptr,
    ids_ptr,
    count_ptr,
    hidden,
    eps,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    EXPERTS: tl.constexpr,  # router rows a program
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """Program per EXPERTS router rows of the one token: the norm, their logits; the last
    program to count itself done routes the token."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    # Every program stores the same stream (x + residual): a few kilobytes.
    row = add_and_normalize(
        x_ptr, residual_ptr, norm_weight_ptr, stream_ptr, cols, mask, hidden, eps, HAS_RESIDUAL
    )
    if program == 0:
        tl.store(normalized_ptr + cols, row, mask=mask)
    experts = program * EXPERTS + tl.arange(0, EXPERTS)
    held = experts < NUM_EXPERTS
    router = tl.load(
        router_ptr + experts[:, None] * hidden + cols[None, :],
        mask=held[:, None] & mask[None, :],
        other=0.0,
    )
    logits = tl.sum(router.to(tl.float32) * row.to(tl.float32)[None, :], axis=1).to(row.dtype)
    if HAS_BIAS:  # added as ``with_bias`` adds it: in float32, rounded
        bias = tl.load(bias_ptr + experts, mask=held, other=0.0)
        logits = (logits.to(tl.float32) + bias.to(tl.float32)).to(row.dtype)
    tl.store(logits_ptr + experts, logits, mask=held)
    tl.debug_barrier()  # every thread's logits stored before the count releases them
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        every = tl.arange(0, BLOCK_E)
        valid = every < NUM_EXPERTS
        # Read from L2 (".cg"): other SMs stored them.
        all_logits = tl.load(
            logits_ptr + every, mask=valid, other=-float("inf"), cache_modifier=".cg"
        ).to(tl.float32)
        _route(all_logits, every, valid, weights_ptr, ids_ptr, TOP_K, RENORMALIZE)
        tl.store(count_ptr, 0)  # zero again for the next launch


def moe_route_norm(
    norm: DeferredNorm,
    router: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's deferred norm normalized (its stream written) and routed by ``router``
    [E, H] (plus ``bias`` [E]) in one kernel: (float32 weights, int32 ids, [1, top_k] each,
    the most probable first; the normalized row [1, H]), as ``normalize``, ``linear`` and
    ``moe_route`` compute them (the logits summed in another order)."""
    x = norm.x
    num_experts, hidden = router.shape
    assert x.shape == (1, hidden) and x.stride(1) == 1 and router.is_contiguous()
    assert bias is None or bias.shape == (num_experts,)
    arguments = norm_arguments(x, norm)
    normalized = torch.empty_like(x)
    logits = torch.empty(num_experts, dtype=x.dtype, device=x.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    block_h = triton.next_power_of_2(hidden)
    experts = max(1, min(_ROUTER_VALUES // block_h, triton.next_power_of_2(num_experts)))
    _norm_route_kernel[(triton.cdiv(num_experts, experts),)](
        x,
        *arguments.pointers,
        normalized,
        router,
        router if bias is None else bias,  # unread without a bias
        logits,
        weights,
        ids,
        zeroed_counters(x.device, 1, "MoE routing"),  # the programs that stored their logits
        hidden,
        arguments.eps,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        EXPERTS=experts,
        BLOCK_H=block_h,
        HAS_RESIDUAL=arguments.has_residual,
        HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize,
        num_warps=_NORM_ROUTE_WARPS,
        **launch_options(x.device),
    )
    return weights, ids, normalized
