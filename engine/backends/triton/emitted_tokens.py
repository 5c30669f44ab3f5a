"""A verify step's acceptance in one kernel: how many of each row's sampled tokens it emits,
and its last one.

A row's positions are its last token and its drafts, one after the other; the token sampled
at a position is kept while it equals the draft after it (``next_drafts``), up to the first
that differs (a row's last position has no draft after it, -1, and always differs): that one
is emitted too, and it is the row's newest token, which the next step may take as its input
on the device (``engine/sampling/rejection_sampler.py`` has the rule). PyTorch took about ten
kernels for it (compares, a scatter to a padded matrix, a cumulative product, sums and a
gather), each a launch on the host's path between the step's forward pass and the next.

Nothing here is specialized on the step (``OneVariantKernel``): its one variant serves every
batch and every k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

_BLOCK = 32  # positions a row compares at a time: k = 16's 17 in one


@triton.jit(
    do_not_specialize=["num_positions", "width", "stride_out"],
    do_not_specialize_on_alignment=[
        "sampled_ptr",
        "next_drafts_ptr",
        "row_starts_ptr",
        "out_ptr",
        "stride_out",
    ],
)
def _emitted_tokens_kernel(
    sampled_ptr,
    next_drafts_ptr,
    row_starts_ptr,
    out_ptr,
    num_positions,
    width,
    stride_out,
    BLOCK: tl.constexpr,
):
    """Program per row: its first position whose token differs from the draft after it (at
    most ``width`` positions from its start), then the count emitted and that token."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    start = tl.load(row_starts_ptr + row)
    first = width
    for chunk in range(0, width, BLOCK):
        offsets = chunk + tl.arange(0, BLOCK)
        mask = (offsets < width) & (start + offsets < num_positions)
        sampled = tl.load(sampled_ptr + start + offsets, mask=mask, other=0)
        draft = tl.load(next_drafts_ptr + start + offsets, mask=mask, other=0)
        differs = mask & (sampled != draft)
        first = tl.minimum(first, tl.min(tl.where(differs, offsets, width), 0))
    tl.store(out_ptr + row, first + 1)
    tl.store(out_ptr + stride_out + row, tl.load(sampled_ptr + start + first))


# Launched past Triton's binding: its one variant (one_variant.py).
_EMITTED_TOKENS = OneVariantKernel(_emitted_tokens_kernel, num_warps=1)


def emitted_tokens(
    sampled: torch.Tensor, next_drafts: torch.Tensor, row_starts: torch.Tensor, width: int
) -> torch.Tensor:
    """int64 [2, R]: each row's count of emitted tokens, then its last emitted token, from
    the tokens ``sampled`` [P] at its positions, the drafts they must equal (``next_drafts``
    [P], -1 at each row's last position) and where each row starts (``row_starts`` [R]), no
    row longer than ``width``. int64, 1-D, contiguous."""
    num_positions, num_rows = sampled.shape[0], row_starts.shape[0]
    assert next_drafts.shape == (num_positions,) and num_rows > 0 and width > 0
    tensors = (sampled, next_drafts, row_starts)
    assert all(t.dtype == torch.int64 and t.dim() == 1 and t.stride(0) == 1 for t in tensors)
    out = torch.empty(2, num_rows, dtype=torch.int64, device=sampled.device)
    _EMITTED_TOKENS.launch(
        (num_rows,),
        sampled.device,
        sampled,
        next_drafts,
        row_starts,
        out,
        num_positions,
        width,
        out.stride(0),
        _BLOCK,
    )
    return out
