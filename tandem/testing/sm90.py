"""A Triton kernel compiled for Hopper (sm_90) on a machine without a GPU, for the tests that
read its PTX or its registers. Call it in a process without Triton's interpreter
(``processes.compiled_in_a_process``): under TRITON_INTERPRET nothing compiles."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import CompiledKernel


def compile_for_sm90(
    kernel: triton.JITFunction, signature: dict[str, str], num_warps: int = 4, **constants: Any
) -> CompiledKernel:
    """``kernel`` with each parameter's type in ``signature`` (``"*fp32"``, ``"i32"``...),
    those named in ``constants`` made constexprs of their values."""
    names = list(signature)
    signature = signature | dict.fromkeys(constants, "constexpr")
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options={"num_warps": num_warps})
