"""A step's penalties on the tokens its rows have seen, in one kernel.

The reference (``engine/backends/penalties.py``) is some ten [B, V] tensor ops: gathers of
the rows' counts and prompt masks, masks, two ``where``s, products and differences, each a
pass over float32 logits, which at a batch of 256 over a 152k vocabulary is some 150 MB
apiece. This kernel reads the logits, each row's counts and (where a row has a repetition
penalty) its prompt's mask once, through the row's slot, and writes the penalized logits
once, with the reference's arithmetic in its order: the same float32 result but for the
rounding of a product fused into its difference.

The logits' and counts' rows and the parameters' columns change from step to step (a step's
rows, views of its packed parameters at their offsets): the kernel specializes on none of
it, so its two variants (with a repetition penalty or without) serve every step, and the
start-up warm-up draws both (``engine/execution/warm_up.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.penalties import Penalties
from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

_BLOCK = 2048  # tokens a program


@triton.jit(
    do_not_specialize=[
        "vocab_size",
        "stride_logits",
        "stride_out",
        "stride_slots",
        "stride_counts",
        "stride_prompt",
        "stride_presence",
        "stride_frequency",
        "stride_repetition",
    ],
    do_not_specialize_on_alignment=[
        "logits_ptr",
        "out_ptr",
        "slots_ptr",
        "counts_ptr",
        "prompt_ptr",
        "presence_ptr",
        "frequency_ptr",
        "repetition_ptr",
    ],
)
def _penalties_kernel(
    logits_ptr,
    out_ptr,
    slots_ptr,
    counts_ptr,
    prompt_ptr,
    presence_ptr,
    frequency_ptr,
    repetition_ptr,
    vocab_size,
    stride_logits,
    stride_out,
    stride_slots,
    stride_counts,
    stride_prompt,
    stride_presence,
    stride_frequency,
    stride_repetition,
    HAS_REPETITION: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per (row, ``BLOCK`` tokens): the reference's ``penalized`` there."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row * stride_slots)  # the row's row of counts and prompt
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    logits = tl.load(logits_ptr + row * stride_logits + cols, mask=mask)
    counts = tl.load(counts_ptr + slot * stride_counts + cols, mask=mask)
    generated = counts > 0
    if HAS_REPETITION:
        prompt = tl.load(prompt_ptr + slot * stride_prompt + cols, mask=mask, other=0)
        repetition = tl.load(repetition_ptr + row * stride_repetition)
        penalized = tl.where(logits > 0, logits / repetition, logits * repetition)
        logits = tl.where((prompt != 0) | generated, penalized, logits)
    frequency = tl.load(frequency_ptr + row * stride_frequency)
    presence = tl.load(presence_ptr + row * stride_presence)
    logits = logits - frequency * counts - presence * generated.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, logits, mask=mask)


# Launched past Triton's binding: a variant with a repetition penalty, one without.
_PENALTIES = OneVariantKernel(_penalties_kernel)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """``StepOps.apply_penalties``: new float32 logits [B, V], ``logits`` left as they are."""
    num_rows, vocab_size = logits.shape
    counts = penalties.counts
    slots = penalties.slots
    if slots is None:
        slots = torch.arange(num_rows, device=logits.device)
    prompt, repetition = penalties.prompt_tokens, penalties.repetition
    has_repetition = prompt is not None and repetition is not None
    if not has_repetition:  # not read: any pointers do
        prompt, repetition = counts, penalties.presence
    elif prompt.dtype == torch.bool:
        prompt = prompt.view(torch.uint8)
    # Rows of tokens contiguous: the kernel reads them at unit stride.
    assert logits.stride(1) == counts.stride(1) == prompt.stride(-1) == 1
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _PENALTIES.launch(
        (num_rows, triton.cdiv(vocab_size, _BLOCK)),
        logits.device,
        logits,
        out,
        slots,
        counts,
        prompt,
        penalties.presence,
        penalties.frequency,
        repetition,
        vocab_size,
        logits.stride(0),
        out.stride(0),
        slots.stride(0),
        counts.stride(0),
        prompt.stride(0),
        penalties.presence.stride(0),
        penalties.frequency.stride(0),
        repetition.stride(0),
        has_repetition,
        _BLOCK,
        variant=has_repetition,
    )
    return out
