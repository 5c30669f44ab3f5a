"""Triton kernels for the CUDA fast path, and the backend built from them (``backend.py``).

Each kernel is tested against the PyTorch backend's version of its op
(``engine.backends.pytorch``; attention against ``tandem/testing/kernel_reference.py``).

Without CUDA, Triton can only run kernels in its interpreter (numpy on the CPU), which
``@triton.jit`` chooses when a kernel is defined, not when it runs: set
``TRITON_INTERPRET=1`` before Triton is first imported (tests/conftest.py does) to run
these kernels on CPU tensors, slowly. Importing this package sets nothing.
"""

from engine.backends.triton.activation import silu_and_mul
from engine.backends.triton.norm import add_rms_norm
from engine.backends.triton.one_row_qkv import one_row_qkv_rotary_store
from engine.backends.triton.paged_attention import (
    decode_num_splits,
    decode_workspace,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.backends.triton.rotary_store import rotary_store_kv

__all__ = [
    "add_rms_norm",
    "decode_num_splits",
    "decode_workspace",
    "one_row_qkv_rotary_store",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_store_kv",
    "silu_and_mul",
]
