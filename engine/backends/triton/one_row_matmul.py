"""One row times a weight matrix, ``x @ weight.T`` for x [1, K]: a batch-1 decode step's
linear layers and LM head, and a prompt's LM head.

One row reads each weight once and does two FLOPs per weight, so the product is bound by
the weight's bytes and by how early each read starts, not by arithmetic. Tensor cores need
16 rows and a trip through shared memory; here each program reads BLOCK_N whole weight rows
in BLOCK_K-wide chunks straight into registers (wide loads, several in flight a thread),
multiplies in float32 on the CUDA cores and reduces once at the end: no shared memory, no
split of K, no second pass. It is the engine's one-row path because it reads a bf16 weight
faster than cuBLAS at one row, and fp8 codes at least as fast as the tiled weight-only
kernel: ``scripts/bench_quantization.py --kernels --rows 1`` times it against cuBLAS (its
"bf16" and "bf16 Triton" columns), ``scripts/sweep_matmul_configs.py --parts tiled`` against
the tiled kernel, layer by layer.

The weight may be bfloat16/float16 (the model's dtype), or int8 / float8 e4m3 codes with one
float32 scale per output channel, widened in registers (``fp8_widen``) and scaled once.

``gated``: x is a gated MLP's gate and up halves [1, 2K], and the input is silu(gate) * up,
computed while it is read (rounded to x's dtype, as ``silu_and_mul`` stores it): the down
projection without the activation's own kernel.

A ``DeferredNorm`` for x: the input is rms_norm(x + residual) * norm weight. Each program
reads the whole row anyway: it adds the residual as it reads (in x's dtype, as the norm's
kernel does), sums the squares, multiplies by the norm's weight in float32 and scales its
sums by 1/rms at the end; the first program writes the stream (x + residual). The norm's
own kernel and launch are gone; the normalized row is never rounded to x's dtype.

``add``: the product joins the residual stream (a layer's o and down projections, one rank):
it is rounded to the output's dtype as the projection stores it, then the stream's channels
are added in that dtype, as ``stream + product`` rounds, and the sum is the output. The next
norm then has no residual to add: its reader's programs, each reading the whole row, no
longer add it and write the stream as they read, so each reads one vector fewer. Bit for
bit the same sums. ``scripts/profile_step.py --model DIR --batch 1 --rounds 3`` times the
batch-1 step this shortens (run on two trees to compare them).

Launched dependent (``dependent_launch``): each program reads its weight's first chunk, then
waits for the kernel before it. A weight is never written during a forward pass, so the read
is safe before the wait, and it overlaps the kernel before: the last programs of the linear
layer before, or, for the o projection, the attention kernels. Against reading after the
wait it shortened the batch-1 TPOT of the 8B shape (bf16 and fp8 weights) and of
Qwen3-0.6B, but not of the 1B shape: there the early reads slow the kernel they overlap
about as much as they speed up their own (the down projection, and the split merge before
the o projection). ``scripts/bench_latency.py --model DIR --device cuda`` measures the
TPOT; the figures are in docs/history/benchmarks-lab-notebook.md.

The weight is loaded evict-first, as the MoE decode kernels load the experts' rows: a step
reads each weight once, a whole layer's far more than L2 holds, and left as other lines they
would push out of L2 what the step reads again (docs/benchmarks.md, batch-1 latency).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.backends.deferred_norm import DeferredNorm, norm_arguments
from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    wait_for_previous_kernel,
)
from engine.backends.triton.fp8_widen import widen
from engine.backends.triton.push_all_reduce import (
    PushAllReduce,
    arrived_sum,
    empty_slot_before,
    end_turn,
    joined,
    push,
    turn,
)

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Elements of the row that a reducing product's last program sums at a time: a wider tile has
# more loads in flight, each waited for, but its registers count against every program's.
SUM_BLOCK = 4096
# How a step's weights are loaded: evict-first, read once a step (the module's docstring).
READ_ONCE = tl.constexpr("evict_first")


@dataclass(frozen=True)
class OneRowConfig:
    """How the one-row kernel divides a weight: ``rows`` output channels a program (BLOCK_N),
    read ``chunk_bytes`` of each row at a time (BLOCK_BYTES), by ``warps`` warps."""

    rows: int
    chunk_bytes: int
    warps: int


def one_row_config(
    channels: int, depth: int, weight_dtype: torch.dtype, normed: bool
) -> OneRowConfig:
    """The configuration for a weight [channels, depth] (``normed``: the row is a deferred
    norm's, which every program reads and normalizes whole), chosen by shape, never timed.

    Configurations sum a row in different orders, and a timer at start-up (Triton's
    autotuner, before) picked differently in different processes: replicas of one model then
    gave different greedy tokens where two logits nearly tied
    (docs/history/benchmarks-lab-notebook.md). A rule gives every process the same sums. It
    is fitted to ``scripts/sweep_matmul_configs.py --parts one-row chain``: each layer of the
    default models and their TP shards alone, and whole models' chains of one-row products in
    one CUDA graph; it prints how far the rule is from the best candidate, layer by layer.

    - fp8 / int8 codes (their norm runs as its own kernel): 16 channels a program in 512-byte
      chunks over wide outputs (QKV, gate/up), 8 channels in 1 KiB chunks otherwise.
    - A deferred norm's row: 4 channels a program in 2 KiB chunks, since each program reads
      the row, the residual and the norm's weight whole (at 2 channels a program a 1B
      model's LM head reads 1.5 times its weight's bytes in them, from L2); rows of at most
      2 KiB in chunks of half a row, or 8 channels in 512-byte chunks over wide outputs.
    - Other bf16 rows: 4 channels a program in 4 KiB chunks (2 KiB where 4 do not divide the
      row) by 8 warps (o, down), or 2 in 2 KiB chunks over wide outputs (an LM head without a
      deferred norm).
    """
    if _INTERPRETED:
        return OneRowConfig(rows=4, chunk_bytes=64, warps=4)
    wide = channels >= 6144
    if weight_dtype.itemsize == 1:
        return OneRowConfig(16, 512, 8) if wide else OneRowConfig(8, 1024, 4)
    row_bytes = depth * weight_dtype.itemsize
    if not normed:
        if wide:
            return OneRowConfig(2, 2048, 4)
        # A last chunk half masked costs a full one (Qwen3-0.6B's down projection, 6 KiB rows).
        return OneRowConfig(4, 4096 if row_bytes % 4096 == 0 else 2048, 8)
    if row_bytes > 2048:
        return OneRowConfig(4, 2048, 4)
    return OneRowConfig(8, 512, 4) if wide else OneRowConfig(4, 1024, 4)


@triton.jit
def _accumulate(
    acc,
    squares,
    weight,
    start,
    x_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    stream_end,
    K,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Add one chunk of the weight times x's columns [start, start + BLOCK_K) to the sums."""
    ks = start + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty)
    x32 = x.to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            x += tl.load(residual_ptr + ks, mask=k_mask, other=0.0)
            # The first program writes it; a mask, not a branch, so loads stay in flight.
            tl.store(stream_ptr + ks, x, mask=ks < stream_end)
            x32 = x.to(tl.float32)
        squares += x32 * x32
        x32 *= tl.load(norm_weight_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    acc += widen(weight, tl.float32) * x32[None, :]
    return acc, squares


@triton.jit
def first_weight_chunk(cols, col_mask, weight_ptr, K, stride_weight, BLOCK_BYTES: tl.constexpr):
    """The weight rows ``cols``' first chunk, for ``row_sums``: to be read before waiting for
    the kernel before. No kernel of a forward pass writes a weight, and the read overlaps
    that kernel's last programs (or, after attention, the attention kernels), instead of
    starting once it is done."""
    BLOCK_K: tl.constexpr = BLOCK_BYTES // weight_ptr.dtype.element_ty.primitive_bitwidth * 8
    ks = tl.arange(0, BLOCK_K)
    mask = col_mask[:, None] & (ks < K)[None, :]
    return tl.load(
        weight_ptr + cols[:, None] * stride_weight + ks[None, :],
        mask=mask,
        other=0.0,
        eviction_policy=READ_ONCE,
    )


@triton.jit
def row_sums(
    weight,
    cols,
    col_mask,
    x_ptr,
    weight_ptr,
    scale_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    K,
    stride_weight,
    eps,
    HAS_SCALE: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    """The products of x (as the flags say: gated, a deferred norm's) with the weight rows
    ``cols`` [BLOCK_N] (``col_mask``: the real ones), float32, scaled: a one-row kernel's
    program body, whatever it stores. ``weight`` is their first chunk
    (``first_weight_chunk``); waits for the kernel before (dependent launch) first."""
    BLOCK_K: tl.constexpr = BLOCK_BYTES // weight_ptr.dtype.element_ty.primitive_bitwidth * 8
    weight_rows = weight_ptr + cols[:, None] * stride_weight
    wait_for_previous_kernel()
    let_next_kernel_start()  # the down projection after gate/up
    acc = tl.zeros((cols.shape[0], BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    stream_end = tl.where(tl.program_id(0) == 0, K, 0)
    # The first chunk's sums peeled from the loop on purpose: folded into it (behind a
    # branch, or with each iteration loading the next chunk) the kernel takes more
    # registers, fewer programs fit an SM, and it measured slower
    # (docs/history/benchmarks-lab-notebook.md).
    acc, squares = _accumulate(
        acc,
        squares,
        weight,
        0,
        x_ptr,
        residual_ptr,
        norm_weight_ptr,
        stream_ptr,
        stream_end,
        K,
        GATED,
        NORM,
        HAS_RESIDUAL,
        BLOCK_K,
    )
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        weight = tl.load(
            weight_rows + ks[None, :],
            mask=col_mask[:, None] & (ks < K)[None, :],
            other=0.0,
            eviction_policy=READ_ONCE,
        )
        acc, squares = _accumulate(
            acc,
            squares,
            weight,
            start,
            x_ptr,
            residual_ptr,
            norm_weight_ptr,
            stream_ptr,
            stream_end,
            K,
            GATED,
            NORM,
            HAS_RESIDUAL,
            BLOCK_K,
        )
    out = tl.sum(acc, axis=1)
    if NORM:
        out *= tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
        out *= scale  # widened to float32 exactly (fp8_widen)
    return out


@triton.jit
def _one_row_kernel(
    x_ptr,
    weight_ptr,
    scale_ptr,
    residual_ptr,
    norm_weight_ptr,
    stream_ptr,
    out_ptr,
    bias_ptr,
    addend_ptr,
    local_ptr,  # REDUCE's: this rank's all-reduce buffer, its values' bits as integers
    addresses_ptr,  # every rank's buffer
    state_ptr,  # the all-reduce's turn
    N,
    K,
    stride_weight,
    eps,
    HAS_SCALE: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ADD: tl.constexpr,
    REDUCE: tl.constexpr,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    PART: tl.constexpr,
    EMPTY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    SUM_BLOCK: tl.constexpr,
):
    """Program per BLOCK_N output channels; float32 sums. ``REDUCE``: the product is this
    rank's share of a sum over the ranks (a row-parallel layer's), all-reduced here as the
    Triton backend's push all-reduce makes it (``push_all_reduce``), the stream joined after."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    weight = first_weight_chunk(cols, col_mask, weight_ptr, K, stride_weight, BLOCK_BYTES)
    out = row_sums(
        weight,
        cols,
        col_mask,
        x_ptr,
        weight_ptr,
        scale_ptr,
        residual_ptr,
        norm_weight_ptr,
        stream_ptr,
        K,
        stride_weight,
        eps,
        HAS_SCALE,
        GATED,
        NORM,
        HAS_RESIDUAL,
        BLOCK_BYTES,
    )
    out = out.to(out_ptr.dtype.element_ty)
    if HAS_BIAS:  # as ``product + bias`` rounds the stored product's sum (``with_bias``)
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + bias).to(out_ptr.dtype.element_ty)
    if REDUCE:
        # This rank's share of the sum goes to every rank's buffer; the last program waits for
        # the whole row from every rank (no other program waits, so none can hold up one it
        # waits for), sums it and joins the stream, then moves the all-reduce's turn on: the
        # ranks' parts of every program have arrived, so each has read the turn.
        slot = turn(state_ptr)
        push(out, cols, col_mask, slot, local_ptr, addresses_ptr, RANK, RANKS, PART, EMPTY)
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        empty_slot_before(
            local_ptr,
            state_ptr,
            slot,
            program * BLOCK_N,
            programs * BLOCK_N,
            RANKS,
            PART,
            EMPTY,
            BLOCK_N,
        )
        if program == programs - 1:
            for start in range(0, N, SUM_BLOCK):
                offsets = start + tl.arange(0, SUM_BLOCK)
                mask = offsets < N
                summed = arrived_sum(local_ptr, slot, offsets, mask, out_ptr, RANKS, PART, EMPTY)
                if ADD:
                    summed = joined(summed, addend_ptr, offsets, mask)
                tl.store(out_ptr + offsets, summed, mask=mask)
            end_turn(state_ptr, slot, N)
    else:
        if ADD:  # read after row_sums' wait: the kernels before write the stream
            out += tl.load(addend_ptr + cols, mask=col_mask, other=0.0)
        tl.store(out_ptr + cols, out, mask=col_mask)


@dataclass(frozen=True)
class RowOperands:
    """What ``row_sums`` reads, as a kernel's first arguments (``pointers``, then
    ``flags``' constants): the row x, the weight, its scales, and a deferred norm's
    residual, weight and stream (x where unread)."""

    pointers: tuple[torch.Tensor, ...]
    eps: float
    flags: dict[str, bool]
    normed: bool  # a deferred norm's row, which every program normalizes whole

    @property
    def x(self) -> torch.Tensor:
        return self.pointers[0]


def row_operands(
    x: torch.Tensor | DeferredNorm,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    gated: bool = False,
) -> RowOperands:
    """x [1, K] (or [1, 2K] gate and up halves, ``gated``; or a deferred norm of a row [1, K])
    and weight [N, K] in x's dtype, or int8 / float8 e4m3 codes with float32 ``scale`` [N],
    checked, as ``row_sums`` takes them."""
    norm = x if isinstance(x, DeferredNorm) else None
    if norm is not None:
        assert not gated
        x = norm.x
        assert norm.weight.shape == x.shape[1:] and norm.stream.shape == x.shape
    depth = weight.shape[1]
    assert x.shape == (1, 2 * depth if gated else depth) and x.stride(-1) == 1
    assert weight.stride(1) == 1
    assert (scale is None) == (weight.dtype == x.dtype), "codes need their scales"
    norm_args = norm_arguments(x, norm)
    pointers = (
        x,
        weight,
        weight if scale is None else scale,  # unread without a scale
        *norm_args.pointers,
    )
    flags = {
        "HAS_SCALE": scale is not None,
        "GATED": gated,
        "NORM": norm is not None,
        "HAS_RESIDUAL": norm_args.has_residual,
    }
    return RowOperands(pointers, norm_args.eps, flags, norm is not None)


def one_row_matmul(
    x: torch.Tensor | DeferredNorm,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    gated: bool = False,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    all_reduce: PushAllReduce | None = None,
    config: OneRowConfig | None = None,
) -> torch.Tensor:
    """x [1, K] (or [1, 2K] gate and up halves, ``gated``; or a deferred norm of a row [1, K])
    and weight [N, K] in x's dtype, or int8 / float8 e4m3 codes with float32 ``scale`` [N]
    -> [1, N] in ``out_dtype`` (default: x's dtype), plus ``bias`` [N] in that dtype if given
    (rounded as ``with_bias`` adds it to the stored product), summed over the ranks by
    ``all_reduce`` if given (this rank's push all-reduce: the product is its share, rounded to
    the output's dtype as it is pushed), plus ``add`` [1, N] in that dtype if given (the
    residual stream the product or the sum joins). ``config``: ``one_row_config``'s unless
    given (the sweep's candidates)."""
    operands = row_operands(x, weight, scale, gated)
    channels, depth = weight.shape
    out = operands.x.new_empty(1, channels, dtype=out_dtype or operands.x.dtype)
    if add is not None:
        assert add.shape == out.shape and add.dtype == out.dtype and add.stride(-1) == 1
    if bias is not None:
        assert bias.shape == (channels,) and bias.dtype == out.dtype and bias.stride(0) == 1
    # Unread unless REDUCE, and alike for every product without it: no variant of their own.
    reduce = {"local_ptr": out, "addresses_ptr": out, "state_ptr": out}
    constants = {"RANK": 0, "RANKS": 1, "PART": 1, "EMPTY": 0, "SUM_BLOCK": 1}
    if all_reduce is not None:
        assert all_reduce.accepts(out)
        reduce, constants = all_reduce.kernel_operands()
        constants["SUM_BLOCK"] = min(triton.next_power_of_2(channels), SUM_BLOCK)
    config = config or one_row_config(channels, depth, weight.dtype, operands.normed)
    _one_row_kernel[(triton.cdiv(channels, config.rows),)](
        *operands.pointers,
        out,
        out if bias is None else bias,  # unread without a bias
        out if add is None else add,  # unread without an addend
        **reduce,
        N=channels,
        K=depth,
        stride_weight=weight.stride(0),
        eps=operands.eps,
        **operands.flags,
        HAS_BIAS=bias is not None,
        ADD=add is not None,
        REDUCE=all_reduce is not None,
        **constants,
        BLOCK_N=config.rows,
        BLOCK_BYTES=config.chunk_bytes,
        num_warps=config.warps,
        num_stages=1,
        **launch_options(out.device),
    )
    return out
