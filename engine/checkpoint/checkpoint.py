"""What a model is loaded from, whatever the file format."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.checkpoint.pooling_config import LAST
from engine.checkpoint.progress import with_progress
from engine.model_config import ModelConfig, TokenizerInfo
from protocol import SamplingDefaults


class TensorSlices(Protocol):
    """A checkpoint tensor not read yet: a tensor-parallel rank reads only its rows of it.

    Valid until the stream that yielded it moves on."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Indices ``start`` to ``start + length`` of dimension ``dim`` (all of it when
        ``length`` is None), on the CPU, in the stored dtype (GGUF's: float32)."""
        ...


WeightStream = Iterator[tuple[str, torch.Tensor]]
SliceStream = Iterator[tuple[str, TensorSlices]]


@dataclass
class Checkpoint:
    """A model's shape, its tokenizer and a way to stream its weights, whatever the file format.

    The model's family makes it from the files (``engine.models.load_checkpoint``).
    """

    name: str  # the model name shown to users, e.g. "SmolLM2-135M-Instruct"
    config: ModelConfig
    tokenizer: TokenizerInfo = field(repr=False)  # holds the whole tokenizer.json
    # Opens the weights lazily, so a Checkpoint costs no memory until the model is built.
    weight_source: Callable[[], SliceStream] = field(repr=False, compare=False)
    tensor_count: int | None = None  # how many weight_source yields, for the progress bar
    # What its generation_config.json recommends (a GGUF file has none).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # How its hidden states pool into an embedding (engine/checkpoint/pooling_config.py).
    pooling: str = LAST
    gguf: bool = False  # read from llama.cpp's GGUF file (else a Hugging Face directory)

    def weights(self) -> WeightStream:
        """Yield (Hugging Face name, CPU tensor) pairs, one tensor in memory at a time.

        GGUF tensors come dequantized to float32, safetensors ones in their stored dtype; the
        consumer converts dtype and device."""
        return ((name, tensor.read()) for name, tensor in self.weight_slices())

    def weight_slices(self) -> SliceStream:
        """Yield (Hugging Face name, tensor not read yet) pairs: what a model loads from,
        reading of each tensor only its own rank's part. A load that takes more than a
        second shows its progress: a bar on a terminal, a log line otherwise."""
        return with_progress(self.weight_source(), self.tensor_count, self.name)
