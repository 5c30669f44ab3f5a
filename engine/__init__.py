"""The engine: ``python -m engine`` serves a model; ``from engine import LLM, SamplingParams``
generates offline (``engine/llm.py``).

The offline API is imported on first use, so that importing any engine module (and starting
``python -m engine``) does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import (
        LLM,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        SamplingParams,
    )

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
