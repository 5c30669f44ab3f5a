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

from engine.backends.deferred_norm import LinearInput
from engine.backends.layer_ops import LayerOps
from engine.checkpoint.checkpoint import TensorSlices
from engine.distributed.parallel import TensorParallel
from engine.quantization.linear_methods import LinearMethod


@dataclass(frozen=True)
class Rows:
    """Indices ``start`` to ``start + length`` of a checkpoint tensor's dimension of ``total``."""

    start: int
    length: int
    total: int


def read_slice(
    source: TensorSlices,
    shape: Sequence[int],
    hf_name: str,
    dim: int = 0,
    rows: Rows | None = None,
) -> torch.Tensor:
    """``rows`` of ``source``'s dimension ``dim`` (all of it if None), for a model tensor of
    ``shape``, failing by name if the checkpoint tensor's shape is not the model's."""
    expected = list(shape)
    if rows is not None:
        expected[dim] = rows.total
    if tuple(source.shape) != tuple(expected):
        raise ValueError(
            f"{hf_name}: checkpoint shape {tuple(source.shape)}, model expects {tuple(expected)}"
        )
    if rows is None:
        return source.read()
    return source.read(dim, rows.start, rows.length)


def load_slice(
    target: torch.Tensor,
    source: TensorSlices,
    hf_name: str,
    dim: int = 0,
    rows: Rows | None = None,
) -> None:
    """Copy ``rows`` of ``source``'s dimension ``dim`` (all of it if None) into ``target``."""
    target.copy_(read_slice(source, target.shape, hf_name, dim, rows))


