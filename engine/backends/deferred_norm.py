"""An RMSNorm left to the linear layer that reads it next: of one row, or of an FP8 layer's
rows.

At one row (a batch-1 decode step, a prompt's LM head) a norm is a launch and about 2 µs of
a kernel with almost nothing to do, twice a layer and once before the LM head: a tenth of
a 1B model's step. The one-row kernel (``engine.backends.triton.one_row_matmul``) reads the
whole row anyway, each program all of it, so it adds the residual, sums the squares and
scales by the norm's weight as it reads, and applies 1/rms to its sums at the end.

``RMSNorm.add_and_norm`` returns a ``DeferredNorm`` where the layer ops defer one-row norms
(the Triton ops, on CUDA) and the row would take the one-row kernel; the next linear layer
receives it in place of the normalized row (``LinearInput``). Quantized (int8, fp8) layers
ask for ``normalized()`` first: their one-row kernel reads a byte a weight, so the row's
three vectors (x, residual, norm weight), read again by every program, weigh more against
it, and an 8B fp8 step measured slower folded than not.

Measured on an H100 against the commit before (medians of 3, A/B in one call each): the 1B
shape's batch-1 step 1.227 -> 1.215, 1.222 -> 1.183 and 1.342 -> 1.288 ms (1-4% faster); the
8B shape's 5.684 -> 5.703 ms (0.3% slower).

Rows that an FP8 layer quantizes for its W8A8 product (``Fp8Linear``, more than 16 tokens)
are deferred too where the layer reading them says so (``LinearMethod.takes_deferred_norm``,
asked by ``RMSNorm`` through its ``reader``): the quantization kernel computes the norm as it
reads each row (``engine.backends.triton.fp8_quantize``), so the norm's own kernel, a launch
and a write and read of the normalized rows, is gone twice a layer.

The sum x + residual is the residual stream the layer's next norm adds to: ``stream``,
written by whichever kernel computes the norm. It is a buffer of its own, not the residual
updated in place as the unfused norm does, because every program of the one-row kernel
reads the residual while the first writes the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DeferredNorm:
    """``rms_norm(x + residual) * weight`` of rows x [T, hidden] (one row, but for an FP8
    layer's), not yet computed; with no residual (the first layer's norm), of x itself, which
    is then the stream."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    stream: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        assert self.x.stride(-1) == 1
        self.stream = self.x if self.residual is None else torch.empty_like(self.x)

    def normalized(self) -> torch.Tensor:
        """The normalized rows, by the norm's own kernel, which also writes ``stream``."""
        # Imported here: only the Triton ops defer norms, and Triton is not everywhere.
        from engine.backends.triton.norm import add_rms_norm

        residual_out = None if self.residual is None else self.stream
        normalized, _ = add_rms_norm(
            self.x, self.residual, self.weight, self.eps, residual_out=residual_out
        )
        return normalized


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


# What a linear layer reads: its input row(s), or one row whose norm it computes itself.
LinearInput = torch.Tensor | DeferredNorm


def dense(x: LinearInput) -> torch.Tensor:
    """``x`` as a tensor, a deferred norm computed."""
    return x.normalized() if isinstance(x, DeferredNorm) else x


def takes_one_row_kernel(x: LinearInput) -> bool:
    """Whether ``x`` is one row that a linear layer multiplies with the one-row kernel (and so a
    row whose norm can be left to that kernel, ``DeferredNorm``): one contiguous CUDA row,
    or a deferred norm of one (only the CUDA ops defer norms)."""
    if isinstance(x, DeferredNorm):
        return x.x.shape[0] == 1
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
