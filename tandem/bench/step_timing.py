"""The options of the scripts that build an engine in their own process to time its steps
(``scripts/time_mixed_steps.py``, ``scripts/time_verify_steps.py``)."""

from __future__ import annotations

import argparse
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
