"""`tandem bench kernels --sampler`'s case runs its check and its timings on the CPU (the
kernel in Triton's interpreter): its first GPU call then measures, rather than fails."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.bench.sampler_kernel import CUTS, sampler_case


def test_sampler_case_checks_the_kernel_against_the_reference_then_times_both() -> None:
    timed: list[Callable[[], None]] = []

    def time_ms(run: Callable[[], None]) -> float:
        run()
        timed.append(run)
        return 0.01

    for cut in CUTS.values():
        row = sampler_case(5000, 3, cut, 1e12, time_ms, torch.device("cpu"))
        assert row.split()[:2] == ["5000", "3"]
    assert len(timed) == 3 * len(CUTS)  # greedy, the reference, the kernel