class ParallelLinear(nn.Module):
    """A linear layer whose weight its ``LinearMethod`` owns: stored in the model's dtype or
    quantized (``engine.quantization.linear_methods``), loaded and multiplied the method's way."""

    def __init__(self, output_size: int, input_size: int, method: LinearMethod) -> None:
        super().__init__()
        self.method = method
        method.create_weights(self, output_size, input_size)

    def multiply(self, x: LinearInput, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.method.apply(self, x, bias)

    def load_weight_rows(
        self, param: str, offset: int, source: TensorSlices, hf_name: str, dim: int, rows: Rows
    ) -> None:
        """Load this rank's ``rows`` of the checkpoint's weight or weight scale ``source``
        (its dimension ``dim``) into the output rows from ``offset`` on."""
        weight_rows = self.weight.shape[0] if dim == 1 else rows.length
        target = slice(offset, offset + weight_rows)
        if param == "weight_scale":
            # Per-channel scales follow the output rows; a per-tensor scale is one value.
            per_channel = dim == 0 and len(source.shape) > 0 and source.shape[0] == rows.total
            scale = source.read(0, rows.start, rows.length) if per_channel else source.read()
            self.method.load_scale(self, target, scale)
            return
        shape = (weight_rows, self.weight.shape[1])
        self.method.load_weight(self, target, read_slice(source, shape, hf_name, dim, rows))

    def load_random(self, generator: torch.Generator, std: float) -> None:
        """Weights drawn from N(0, std), in float32 and then stored the method's way."""
        weight = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        weight.normal_(0.0, std, generator=generator)
        self.method.load_weight(self, slice(None), weight)


class ColumnParallelLinear(ParallelLinear):
    """This rank's output features of one or more checkpoint tensors fused into one matrix
    (``parts``: each one's rows, in order). No communication."""

    def __init__(
        self, input_size: int, parts: Sequence[Rows], bias: bool, method: LinearMethod
    ) -> None:
        output_size = sum(part.length for part in parts)
        super().__init__(output_size, input_size, method)
        self.parts = tuple(parts)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self.multiply(x, self.bias)

    def one_row_operands(
        self, x: LinearInput
    ) -> tuple[LinearInput, torch.Tensor, torch.Tensor | None]:
        """What a backend's one-row kernel multiplies for one row ``x``
        (``LinearMethod.one_row_operands``): the row, the weight and its scales."""
        return self.method.one_row_operands(self, x)

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        rows = self.parts[part]
        offset = sum(p.length for p in self.parts[:part])
        if param == "bias":
            load_slice(self.bias.narrow(0, offset, rows.length), source, hf_name, 0, rows)
        else:
            self.load_weight_rows(param, offset, source, hf_name, 0, rows)


class RowParallelLinear(ParallelLinear):
    """This rank's input features (``columns`` of the checkpoint's weight); the output is
    the sum over the ranks. Quantized, each rank's scales are those of its own columns. A
    ``bias`` (gpt-oss's output projection's), whole on every rank, is added by the first
    rank's product only, so that the sum holds it once."""

    def __init__(
        self,
        columns: Rows,
        output_size: int,
        tp: TensorParallel,
        method: LinearMethod,
        bias: bool = False,
    ) -> None:
        super().__init__(output_size, columns.length, method)
        self.columns = columns
        self.tp = tp
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._partial(x, gated=False))

    def forward_silu_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) of gate_up's halves, the activation fused into the
        product where the method can (``LinearMethod.apply_silu_gated``)."""
        return self.tp.all_reduce(self._partial(gate_up, gated=True))

    def _partial(self, x: torch.Tensor, *, gated: bool) -> torch.Tensor:
        """This rank's share of the product, before the all-reduce (the bias on rank 0)."""
        if gated:
            assert self.bias is None, "no gated layer has a bias"
            return self.method.apply_silu_gated(self, x)
        return self.multiply(x, self.bias if self.tp.rank == 0 else None)

    def into_stream(
        self, x: torch.Tensor, stream: torch.Tensor | None, *, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The product (``gated``: of silu(gate) * up of x's halves, as
        ``forward_silu_gated``) as it joins the residual ``stream``, and what is left of the
        stream for the next norm to add. One row that the layer ops' one-row product takes
        (``LayerOps.takes_one_row``), that product adds the stream and nothing is left
        (None), its bias (gpt-oss's o projection) added first as ``_partial`` adds it; under
        tensor parallelism it all-reduces its share first where it can
        (``TensorParallel.one_row_all_reduce``). Otherwise the product is a sum over the
        ranks, all-reduced before any addition, which the one-kernel all-reduce makes where it
        can (``TensorParallel.all_reduce_into_stream``), or the stream is left as it came."""
        if stream is not None and self.method.ops.takes_one_row(x):
            all_reduce = self.tp.one_row_all_reduce(stream)
            if self.tp.size == 1 or all_reduce is not None:
                bias = self.bias if self.tp.rank == 0 else None
                return self.method.one_row_into_stream(
                    self, x, stream, gated=gated, bias=bias, all_reduce=all_reduce
                ), None
        return self.tp.all_reduce_into_stream(self._partial(x, gated=gated), stream)

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        if param == "bias":
            load_slice(self.bias, source, hf_name)
        else:
            self.load_weight_rows(param, 0, source, hf_name, 1, self.columns)


class PerHeadVector(nn.Module):
    """One value for each attention head (gpt-oss's attention sinks), this rank's heads'
    (``rows``) of the checkpoint's vector."""

    def __init__(self, rows: Rows) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows.length))

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        load_slice(self.weight, source, hf_name, 0, self.rows)


class VocabParallelEmbedding(nn.Module):
    """This rank's range of the vocabulary, ``ceil(vocab / size)`` rows (the last rank's
    padded with zero rows): the embedding, and the LM head when the head is tied to it or
    is one of these itself."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, ops: LayerOps
    ) -> None:
        super().__init__()
        per_rank = -(-vocab_size // tp.size)
        start = tp.rank * per_rank
        self.rows = Rows(start, max(0, min(per_rank, vocab_size - start)), vocab_size)
        self.vocab_size = vocab_size
        self.tp = tp
        self.ops = ops  # the LM head's products
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.length)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def logits(self, hidden: LinearInput) -> torch.Tensor:
        """The LM head's float32 logits of ``hidden`` over the whole vocabulary, on every rank."""
        if self.tp.size == 1:  # one rank holds the whole vocabulary, unpadded
            return self.ops.linear_float32(hidden, self.weight)
        # Gathered in the model's dtype (half the bytes between ranks), then the last rank's
        # padding dropped.
        logits = self.tp.all_gather(self.ops.linear(hidden, self.weight))
        return logits[:, : self.vocab_size].float().contiguous()

    def load(self, param: str, part: int, source: TensorSlices, hf_name: str) -> None:
        self.weight[self.rows.length :].zero_()  # the padding rows: never an id's, logits 0
        load_slice(self.weight[: self.rows.length], source, hf_name, 0, self.rows)


ParallelLayer = ParallelLinear | VocabParallelEmbedding | PerHeadVector
