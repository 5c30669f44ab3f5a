"""Bounds on numeric command-line options, checked and worded once for the engine, the
servers and the supervisor.

A value out of its bounds is argparse's one-line error naming the flag (``argument
--max-num-seqs: must be at least 1, got -1``; exit 2) before anything loads, where it
would otherwise be a traceback after the weights load, or a server that runs and refuses
every request (a negative --max-connections or --max-request-bytes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded(
    kind: type[int] | type[float],
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
) -> Callable[[str], int | float]:
    """An argparse ``type`` that converts to ``kind`` and refuses values out of bounds."""

    def convert(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        # Written so that a float's nan fails every bound.
        if at_least is not None and not value >= at_least:
            raise argparse.ArgumentTypeError(f"must be at least {at_least:g}, got {text}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be above {above:g}, got {text}")
        if at_most is not None and not value <= at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most:g}, got {text}")
        return value

    return convert
