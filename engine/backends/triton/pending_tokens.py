"""A step's pending input tokens filled in on the device, in one kernel.

A decode whose input is the token the step in flight sampled (pending: the host has not read
it yet) takes it from that step's sampled ids on the device (``engine.execution.batch.pack``):
``input_ids[index] = last_sampled[source]``. PyTorch launches two kernels for it, a gather
and an ``index_copy_``, and between two steps' CUDA graphs each launch leaves the device a
gap; this is one launch.

``index`` and ``source`` are views of the step's one host-to-device copy at any offset, and
their length changes from step to step: the kernel specializes on none of it, so its one
variant, which the start-up warm-up's decode of pending tokens compiles
(``engine/execution/warm_up.py``), serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

_BLOCK = 128  # pending tokens a program: one program up to a batch of 128


@triton.jit(
    do_not_specialize=["num_pending", "stride_last_sampled"],
    do_not_specialize_on_alignment=["input_ids_ptr", "index_ptr", "source_ptr", "last_sampled_ptr"],
)
def _fill_pending_tokens_kernel(
    input_ids_ptr,
    index_ptr,
    source_ptr,
    last_sampled_ptr,
    num_pending,
    stride_last_sampled,
    BLOCK: tl.constexpr,
):
    """Program per ``BLOCK`` pending tokens: each one's sampled id, stored at its index."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_pending
    index = tl.load(index_ptr + offsets, mask=mask)
    source = tl.load(source_ptr + offsets, mask=mask)
    tokens = tl.load(last_sampled_ptr + source * stride_last_sampled, mask=mask)
    tl.store(input_ids_ptr + index, tokens, mask=mask)


# Launched past Triton's binding: its one variant (one_variant.py).
_FILL_PENDING_TOKENS = OneVariantKernel(_fill_pending_tokens_kernel)


def fill_pending_tokens(
    input_ids: torch.Tensor, index: torch.Tensor, source: torch.Tensor, last_sampled: torch.Tensor
) -> None:
    """``input_ids[index] = last_sampled[source]``: int64, 1-D, ``index`` without repeats."""
    num_pending = index.shape[0]
    assert source.shape == (num_pending,) and num_pending > 0
    tensors = (input_ids, index, source, last_sampled)
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in tensors)
    assert input_ids.stride(0) == index.stride(0) == source.stride(0) == 1
    _FILL_PENDING_TOKENS.launch(
        (triton.cdiv(num_pending, _BLOCK),),
        input_ids.device,
        input_ids,
        index,
        source,
        last_sampled,
        num_pending,
        last_sampled.stride(0),
        _BLOCK,
    )
