"""Model families, found by the checkpoint's ``architectures[0]``.

Every family is a ``CausalLM`` built from the shared layers; its ``ModelConfig`` says
which of their variations it uses. Adding a family: a module with its class, an entry
here, and the reading of its config.json in ``engine.checkpoint.hf_checkpoint``.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.layer_ops import LayerOps
from engine.model_config import ModelConfig
from engine.models.causal_lm import CausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "build_model", "model_class"]

_MODEL_CLASSES: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Gemma3ForCausalLM,
    )
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_CLASSES)


def model_class(architecture: str | None) -> type[CausalLM]:
    """The class of ``architecture``; a ValueError naming it and the supported ones if none."""
    cls = _MODEL_CLASSES.get(architecture) if architecture is not None else None
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported, "
            f"only {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cls


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    ops: LayerOps,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """An uninitialized model of the config's family, allocated once on ``device`` in ``dtype``."""
    cls = model_class(config.architecture)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, backend, ops, max_positions, device)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.to_empty(device=device)
