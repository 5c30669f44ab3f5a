"""Triton kernels for the CUDA fast path, each checked against a plain PyTorch reference.

Without CUDA, Triton can only run kernels in its interpreter (numpy on the CPU), which
``@triton.jit`` chooses when a kernel is defined, not when it runs. Selecting it here,
before any kernel module is imported, makes the choice whoever imports the kernels
first (a test module, or the model once it uses them), so CPU tests exercise the same
kernels on float32 CPU tensors, slowly.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.activation import silu_and_mul
from engine.kernels.cache import store_kv
from engine.kernels.norm import add_rms_norm
from engine.kernels.paged_attention import (
    decode_num_splits,
    decode_workspace,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.kernels.rope import apply_rope_

__all__ = [
    "add_rms_norm",
    "apply_rope_",
    "decode_num_splits",
    "decode_workspace",
    "paged_decode_attention",
    "paged_prefill_attention",
    "silu_and_mul",
    "store_kv",
]
