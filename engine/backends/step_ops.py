"""The step's operations around the model: the interface. Sampling's draw, the grammar
masks of structured outputs, penalties, and the placing of a step's inputs on the device (a step's
pending tokens, a CUDA graph's static buffers).

The model runner, its CUDA graphs and the sampler call these rather than any kernel, so the
backend chosen decides what runs here as it does in the model (``engine.backends``):
``TorchStepOps`` (PyTorch, the reference) and ``TritonStepOps`` (a kernel each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.backends.penalties import Penalties
from engine.backends.sampling_draw import Cuts


class StepOps(Protocol):
    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``values.argmax(dim=-1)`` of float32 [B, V]: int64 [B], ties to the lowest index."""
        ...

    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        step: torch.Tensor,
        cuts: Cuts | None,
    ) -> torch.Tensor:
        """A token [B] (int64) of each row of float32 ``logits`` [B, V]: its argmax where its
        ``temperature`` [B] (float32) is 0, else a draw from the softmax at that temperature
        over what its ``cuts`` keep (None: nothing cut): the exponential race of
        ``engine/backends/sampling_draw.py`` (``race_sample``) over the random numbers of the
        row's ``seed`` and output index ``step`` [B] (int64). Tokens at -inf are never
        drawn."""
        ...

    def apply_penalties(self, logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
        """New float32 logits [B, V]: ``logits`` (left as they are: they serve logprobs)
        with each row's repetition, frequency and presence penalties on the tokens it has
        seen (``engine/backends/penalties.py``'s ``penalized``)."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set to -inf, in place, the logits [B, V] of each token whose bit is 0 in the int32
        bitmask [B, ceil(V / 32)] on the logits' device (xgrammar's layout: token j is bit
        j % 32 of word j // 32): the tokens rows' grammars forbid. Only where grammars are
        used (the sampling rank), so the grammar library may be imported here."""
        ...

    def emitted_tokens(
        self,
        sampled: torch.Tensor,
        next_drafts: torch.Tensor,
        row_starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """A verify step's acceptance (``engine/sampling/rejection_sampler.py``): int64 [2, R],
        how many of each row's sampled tokens it emits, then the last of them. ``sampled``
        [P]: the token sampled at each position, rows one after the other from
        ``row_starts`` [R], none more than ``width`` long; ``next_drafts`` [P]: the draft
        each must equal to be kept, -1 at each row's last position. A row emits its tokens
        up to the first that differs from its draft, that one included. int64, 1-D."""
        ...

    def fill_pending_tokens(
        self,
        input_ids: torch.Tensor,
        index: torch.Tensor,
        source: torch.Tensor,
        last_sampled: torch.Tensor,
    ) -> None:
        """``input_ids[index] = last_sampled[source]``: a step's pending tokens, sampled by
        the step before and not yet read by the host, put in place. int64, 1-D; ``index``
        without repeats."""
        ...

    def fill_graph_inputs(
        self,
        buffers: Sequence[torch.Tensor],
        num_rows: int,
        query_len: int,
        step: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Fill the first ``num_rows`` rows of a CUDA graph's static ``buffers``,
        ``query_len`` tokens a row: the rows of ``step`` first, copied, then padding (every
        row when ``step`` is None).

        ``buffers`` and ``step`` each hold, int64: token ids, positions and cache slots
        [rows * query_len], context lengths [rows] and block tables [rows, width]; a step's
        token ids may be strided. A copied row's block-table entries past the step's width
        are left as they were. A padding row writes no cache slot (-1) and attends to one key
        of block 0: position 0, token 0, context length 1, block-table entry 0 = 0."""
        ...
