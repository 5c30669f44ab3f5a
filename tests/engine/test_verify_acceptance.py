"""A verify step's acceptance (``StepOps.emitted_tokens``): the torch backend's and the Triton
kernel's (``engine.backends.triton.emitted_tokens``) against the rule applied one row at a
time in Python: a row emits its sampled tokens up to the first that differs from the draft
after it, that one included, and its newest token is the last emitted.

Run natively on CUDA and, without it, in Triton's interpreter on CPU (tests/conftest.py
selects it). The row starts are a view at an odd offset of one packed buffer, as
``engine.execution.batch.verify_layout`` splits them off its one copy.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.pytorch import TorchStepOps
from engine.backends.triton.dependent_launch import launch_options
from engine.backends.triton.emitted_tokens import _emitted_tokens_kernel, emitted_tokens
from engine.backends.triton.one_variant import OneVariantKernel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def verify_step(
    num_drafts: list[int], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, list[tuple[int, int]]]:
    """Sampled tokens, next drafts and row starts of rows with ``num_drafts`` drafts each,
    every row accepting a random number of them (all of them, none, some); and the expected
    (count emitted, last token) of each row."""
    sampled, next_drafts, starts, expected = [], [], [], []
    for drafts in num_drafts:
        starts.append(len(sampled))
        tokens = torch.randint(0, 1000, (drafts + 1,), generator=generator).tolist()
        accepted = int(torch.randint(0, drafts + 1, (1,), generator=generator))
        # The drafts equal the sampled tokens up to the accepted ones, then differ.
        row_drafts = [t if i < accepted else t + 1 for i, t in enumerate(tokens[:drafts])]
        sampled += tokens
        next_drafts += [*row_drafts, -1]
        expected.append((accepted + 1, tokens[accepted]))
    packed = torch.tensor([7, *starts], dtype=torch.int64).to(DEVICE)
    width = max(num_drafts) + 1
    as_tensor = torch.tensor(sampled, dtype=torch.int64, device=DEVICE)
    drafts_tensor = torch.tensor(next_drafts, dtype=torch.int64, device=DEVICE)
    return as_tensor, drafts_tensor, packed[1:], width, expected


# Rows without drafts (one position), k = 16's 17 positions, and past the kernel's 32 a pass.
CASES = [[0], [3], [16, 0, 16, 5], [0, 0, 0], [40, 1, 33], [2] * 9]


@pytest.mark.parametrize("num_drafts", CASES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_emitted_tokens_stop_at_the_first_rejected_draft(
    num_drafts: list[int], backend: str
) -> None:
    generator = torch.Generator().manual_seed(sum(num_drafts) + len(num_drafts))
    sampled, next_drafts, row_starts, width, expected = verify_step(num_drafts, generator)
    compute = emitted_tokens if backend == "triton" else TorchStepOps().emitted_tokens
    emitted = compute(sampled, next_drafts, row_starts, width)
    assert emitted.shape == (2, len(num_drafts)) and emitted.dtype == torch.int64
    assert list(zip(*emitted.tolist(), strict=True)) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled variants exist on CUDA only")
def test_one_variant_serves_every_verify_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above, each launched through Triton's own binding, compile one variant: the
    one that ``OneVariantKernel`` launches for every verify step computes what Triton would
    have launched."""

    def through_triton(
        kernel: OneVariantKernel, grid: tuple[int, ...], device: torch.device, *args: object
    ) -> None:
        kernel.kernel[grid](*args, **launch_options(device))

    monkeypatch.setattr(OneVariantKernel, "launch", through_triton)
    _emitted_tokens_kernel.device_caches.clear()
    for num_drafts in CASES:
        test_emitted_tokens_stop_at_the_first_rejected_draft(num_drafts, "triton")
    (kernel_cache, *_), *_ = _emitted_tokens_kernel.device_caches.values()
    assert len(kernel_cache) == 1
