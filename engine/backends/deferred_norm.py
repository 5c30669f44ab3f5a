"""An RMSNorm left to the linear layer that reads it next: of one row, or of an FP8 layer's
rows.

At one row (a batch-1 decode step, a prompt's LM head) a norm is a launch and a kernel with
almost nothing to do, twice a layer and once before the LM head, against a step of a few
hundred launches. The Triton backend's one-row kernel (its ``one_row_matmul``) reads the
whole row anyway, each program all of it, so it adds the residual, sums the squares and
scales by the norm's weight as it reads, and applies 1/rms to its sums at the end.

``RMSNorm.add_and_norm`` returns a ``DeferredNorm`` where the layer ops defer norms
(``LayerOps.defers_norms``) and the row is one their one-row product takes
(``LayerOps.takes_one_row``); the next linear layer receives it in place of the normalized
row (``LinearInput``). Quantized (int8, fp8) layers ask for ``normalized()`` first: their
one-row kernel reads a byte a weight, so the row's three vectors (x, residual, norm weight),
read again by every program, weigh more against it, and a large model's fp8 step was slower
folded than not (``scripts/profile_step.py --rounds`` compares two trees' batch-1 steps).

Rows that an FP8 layer quantizes for its W8A8 product (``Fp8Linear``, more than 16 tokens)
are deferred too where the layer reading them says so (``LinearMethod.takes_deferred_norm``,
asked by ``RMSNorm`` through its ``reader``): the quantization kernel computes the norm as it
reads each row (the ops' ``quantize_fp8``), so the norm's own kernel, a launch and a write
and read of the normalized rows, is gone twice a layer.

Only the ops that made a deferred norm know which kernels can read it, so it carries them
(``ops``): a reader that cannot fold the norm asks them for it (``normalized``). Nothing
here imports a backend.

The sum x + residual is the residual stream the layer's next norm adds to: ``stream``,
written by whichever kernel computes the norm. It is a buffer of its own, not the residual
updated in place as the unfused norm does, because every program of the one-row kernel
reads the residual while the first writes the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class DefersNorms(Protocol):
    """Layer ops that leave norms to the layers after them: what computes one of theirs
    when its reader cannot."""

    def normalize(self, norm: DeferredNorm) -> torch.Tensor:
        """``norm``'s normalized rows, by the norm's own kernel, which also writes its
        ``stream``."""
        ...


@dataclass
class DeferredNorm:
    """``rms_norm(x + residual) * weight`` of rows x [T, hidden] (one row, but for an FP8
    layer's), not yet computed; with no residual (the first layer's norm), of x itself, which
    is then the stream. ``ops``: the layer ops that left it, which compute it."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    ops: DefersNorms
    stream: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        assert self.x.stride(-1) == 1
        self.stream = self.x if self.residual is None else torch.empty_like(self.x)

    def normalized(self) -> torch.Tensor:
        """The normalized rows, by the norm's own kernel, which also writes ``stream``."""
        return self.ops.normalize(self)


@dataclass(frozen=True)
class NormArguments:
    """A norm as a kernel that may compute it takes it: its residual, weight and stream as
    pointers (the rows x in place of each the kernel does not read), its eps, and whether it
    has a residual to add."""

    pointers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    eps: float
    has_residual: bool


def norm_arguments(x: torch.Tensor, norm: DeferredNorm | None) -> NormArguments:
    """``norm`` of the rows ``x`` (None: no norm) as a kernel's arguments."""
    if norm is None:
        return NormArguments((x, x, x), 0.0, False)
    residual = x if norm.residual is None else norm.residual
    return NormArguments((residual, norm.weight, norm.stream), norm.eps, norm.residual is not None)


# What a linear layer reads: its input row(s), or rows whose norm it computes itself.
LinearInput = torch.Tensor | DeferredNorm


def dense(x: LinearInput) -> torch.Tensor:
    """``x`` as a tensor, a deferred norm computed."""
    return x.normalized() if isinstance(x, DeferredNorm) else x
