"""Attention over the paged KV cache: the interface every backend implements.

The model calls ``backend.forward(q, k, v, layer_cache, metadata, scale, sliding_window,
rotary=...)`` (the backend applies the Q/K norms and RoPE, ``Rotary``, so that one kernel
can do them with the cache write), so backends (``engine.backends``: the PyTorch reference,
the Triton kernels) replace each other without touching the model. Where nothing comes
between the QKV projection and RoPE, it first offers the backend the projection itself
(``project_and_attend``): a backend may then project, rotate and store in one kernel.
The batch is packed: the new tokens of every sequence in one [T, ...] tensor, prefills and
decodes mixed.

The model runner calls two more methods: ``prepare`` once per step before the forward
pass, with the step's metadata, for planning shared by every layer; ``graph_capture``
around the capture of the decode CUDA graphs, for a backend that keeps static buffers.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.backends.deferred_norm import LinearInput


class OneRowProjection(Protocol):
    """A linear layer as a backend's fused one-row kernel reads it: the model's fused QKV
    projection (``engine.models.parallel_layers.ColumnParallelLinear``)."""

    bias: torch.Tensor | None

    def one_row_operands(
        self, x: LinearInput
    ) -> tuple[LinearInput, torch.Tensor, torch.Tensor | None]:
        """The row (a deferred norm where the kernel computes it), the weight, and its float32
        scales (None: the weight is in the row's dtype)."""
        ...


@dataclass
class LayerKVCache:
    """One layer's slice of the cache: [num_blocks, block_size, num_kv_heads, head_dim] each."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where each new token sits, for every layer of one forward pass. Built once per step."""

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    # [T] int64, flat cache slot (block * block_size + offset); negative for a token that
    # has no place in the cache (the padding rows of a CUDA graph): its K/V are not stored.
    slot_mapping: torch.Tensor
    token_seq_index: torch.Tensor  # [T] int64, which sequence of the batch each token is in
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64, tokens in the cache once this step's are written
    query_lens: torch.Tensor  # [B] int64, new tokens of each sequence in this step
    query_starts: torch.Tensor  # [B] int64, index in the packed batch of each one's first
    max_query_len: int
    # Every sequence has max_query_len new tokens, its context's last positions (row b's at
    # b * max_query_len): a speculative verify step padded for a CUDA graph, whose rows
    # with fewer drafts have padding tokens in front (no cache slot, position clamped at
    # 0, their output ignored). A decode step (max_query_len 1) is uniform too.
    uniform_queries: bool = False
    # In a step that is not uniform, how many sequences at the front have one new token
    # each: decodes beside a prompt's chunk, which a backend may attend to as a decode step.
    num_leading_decodes: int = 0


@dataclass
class Rotary:
    """What the backend applies to the projected q and k before it stores K and attends, in
    one pass where it can: with ``q_norm`` and ``k_norm`` (weights [head_dim]), an RMSNorm
    over each head, as Llama's RMSNorm rounds (normalized in float32, rounded to the
    model's dtype, times the weight), or, given ``norm_offset``, as Gemma's (times
    norm_offset + the weight in float32, rounded once); then rotate-half RoPE by the rows of
    the float32 [max_positions, head_dim] tables at the tokens' positions."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0
    norm_offset: float | None = None

    def __post_init__(self) -> None:
        assert (self.q_norm is None) == (self.k_norm is None)


class AttentionBackend(ABC):
    # Whether the decode step may be captured in a CUDA graph with this backend: its forward
    # never synchronizes with the host and skips negative slots without reading them back.
    supports_cuda_graphs: ClassVar[bool] = False

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 (optional)
        """Plan a step: called once before each forward pass over ``metadata``, the same
        object every layer then receives. A captured graph recorded its forward pass
        together with the ``prepare`` before it, so replaying it calls neither."""

    @contextlib.contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        """Held while the step graphs (decode, verify, prompt) are captured, for batches of
        up to ``max_batch_size`` sequences: where a backend allocates buffers that must stay at
        one address for every replay."""
        yield

    def compile_eager_variants(  # noqa: B027 (optional)
        self,
        q: torch.Tensor,  # [1, num_heads, head_dim]: a query's heads and dtype
        cache: LayerKVCache,
        query_len: int,
        max_batch: int,
        max_context_len: int,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Compile, before the first request, the kernel variants that eager steps of 1 to
        ``max_batch`` sequences of ``query_len`` queries each, their contexts up to
        ``max_context_len``, may take where a backend's variants follow a step's shape and
        the warm-up's few steps do not reach them all (engine/execution/warm_up.py)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        rotary: Rotary | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Apply ``rotary`` to q and k (None: they come rotated), write k and v into the
        cache, then attend each query to its sequence's cache. q and k may be changed in
        place; v is not.

        With ``sliding_window`` (the layer's; None for full attention) a query at position p
        attends only to the keys at positions p - sliding_window + 1 to p. The reference masks
        the older ones; a kernel should skip the cache blocks that lie wholly before the window.

        ``sinks`` (float32 [num_heads], gpt-oss's attention sinks): each head's softmax has
        one more logit in its denominator, exp(sink), of a key whose value is zero: the
        weights of the real keys sum to less than one.
        """

    def project_and_attend(
        self,
        x: LinearInput,  # [T, hidden], or a deferred norm of one row
        qkv_proj: OneRowProjection,  # the fused Q/K/V projection, q's rows first
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        rotary: Rotary,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:  # [T, num_heads, head_dim]
        """``forward`` of the projection's q, k and v, where the backend computes them itself
        with RoPE and the cache write in fewer kernels; None where it does not (the caller
        then projects and calls ``forward``)."""
        return None
