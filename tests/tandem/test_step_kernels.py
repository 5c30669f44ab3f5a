"""Each step's device time from a profiler trace (tandem/bench/step_kernels.py): a kernel is
charged to the step whose host call launched it, however late it ran (overlapped steps run a
step's kernels during the next call), through the correlation id its launch carries; a CUDA
graph's replay charges all of its kernels; work no labelled call launched is nobody's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.bench.step_kernels import device_time_by_step, label_step, load_trace


def event(category: str, name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": category, "name": name, "ts": ts, "dur": dur, "args": args}


def test_kernels_are_charged_to_the_call_that_launched_them() -> None:
    events = [
        event("user_annotation", "step0", 0, 100),
        event("user_annotation", "step1", 100, 100),
        event("user_annotation", "stepped", 300, 10),  # not a step's label
        event("cuda_runtime", "cudaGraphLaunch", 10, 5, correlation=1),
        event("cuda_driver", "cuLaunchKernelEx", 150, 5, correlation=2),
        event("cuda_runtime", "cudaMemcpyAsync", 250, 5, correlation=3),  # outside any step
        # Step 0's graph: two kernels, running while step 1's call launches.
        event("kernel", "decode", 120, 30, correlation=1),
        event("kernel", "norm", 160, 10, correlation=1),
        event("kernel", "prefill", 210, 20, correlation=2),
        event("gpu_memcpy", "Memcpy HtoD", 255, 2, correlation=3),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
    ]
    steps = device_time_by_step(events)
    assert set(steps) == {0, 1}
    assert steps[0].busy_us == 40 and steps[0].span_us == 50
    assert dict(steps[0].by_kernel) == {"decode": 30, "norm": 10}
    assert steps[1].busy_us == 20 and steps[1].span_us == 20


def test_a_labelled_step_reads_back_from_a_real_trace(tmp_path: Path) -> None:
    """The label a step's call carries, as torch.profiler writes it: on the CPU no kernel
    runs, so no step has device time."""
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as profiler, label_step(7):
        torch.ones(4).sum()
    path = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(path))
    labels = [e["name"] for e in load_trace(path) if e.get("cat") == "user_annotation"]
    assert labels == ["step7"]
    assert device_time_by_step(load_trace(path)) == {}


@pytest.mark.parametrize("name", ["step", "stepx", "step-1"])
def test_only_step_labels_count(name: str) -> None:
    events = [event("user_annotation", name, 0, 10), event("cuda_runtime", "launch", 1, 1, 1)]
    events.append(event("kernel", "k", 2, 1, correlation=1))
    assert device_time_by_step(events) == {}
