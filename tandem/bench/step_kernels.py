"""Each engine step's device time, from a torch profiler trace: which kernels (and copies and
fills) each step launched, how long they kept the device busy, and how long from the step's
first kernel to its last. Where the device is busy for less of that span than the step takes,
the step waited on the host (``tandem bench offline --profile-steps``).

A step is the host's ``LLMEngine.step`` call that launched it, labelled ``step{i}`` with
``torch.profiler.record_function`` (``label_step``). With overlapped steps a step's kernels
run on the device during the next call, so they are matched to the call that launched them,
not to when they ran: a kernel's launch (a CUDA runtime or driver call, a CUDA graph's
replay launching all of its kernels) carries a correlation id that the kernel carries too,
and the launch lies inside the labelled call.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STEP_LABEL = "step"
# The trace's categories of host calls that launch device work, and of that work.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def label_step(index: int) -> torch.profiler.record_function:
    """The label of the host call that launches step ``index`` (the engine's count of steps
    launched before it)."""
    return torch.profiler.record_function(f"{STEP_LABEL}{index}")


@dataclass
class StepDeviceTime:
    busy_us: float = 0.0  # its kernels', copies' and fills' durations summed
    first_us: float = float("inf")  # its first one's start
    last_us: float = 0.0  # its last one's end
    by_kernel: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def span_us(self) -> float:
        """From its first kernel's start to its last one's end."""
        return max(self.last_us - self.first_us, 0.0)


def device_time_by_step(events: Iterable[dict[str, Any]]) -> dict[int, StepDeviceTime]:
    """Each labelled step's device time, from a Chrome trace's events (``load_trace``)."""
    events = [e for e in events if e.get("ph") == "X"]
    calls = sorted(
        (e["ts"], e["ts"] + e["dur"], int(e["name"].removeprefix(STEP_LABEL)))
        for e in events
        if e.get("cat") == "user_annotation"
        and e["name"].startswith(STEP_LABEL)
        and e["name"].removeprefix(STEP_LABEL).isdigit()
    )
    starts = [start for start, _, _ in calls]
    step_of_launch = {}
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") not in LAUNCH_CATEGORIES or correlation is None:
            continue
        k = bisect.bisect_right(starts, e["ts"]) - 1
        if k >= 0 and e["ts"] <= calls[k][1]:
            step_of_launch[correlation] = calls[k][2]
    steps: dict[int, StepDeviceTime] = defaultdict(StepDeviceTime)
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        step = step_of_launch.get(e.get("args", {}).get("correlation"))
        if step is None:
            continue
        time = steps[step]
        time.busy_us += e["dur"]
        time.first_us = min(time.first_us, e["ts"])
        time.last_us = max(time.last_us, e["ts"] + e["dur"])
        time.by_kernel[e["name"]] += e["dur"]
    return dict(steps)


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace that ``torch.profiler.profile.export_chrome_trace`` wrote."""
    return json.loads(path.read_text())["traceEvents"]
