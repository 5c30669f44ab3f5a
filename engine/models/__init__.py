"""Model families, found by config.json's ``architectures[0]`` or a GGUF's architecture.

A family is one module: its model class (a ``CausalLM`` with the blocks it changes), the reading
of its config.json and its GGUF layout, in one ``ModelFamily``. Adding one: that module, and
its line in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine.backends import Backend
from engine.checkpoint import Checkpoint, GGUFModelFile, read_checkpoint
from engine.checkpoint.hf_checkpoint import hf_architecture
from engine.checkpoint.hf_config import CONFIG_JSON
from engine.distributed.parallel import SINGLE, TensorParallel
from engine.model_config import ModelConfig
from engine.models import gemma3, gpt_oss, llama, mixtral, olmo2, qwen2, qwen3, qwen3_moe
from engine.models.causal_lm import CausalLM
from engine.models.family import ModelFamily

__all__ = [
    "FAMILIES",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "build_model",
    "hf_model_config",
    "load_checkpoint",
    "model_family",
]

FAMILIES: tuple[ModelFamily, ...] = (
    llama.LLAMA,
    llama.MISTRAL,
    qwen2.QWEN2,
    qwen3.QWEN3,
    gemma3.GEMMA3,
    olmo2.OLMO2,
    qwen3_moe.QWEN3_MOE,
    mixtral.MIXTRAL,
    gpt_oss.GPT_OSS,
)

_BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}
_BY_GGUF_ARCH = {
    (family.gguf.arch, family.gguf.experts): family
    for family in FAMILIES
    if family.gguf is not None
}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)


def model_family(architecture: str | None) -> ModelFamily:
    """The family of ``architecture``; a ValueError naming it and the supported ones if none."""
    family = _BY_ARCHITECTURE.get(architecture) if architecture is not None else None
    if family is not None:
        return family
    for other in FAMILIES:
        if architecture in other.refused:
            raise ValueError(other.refused[architecture])
    raise ValueError(
        f"architecture {architecture!r} is not supported, only {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def load_checkpoint(model: str) -> Checkpoint:
    """Config and tokenizer of ``model`` now; its weights when ``Checkpoint.weights()`` is
    iterated, Hugging Face-named whatever the format.

    ``model`` is the default model's name, a local Hugging Face directory, a local .gguf file or
    a Hugging Face hub name ("org/name"), fetched into the hub's cache.
    """
    files = read_checkpoint(model)
    if isinstance(files, GGUFModelFile):
        return _gguf_family(files).gguf_checkpoint(files)
    return _hf_family(files.config, files.path).hf_checkpoint(files)


def hf_model_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    """config.json (``path``'s, for messages) as its family reads it."""
    return _hf_family(config, path).config_from_hf(config, path)


def _hf_family(config: Mapping[str, Any], path: Path) -> ModelFamily:
    try:
        return model_family(hf_architecture(config))
    except ValueError as error:
        # The architecture is config.json's: the message names that file.
        raise ValueError(f"{path / CONFIG_JSON}: {error}") from None


def _gguf_family(file: GGUFModelFile) -> ModelFamily:
    arch = file.metadata.arch
    experts = bool(file.metadata.optional("expert_count", 0))
    if (arch, experts) not in _BY_GGUF_ARCH:
        supported = ", ".join(
            f"{arch}{' with experts' if experts else ''}" for arch, experts in _BY_GGUF_ARCH
        )
        raise ValueError(
            f"{file.path}: GGUF architecture {arch!r}{' with experts' if experts else ''} is "
            f"not supported, only {supported}"
        )
    return _BY_GGUF_ARCH[arch, experts]


def build_model(
    config: ModelConfig,
    backend: Backend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = SINGLE,
) -> CausalLM:
    """An uninitialized model of the config's family, allocated once on ``device`` in ``dtype``:
    rank ``tp.rank``'s part of it, its attention and layer ops ``backend``'s."""
    cls = model_family(config.architecture).model
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, backend.attention, backend.ops, tp, max_positions, device)
    finally:
        torch.set_default_dtype(previous_dtype)
    # Module.to_empty's empty_like of a meta tensor goes through torch's reference
    # implementations, which import its symbolic shapes and sympy, a large share of a start
    # (scripts/bench_latency.py times one). The same allocation by shape imports nothing.
    return model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
