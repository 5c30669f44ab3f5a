"""What the scripts that build an engine in their own process to time its steps share
(``scripts/time_mixed_steps.py``, ``scripts/time_verify_steps.py``): their engine options
and the timer."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --device (CUDA where there is one; the CPU has no graphs, and runs the steps
    op by op: a check of the script alone), --load-format and --dtype."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--dtype", default="auto")


def engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
    """The engine the options of ``add_engine_arguments`` name, with ``options`` set too."""
    return EngineConfig(
        model=args.model,
        device=args.device,
        load_format=args.load_format,
        dtype=args.dtype,
        **options,
    )


Timing = tuple[float, float]  # host ms, wall ms


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run: Callable[[], object], repeats: int) -> Timing:
    """The medians of ``run``'s host time (its launches) and wall time (the device done)."""
    for _ in range(3):
        run()
    synchronize()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        launched = time.perf_counter()
        synchronize()
        host.append(launched - start)
        wall.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(wall) * 1e3
