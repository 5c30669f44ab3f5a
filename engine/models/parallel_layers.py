"""The layers that tensor parallelism splits, Megatron-LM's way, and how each rank loads its
part of their checkpoint tensors.

- ``ColumnParallelLinear``: a rank holds some output features (Q, K and V heads; gate and up
  rows); its output is its share, and no rank needs the others'.
- ``RowParallelLinear``: a rank holds the input features that the column-parallel layer before
  it produced, and the ranks' partial products are summed (one all-reduce).
- ``VocabParallelEmbedding``: a rank holds a contiguous range of the vocabulary's rows; a token
  outside it embeds to zeros before the all-reduce, and as the LM head the ranks' logits are
  gathered side by side.

With one rank these are plain linear and embedding layers. Each rank reads only its own rows
of a checkpoint tensor (``TensorSlices.read``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint.checkpoint import TensorSlices
from engine.parallel import TensorParallel


@dataclass(frozen=True)
class Rows:
    """Indices ``start`` to ``start + length`` of a checkpoint tensor's dimension of ``total``."""

    start: int
    length: int
    total: int


def load_slice(
    target: torch.Tensor,
    source: TensorSlices,
    hf_name: str,
    dim: int = 0,
    rows: Rows | None = None,
) -> None:
    """Copy ``rows`` of ``source``'s dimension ``dim`` (all of it if None) into ``target``,
    failing by name if the checkpoint tensor's shape is not the model's."""
    expected = list(target.shape)
    if rows is not None:
        expected[dim] = rows.total
    if tuple(source.shape) != tuple(expected):
        raise ValueError(
            f"{hf_name}: checkpoint shape {tuple(source.shape)}, model expects {tuple(expected)}"
        )
    if rows is None:
        target.copy_(source.read())
    else:
        target.copy_(source.read(dim, rows.start, rows.length))


class ColumnParallelLinear(nn.Module):
    """This rank's output features of one or more checkpoint tensors fused into one matrix
    (``parts``: each one's rows, in order). No communication."""

    def __init__(self, input_size: int, parts: Sequence[Rows], bias: bool) -> None:
        super().__init__()
        self.parts = tuple(parts)
        output_size = sum(part.length for part in self.parts)
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        rows = self.parts[part]
        offset = sum(p.length for p in self.parts[:part])
        target = getattr(self, param).narrow(0, offset, rows.length)
        load_slice(target, source, hf_name, 0, rows)


class RowParallelLinear(nn.Module):
    """This rank's input features (``columns`` of the checkpoint's weight); the output is
    the sum over the ranks. No bias: none of the families has one here."""

    def __init__(self, columns: Rows, output_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.columns = columns
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, columns.length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        load_slice(self.weight, source, hf_name, 1, self.columns)


class VocabParallelEmbedding(nn.Module):
    """This rank's range of the vocabulary, ``ceil(vocab / size)`` rows (the last rank's
    padded with zero rows): the embedding, and the LM head when the head is tied to it or
    is one of these itself."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        per_rank = -(-vocab_size // tp.size)
        start = tp.rank * per_rank
        self.rows = Rows(start, max(0, min(per_rank, vocab_size - start)), vocab_size)
        self.vocab_size = vocab_size
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.length)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of ``hidden`` over the whole vocabulary, on every rank."""
        logits = self.tp.all_gather(F.linear(hidden, self.weight))
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        self.weight[self.rows.length :].zero_()  # the padding rows: never an id's, logits 0
        load_slice(self.weight[: self.rows.length], source, hf_name, 0, self.rows)


ParallelLayer = ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding
