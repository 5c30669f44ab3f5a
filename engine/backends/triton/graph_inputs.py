"""One kernel that fills a CUDA graph's static input buffers for a uniform step: the step's
rows copied, the rows the graph computes beyond them (the batch padded up to a captured
size) made padding.

Between two steps' graphs the device runs a few tiny operations, each its own launch with a
gap around it, which a batch-1 decode step of a small model feels
(``scripts/profile_step.py --model DIR --batch 1`` shows where the device sits idle, by the
kernel after each gap). Five were copies into the graph's buffers (token ids, positions,
cache slots, context lengths, block tables), and a padded batch took five fills more; this
kernel is one launch for all of them.

The step's inputs are views of its one packed int64 buffer (``engine.execution.batch.StepShape``) at
any offset, and its batch, block tables' width and query length change from step to step:
the kernel specializes on none of them, so that the one variant the graphs' capture
compiles (it pads through this kernel) serves every step, the draft model's passes too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

# A row's tokens a pass: one pass for any verify step up to 15 drafts a row.
_BLOCK_TOKENS = 16
# Block-table entries a pass: one for contexts up to 4096 tokens of 16-token blocks.
_BLOCK_COLUMNS = 256
# Views of the step's packed inputs, at any alignment (the static buffers are allocations
# of their own: always aligned).
_STEP_VIEWS = [
    "input_ids_ptr",
    "positions_ptr",
    "slot_mapping_ptr",
    "context_lens_ptr",
    "block_tables_ptr",
]
# Sizes that change from step to step, and strides that differ between callers (a draft
# model's pass takes its token ids from a column of its drafts; the draft's graphs may have
# block tables of another width).
_STEP_SIZES = [
    "count",
    "query_len",
    "width",
    "stride_input_ids",
    "stride_table",
    "stride_buffer_table",
]


@triton.jit(do_not_specialize=_STEP_SIZES, do_not_specialize_on_alignment=_STEP_VIEWS)
def _fill_graph_inputs_kernel(
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    context_lens_ptr,
    block_tables_ptr,
    buffer_input_ids_ptr,
    buffer_positions_ptr,
    buffer_slot_mapping_ptr,
    buffer_context_lens_ptr,
    buffer_block_tables_ptr,
    count,
    query_len,
    width,
    stride_input_ids,
    stride_table,
    stride_buffer_table,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
):
    """Program per row of the graph: a row of the batch (row < count) copied, its query_len
    tokens and its block table's first ``width`` entries (those past it are left as they
    were: its context length bounds what attention reads); any other row made padding,
    which writes no cache slot (-1) and attends to one key of block 0: token 0 at position
    0, context length 1."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    if row < count:
        for start in range(0, query_len, BLOCK_TOKENS):
            offsets = start + tl.arange(0, BLOCK_TOKENS)
            mask = offsets < query_len
            tokens = row * query_len + offsets
            input_ids = tl.load(input_ids_ptr + tokens * stride_input_ids, mask=mask)
            tl.store(buffer_input_ids_ptr + tokens, input_ids, mask=mask)
            positions = tl.load(positions_ptr + tokens, mask=mask)
            tl.store(buffer_positions_ptr + tokens, positions, mask=mask)
            slots = tl.load(slot_mapping_ptr + tokens, mask=mask)
            tl.store(buffer_slot_mapping_ptr + tokens, slots, mask=mask)
        tl.store(buffer_context_lens_ptr + row, tl.load(context_lens_ptr + row))
        for start in range(0, width, BLOCK_COLUMNS):
            columns = start + tl.arange(0, BLOCK_COLUMNS)
            mask = columns < width
            blocks = tl.load(block_tables_ptr + row * stride_table + columns, mask=mask)
            tl.store(
                buffer_block_tables_ptr + row * stride_buffer_table + columns, blocks, mask=mask
            )
    else:
        zeros = tl.zeros([BLOCK_TOKENS], tl.int64)
        for start in range(0, query_len, BLOCK_TOKENS):
            offsets = start + tl.arange(0, BLOCK_TOKENS)
            mask = offsets < query_len
            tokens = row * query_len + offsets
            tl.store(buffer_input_ids_ptr + tokens, zeros, mask=mask)
            tl.store(buffer_positions_ptr + tokens, zeros, mask=mask)
            tl.store(buffer_slot_mapping_ptr + tokens, zeros - 1, mask=mask)
        tl.store(buffer_context_lens_ptr + row, 1)
        tl.store(buffer_block_tables_ptr + row * stride_buffer_table, 0)


# Launched past Triton's binding: its one variant (one_variant.py).
_FILL_GRAPH_INPUTS = OneVariantKernel(_fill_graph_inputs_kernel)


def fill_graph_inputs(
    buffers: Sequence[torch.Tensor],
    num_rows: int,
    query_len: int,
    step: Sequence[torch.Tensor] | None = None,
) -> None:
    """Fill the first ``num_rows`` rows of a graph's static ``buffers``, ``query_len`` tokens
    a row: the rows of ``step`` first, copied, then padding (every row when ``step`` is None).

    ``buffers`` and ``step`` each hold, int64: token ids, positions and cache slots
    [rows * query_len], context lengths [rows] and block tables [rows, width]; a step's
    token ids may be strided. A copied row's block-table entries past the step's width are
    left as they were. A padding row writes no cache slot (-1) and attends to one key of
    block 0: position 0, token 0, context length 1, block-table entry 0 = 0.
    """
    count = 0 if step is None else step[3].shape[0]
    sources = buffers if step is None else step  # with no step, unread
    input_ids, positions, slot_mapping, context_lens, block_tables = sources
    buffer_tables = buffers[4]
    assert count <= num_rows <= buffer_tables.shape[0]
    assert buffers[0].shape[0] >= num_rows * query_len
    assert block_tables.shape[1] <= buffer_tables.shape[1]
    if step is not None:
        assert input_ids.shape == positions.shape == slot_mapping.shape == (count * query_len,)
        assert block_tables.shape[0] == count
    assert all(t.dtype == torch.int64 for t in (*buffers, *sources))
    assert all(t.stride(-1) == 1 for t in (*buffers, *sources[1:]))  # token ids: any stride
    _FILL_GRAPH_INPUTS.launch(
        (num_rows,),
        buffer_tables.device,
        input_ids,
        positions,
        slot_mapping,
        context_lens,
        block_tables,
        *buffers,
        count,
        query_len,
        block_tables.shape[1],
        input_ids.stride(0),
        block_tables.stride(0),
        buffer_tables.stride(0),
        _BLOCK_TOKENS,
        _BLOCK_COLUMNS,
    )
