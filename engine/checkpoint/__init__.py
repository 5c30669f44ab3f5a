"""Read a model checkpoint's files, a GGUF file or a Hugging Face directory.

`read_checkpoint(name)` finds the files (fetching them once if need be) and reads the config:
config.json as a dict, or the GGUF metadata; the tokenizer and weights are read on demand. What
the config means for the model is its family's to say: `engine.models.load_checkpoint` turns
these files into a `Checkpoint`, a ModelConfig and Hugging Face-named weights.
"""

from __future__ import annotations

import logging

from engine.checkpoint.checkpoint import Checkpoint
from engine.checkpoint.gguf_checkpoint import GGUFModelFile, read_gguf_model
from engine.checkpoint.hf_checkpoint import HFDirectory, read_hf_directory
from engine.checkpoint.resolve import DEFAULT_MODEL, CheckpointFormat, resolve_model

__all__ = [
    "DEFAULT_MODEL",
    "Checkpoint",
    "GGUFModelFile",
    "HFDirectory",
    "read_checkpoint",
]

logger = logging.getLogger("engine.checkpoint")


def read_checkpoint(model: str) -> HFDirectory | GGUFModelFile:
    """The files of `model`, its config read.

    `model` is the default model's name, a local Hugging Face directory, a local .gguf file or a
    Hugging Face hub name ("org/name"), fetched into the hub's cache.
    """
    resolved = resolve_model(model)
    logger.info("loading %s (%s) from %s", model, resolved.format.value, resolved.path)
    if resolved.format is CheckpointFormat.GGUF:
        return read_gguf_model(resolved.path, name=resolved.name)
    # A hub snapshot's directory is named by its commit; users know the model by its hub name.
    return read_hf_directory(resolved.path, name=resolved.name)
