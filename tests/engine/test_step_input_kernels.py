"""The kernels that put a step's inputs in place on the device between two CUDA graphs,
against the PyTorch operations they replace (the torch backend's ``TorchStepOps``), exactly:
the fill of a graph's static buffers (``engine.backends.triton.graph_inputs``: five copies and
a padded batch's five fills) and the pending tokens' (``pending_tokens``: a gather and an
``index_copy_``). On CUDA both are
launched past Triton's binding, through the one variant they compile
(``engine.backends.triton.one_variant``): a test checks that one variant serves all these
launches.

Run natively on CUDA and, without it, in Triton's interpreter on CPU (tests/conftest.py
selects it). The step's inputs are views of one packed buffer at an odd offset, as
``engine.execution.batch.pack`` makes them, and the buffers start as garbage, so an element a kernel
fails to write, or writes where it should not, shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.attention import AttentionMetadata
from engine.backends.pytorch import TorchStepOps
from engine.backends.triton.dependent_launch import launch_options
from engine.backends.triton.graph_inputs import (
    _STEP_SIZES,
    _STEP_VIEWS,
    _fill_graph_inputs_kernel,
    fill_graph_inputs,
)
from engine.backends.triton.one_variant import OneVariantKernel
from engine.backends.triton.pending_tokens import (
    _fill_pending_tokens_kernel,
    fill_pending_tokens,
)
from engine.execution.batch import StepShape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LARGEST = 8  # rows of the graph buffers
MAX_BLOCKS = 300  # beyond one pass of the kernel over a block table (256 entries)


def garbage(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**40), 2**40, shape, generator=generator).to(DEVICE)


def graph_buffers(query_len: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A graph's static buffers, as ``StepGraphs`` holds them, full of garbage."""
    tokens = LARGEST * query_len
    return [
        garbage(tokens, generator=generator),
        garbage(tokens, generator=generator),
        garbage(tokens, generator=generator),
        garbage(LARGEST, generator=generator),
        garbage(LARGEST, MAX_BLOCKS, generator=generator),
    ]


