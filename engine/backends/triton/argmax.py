"""The index of each row's largest logit, in two passes.

PyTorch reduces a row of logits in one thread block: at batch 1 one SM reads the whole
vocabulary's row while the others idle, and the argmax outlasted every kernel of the step but
the GEMVs (``scripts/profile_step.py --model DIR --batch 1`` lists a step's kernels by device
time). Here the first pass spreads each row over ``BLOCK``-wide chunks, one program each,
and the second picks each row's winner among its chunks'. Ties go to the lowest index, as
``torch.argmax`` breaks them. Both are launched past Triton's binding (``one_variant.py``):
what they specialize on is the same for every step of a model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

_BLOCK = 4096


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, values_ptr, indices_ptr, vocab_size, stride_row, stride_col, BLOCK: tl.constexpr
):
    """Program per (row, chunk): the chunk's largest logit and its index."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row * stride_row
    logits = tl.load(row_ptr + cols * stride_col, mask=cols < vocab_size, other=-float("inf"))
    best = tl.argmax(logits, 0, tie_break_left=True)
    slot = row * tl.num_programs(1) + chunk
    tl.store(values_ptr + slot, tl.max(logits, 0))
    tl.store(indices_ptr + slot, chunk * BLOCK + best)


@triton.jit
def _row_argmax_kernel(values_ptr, indices_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
    """Program per row: the first chunk holding the row's largest logit gives the index."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    mask = chunks < num_chunks
    values = tl.load(values_ptr + row * num_chunks + chunks, mask=mask, other=-float("inf"))
    best = tl.argmax(values, 0, tie_break_left=True)
    index = tl.load(indices_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, index.to(tl.int64))


_CHUNK_ARGMAX = OneVariantKernel(_chunk_argmax_kernel)
_ROW_ARGMAX = OneVariantKernel(_row_argmax_kernel)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 logits [B, V]: token ids [B], int64. A row of
    -inf only gives 0, as torch's does (NaN logits are not ordered: none reach here)."""
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, _BLOCK)
    # New allocations, aligned as any the caching allocator makes: their pointers need no key.
    values = logits.new_empty(num_rows, num_chunks)
    indices = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    stride_row, stride_col = logits.stride()
    _CHUNK_ARGMAX.launch(
        (num_rows, num_chunks),
        logits.device,
        logits,
        values,
        indices,
        vocab_size,
        stride_row,
        stride_col,
        _BLOCK,
        # Its integers whole, and whether the logits are aligned: all Triton specializes on.
        variant=(vocab_size, stride_row, stride_col, logits.data_ptr() % 16 == 0),
    )
    _ROW_ARGMAX.launch(
        (num_rows,),
        logits.device,
        values,
        indices,
        out,
        num_chunks,
        triton.next_power_of_2(num_chunks),
        variant=num_chunks,
    )
    return out
