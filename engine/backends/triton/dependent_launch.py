"""Programmatic dependent launch (Hopper): a kernel's programs start while the kernel before
it finishes, instead of after.

In a batch-1 decode step of a small model, a CUDA graph replays a couple of hundred kernels
of a few microseconds each, and between two of them the device drains one grid before it
starts the next. A kernel launched with ``launch_pdl`` may be scheduled as soon as every
program of the kernel before it has called ``let_next_kernel_start``; it then calls
``wait_for_previous_kernel`` before it touches that kernel's results, which returns once
that kernel has finished and its writes are visible. So the launch overlaps, and reads of
what no kernel writes, never the data passed between kernels.

The rule that keeps this correct: a kernel launched with ``launch_options()`` waits before
its first store and before its first load of anything a kernel before it may write. What no
kernel of a forward pass writes may be read before: a weight, the RoPE tables, and the
step's inputs (positions, cache slots, context lengths), which are written before the
forward pass's first kernel starts. The one-row GEMV reads its first chunk of the weight,
then waits; the fused QKV kernel reads its position, slot and angles too, and decode
attention its context length (split, it also pulls its first tile of K/V into L2 with
``prefetch_to_l2``: a prefetch reads nothing into the program, so the newest token's row,
which the kernel before may be writing, is read after the wait as stored). What a kernel
two back wrote may be read before too, where the kernel between waits before it lets this
one start (all here do, first thing): that kernel's wait returned, so the one before it is
complete. The MoE decode path's down kernel reads the routing so (``moe_decode``), behind
its gate/up kernel. Kernels launched without it (PyTorch's,
cuBLAS') start after their predecessor finishes, as always; calling
``let_next_kernel_start`` is harmless anywhere. The decode step's other kernels (RMSNorm,
the gated activations, the Q/K rotary and K/V store, the fp8 decode kernel's split merge,
the argmax, and those that fill a step's inputs between graphs) all wait and let go first
thing.

The interpreter (the CPU tests) and GPUs before Hopper launch as usual, and both calls do
nothing there. ``TANDEM_PDL=0`` launches every kernel plainly, to measure what this gains:
``scripts/profile_step.py --model DIR --batch 1 --rounds 3`` with it and without.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
if not _INTERPRETED:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
_ENABLED = not _INTERPRETED and os.environ.get("TANDEM_PDL") != "0"


@triton.jit
def let_next_kernel_start():
    """Allow the next kernel, if launched dependent, to be scheduled now."""
    if not _INTERPRETED:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous_kernel():
    """Block until the kernel before has finished and its writes are visible."""
    if not _INTERPRETED:
        gdc_wait()


@triton.jit
def prefetch_to_l2(pointers, mask):
    """Start pulling the cache lines at ``pointers`` (where ``mask``) into L2, without waiting
    for them or reading them into the program: for what a program will read after
    ``wait_for_previous_kernel``, where it was not written by the kernel before. Nothing in
    the interpreter."""
    if not _INTERPRETED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r",
            [pointers, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def launch_options(device: torch.device) -> dict[str, bool]:
    """A launch's keyword arguments that make it dependent, where the device can (not to
    be modified: one dict per device)."""
    if not _ENABLED or device.type != "cuda":
        return {}
    return _cuda_options(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_options(device_index: int) -> dict[str, bool]:
    supported = torch.cuda.get_device_capability(device_index) >= (9, 0)
    return {"launch_pdl": True} if supported else {}