def packed_step(
    count: int, width: int, query_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A uniform step's token ids and metadata: views of one packed buffer of random values,
    one element past an aligned start (as ``engine.execution.batch.pack`` splits its buffer)."""
    shape = StepShape(
        num_tokens=count * query_len,
        num_seqs=count,
        max_blocks=width,
        num_logits=count * query_len,
        num_targets=0,
        max_query_len=query_len,
        num_rows=count * query_len,
        uniform_query_len=query_len,
    )
    packed = garbage(1 + shape.packed_size, generator=generator)[1:]
    input_ids, metadata, _ = shape.split(packed)
    return input_ids, metadata


def reference_fill(
    buffers: list[torch.Tensor], num_rows: int, query_len: int, step: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The torch backend's fill (PyTorch's copies and fills), on copies of ``buffers``: the
    step's rows copied (block tables up to the step's width), rows [count, num_rows) padded."""
    copies = [b.clone() for b in buffers]
    TorchStepOps().fill_graph_inputs(copies, num_rows, query_len, step)
    return copies


def assert_filled(buffers: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    names = ["input_ids", "positions", "slot_mapping", "context_lens", "block_tables"]
    for name, buffer, reference in zip(names, buffers, expected, strict=True):
        assert torch.equal(buffer, reference), name


@pytest.mark.parametrize(
    ("count", "num_rows", "width", "query_len"),
    [
        (1, 1, 3, 1),  # a batch-1 decode step: no padding
        (3, 4, 5, 1),  # a decode step padded up to the captured size
        (2, 8, MAX_BLOCKS, 1),  # block tables wider than one pass, and six padding rows
        (6, 8, 1, 5),  # a verify step (1 + 4 tokens a row) padded
        (4, 4, 7, 5),  # a verify step, no padding
        (3, 4, 2, 17),  # more tokens a row than one pass over them (16)
    ],
)
def test_fill_graph_inputs_copies_the_step_and_pads_the_rest(
    count: int, num_rows: int, width: int, query_len: int
) -> None:
    generator = torch.Generator().manual_seed(count * 1000 + width * 10 + query_len)
    buffers = graph_buffers(query_len, generator)
    input_ids, metadata = packed_step(count, width, query_len, generator)
    step = [
        input_ids,
        metadata.positions,
        metadata.slot_mapping,
        metadata.context_lens,
        metadata.block_tables,
    ]
    expected = reference_fill(buffers, num_rows, query_len, step)
    fill_graph_inputs(buffers, num_rows, query_len, step)
    assert_filled(buffers, expected)


def test_fill_graph_inputs_takes_strided_token_ids() -> None:
    """A draft model's decode pass takes its token ids from a column of its drafts."""
    generator = torch.Generator().manual_seed(1)
    buffers = graph_buffers(1, generator)
    _, metadata = packed_step(3, 4, 1, generator)
    drafts = garbage(3, 5, generator=generator)
    step = [
        drafts[:, 2],
        metadata.positions,
        metadata.slot_mapping,
        metadata.context_lens,
        metadata.block_tables,
    ]
    expected = reference_fill(buffers, 4, 1, step)
    fill_graph_inputs(buffers, 4, 1, step)
    assert_filled(buffers, expected)


@pytest.mark.parametrize("query_len", [1, 5])
def test_fill_graph_inputs_without_a_step_pads_every_row(query_len: int) -> None:
    """As the graphs' capture fills their buffers: nothing the capture's pass writes."""
    buffers = graph_buffers(query_len, torch.Generator().manual_seed(2))
    expected = reference_fill(buffers, 6, query_len, None)
    fill_graph_inputs(buffers, 6, query_len)
    assert_filled(buffers, expected)


def test_fill_graph_inputs_kernel_specializes_on_nothing_a_step_changes() -> None:
    """Every integer argument (batch, width, query length, strides) and every pointer into
    the step's packed inputs are exempt from specialization: the one variant the graphs'
    capture compiles serves every step."""
    names = _fill_graph_inputs_kernel.arg_names
    integers = [name for name in names if not name.endswith("_ptr") and not name.isupper()]
    assert sorted(integers) == sorted(_STEP_SIZES)
    assert sorted(names[:5]) == sorted(_STEP_VIEWS)  # the step's; then the static buffers


@pytest.mark.parametrize("num_pending", [1, 5, 130])  # 130: past one program's 128
def test_fill_pending_tokens_matches_gather_and_index_copy(num_pending: int) -> None:
    generator = torch.Generator().manual_seed(num_pending)
    num_tokens = 2 * num_pending + 3
    input_ids = garbage(num_tokens, generator=generator)
    last_sampled = garbage(num_pending + 4, generator=generator)
    # Index and source as pack splits them off its one copy: views at odd offsets.
    index = torch.randperm(num_tokens, generator=generator)[:num_pending]
    source = torch.randint(0, last_sampled.shape[0], (num_pending,), generator=generator)
    packed = torch.cat([torch.zeros(1, dtype=torch.int64), index, source]).to(DEVICE)
    index, source = packed[1:].split([num_pending, num_pending])
    expected = input_ids.clone()
    TorchStepOps().fill_pending_tokens(expected, index, source, last_sampled)
    fill_pending_tokens(input_ids, index, source, last_sampled)
    assert torch.equal(input_ids, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants exist on CUDA only")
def test_one_variant_serves_every_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches above, each through Triton's own binding this time, compile one variant
    of each kernel between them: the variant that ``OneVariantKernel`` launches for every
    step computes what Triton would have launched."""

    def through_triton(
        kernel: OneVariantKernel, grid: tuple[int, ...], device: torch.device, *args: object
    ) -> None:
        kernel.kernel[grid](*args, **launch_options(device))

    monkeypatch.setattr(OneVariantKernel, "launch", through_triton)
    kernels = [_fill_graph_inputs_kernel, _fill_pending_tokens_kernel]
    for kernel in kernels:
        kernel.device_caches.clear()
    for case in [(1, 1, 3, 1), (3, 4, 5, 1), (2, 8, MAX_BLOCKS, 1), (6, 8, 1, 5), (3, 4, 2, 17)]:
        test_fill_graph_inputs_copies_the_step_and_pads_the_rest(*case)
    test_fill_graph_inputs_takes_strided_token_ids()
    test_fill_graph_inputs_without_a_step_pads_every_row(5)
    for num_pending in (1, 5, 16, 130):
        test_fill_pending_tokens_matches_gather_and_index_copy(num_pending)
    for kernel in kernels:
        (kernel_cache, *_), *_ = kernel.device_caches.values()
        assert len(kernel_cache) == 1, kernel.fn.__name__
