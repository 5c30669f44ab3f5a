"""Capturing a CUDA graph in a GPU test, as the engine does: warmed up first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Output = TypeVar("Output")


def captured_graph(run: Callable[[], Output]) -> tuple[torch.cuda.CUDAGraph, Output]:
    """``run`` once to compile its kernels, once on a side stream (PyTorch's warm-up before a
    capture), then captured: the graph and the output tensors its replays write."""
    run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph, output
