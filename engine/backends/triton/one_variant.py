"""Launching a kernel of one compiled variant (or a few, named by the caller) without
Triton's per-launch binding.

Each launch through ``kernel[grid](...)`` binds its arguments in Python: it works out what
the kernel specializes on (each pointer's alignment, each integer's value), makes the
cache key and looks the compiled kernel up. That is most of a launch's host time, and more
between a step's other host work, where the caches are cold; a large decode batch's step is
bound by the host's time (``scripts/profile_step.py --model DIR --batch 256`` shows the
host's share, ``scripts/bench_host_step.py`` the host's work alone). A kernel written to
specialize on nothing that changes between its launches (``do_not_specialize`` for its sizes
and strides, ``do_not_specialize_on_alignment`` for views at any offset) has one variant a
device; once compiled, it is launched straight through the compiled kernel. The first
launch goes through Triton as usual (and compiles, or finds the warm-up's variant); on the
CPU interpreter every launch does. A kernel that does specialize, on what stays the same for
a model (the argmax's vocabulary and row stride), has its caller name the variant:
everything Triton specializes it on, as a key.

Only for such kernels: a variant launched with arguments it was not specialized for would
compute the wrong thing (were the pending-token kernel's count specialized, its fills of 5
or 130 tokens would take the variant compiled for 1, and be wrong). Their tests launch
the one-variant kernels through Triton over views at odd offsets and sizes of 1 and multiples
of 16 and check that one variant served them all, and the argmax over three variants in one
process against torch's.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import triton
from triton.compiler.compiler import CompiledKernel

from engine.backends.triton.dependent_launch import launch_options


class OneVariantKernel:
    def __init__(self, kernel: triton.JITFunction, num_warps: int | None = None) -> None:
        """``num_warps``: the kernel's, where not Triton's default."""
        self.kernel = kernel
        self._options = {} if num_warps is None else {"num_warps": num_warps}
        self._compiled: dict[tuple[int | None, Hashable], CompiledKernel] = {}

    def launch(
        self, grid: tuple[int, ...], device: torch.device, *args: object, variant: Hashable = None
    ) -> None:
        """``kernel[grid](*args)`` on ``device``, launched dependent where the device can
        (``dependent_launch.py``). ``args``: every parameter in order, its constexprs too;
        ``variant``: all the launch specializes on, for a kernel of more than one."""
        key = (device.index, variant)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **self._options, **launch_options(device))
            if isinstance(compiled, CompiledKernel):  # not under the interpreter
                self._compiled[key] = compiled
            return
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        compiled[(grid_x, grid_y, grid_z)](*args)
