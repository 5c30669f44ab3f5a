"""Load a model checkpoint, GGUF or Hugging Face directory, as Hugging Face-named weights.

`load_checkpoint(name)` reads the config and tokenizer at once; `Checkpoint.weights()` then streams
the tensors into the model one at a time.
"""

from __future__ import annotations

import dataclasses
import logging

from engine.checkpoint.checkpoint import Checkpoint
from engine.checkpoint.gguf_checkpoint import load_gguf
from engine.checkpoint.hf_checkpoint import load_hf_directory
from engine.checkpoint.resolve import DEFAULT_MODEL, CheckpointFormat, resolve_model

__all__ = ["DEFAULT_MODEL", "Checkpoint", "load_checkpoint"]

logger = logging.getLogger("engine.checkpoint")


def load_checkpoint(model: str) -> Checkpoint:
    """Config and tokenizer of `model` now; its weights when `Checkpoint.weights()` is iterated.

    `model` is the default model's name, a local Hugging Face directory, a local .gguf file or a
    Hugging Face hub name ("org/name"), fetched into the hub's cache.
    """
    resolved = resolve_model(model)
    logger.info("loading %s (%s) from %s", model, resolved.format.value, resolved.path)
    if resolved.format is CheckpointFormat.GGUF:
        return load_gguf(resolved.path, name=resolved.name)
    checkpoint = load_hf_directory(resolved.path)
    # A hub snapshot's directory is named by its commit; users know the model by its hub name.
    return (
        checkpoint if resolved.name is None else dataclasses.replace(checkpoint, name=resolved.name)
    )
