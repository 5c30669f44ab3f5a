"""The attention kernels' registers, shared memory and instructions on Hopper, from
any machine: it is compiled for sm_90 here (Triton's own ptxas and cuobjdump), no GPU needed.

    python scripts/kernel_resources.py [--heads 16 8] [--head-dim 128] [--kv-cache-dtype fp8]
                                       [--split] [--query-len 1] [--sliding-window W]
                                       [--block-n N] [--num-warps W] [--num-stages 3]
    python scripts/kernel_resources.py --gluon --kv-cache-dtype fp8 [--heads 32 8]
                                       [--head-dim 64] [--split]
    python scripts/kernel_resources.py --prefill [--heads 32 8] [--head-dim 128]
                                       [--sliding-window W] [--block-n N]
                                       [--num-warps W] [--num-stages S]

(--gluon: the kernel the engine runs over an fp8 cache on sm_89+, ``fp8_decode.py``, with the
engine's constants; --prefill: the prefill kernel, ``prefill_constants``'s variant.)

A kernel reading K/V at copy bandwidth needs enough bytes in flight on every SM, so it needs
enough resident programs: the registers a thread takes and the shared memory a program takes
bound how many fit on an SM. Printed for the variant a decode step of that shape compiles
(``decode_constants``, with the engine's strides and specializations) or with --block-n,
--num-warps and --num-stages changed: registers and local memory (spills), shared memory, the
programs an SM holds by each limit, and the SASS instruction mix. A candidate that needs more
registers or shared memory than the kernel it replaces shows here before any device time is
spent on it (a keys-contiguous fp8 value layout, for one, needed so many registers that one
program fit an SM, and ran slower: docs/history/benchmarks-lab-notebook.md).

Compiled by the Triton installed here, which may not be the GPU machine's, and register
counts differ between Triton versions: put a wheel of the machine's version first on
PYTHONPATH to compare like with like.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

# Compiled, not interpreted: under TRITON_INTERPRET (the CPU tests') a kernel is a Python
# function, with no code to inspect. Before Triton or the kernels are imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from engine.backends.triton.fp8_decode import (
    FP8_DECODE_NUM_WARPS,
    _fp8_decode_kernel,
    fp8_decode_constants,
)
from engine.backends.triton.paged_attention import (
    PREFILL_STAGES,
    _decode_kernel,
    _prefill_kernel,
    decode_constants,
    decode_num_stages,
    prefill_constants,
    prefill_num_warps,
)

# An H100's or H200's SM: 64K 32-bit registers, 228 KB of shared memory (1 KB of it reserved
# a program), 64 resident warps.
REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024
RESERVED_SHARED_PER_PROGRAM = 1024
WARPS_PER_SM = 64
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}


def engine_arguments(
    num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None
) -> dict[str, int | float]:
    """The attention kernels' scalar arguments as the engine passes them: q a view of the
    fused QKV projection's output, caches [blocks, block_size, kv_heads, head_dim]."""
    q_row = (num_heads + 2 * num_kv_heads) * head_dim
    return {
        "window": sliding_window or 0,
        "scale_log2": head_dim**-0.5 * math.log2(math.e),
        "stride_q_seq": q_row,
        "stride_q_token": q_row,  # the prefill kernel's name for it
        "stride_q_head": head_dim,
        "stride_table": 0,  # not specialized
        "stride_cache_slot": num_kv_heads * head_dim,
        "stride_cache_head": head_dim,
        "stride_out_seq": num_heads * head_dim,
        "stride_out_token": num_heads * head_dim,
        "stride_out_head": head_dim,
        "stride_ws_seq": 0,  # not specialized
        "stride_ws_head": 0,  # not specialized
        "stride_ws_split": head_dim + 2,
    }


def compile_attention_kernel(
    constants: dict[str, int | bool | str],
    scalars: dict[str, int | float],
    kv_dtype: torch.dtype,
    num_warps: int,
    num_stages: int,
    kernel: triton.runtime.JITFunction = _decode_kernel,
) -> triton.compiler.CompiledKernel:
    """An attention kernel (the Triton decode one, the Gluon fp8 one, or the prefill one)
    compiled for sm_90, specialized as Triton specializes a launch: the kernel's constant
    parameters take the engine's values, integers equal to 1 become constants, multiples of
    16 and pointers are marked divisible by 16, except the arguments the kernel exempts."""
    names = kernel.arg_names
    exempt = set(kernel.do_not_specialize)
    exempt_alignment = set(kernel.do_not_specialize_on_alignment)
    pointers = {
        "q_ptr": "*bf16",
        "out_ptr": "*bf16",
        "key_cache_ptr": f"*{_TRITON_TYPES[kv_dtype]}",
        "value_cache_ptr": f"*{_TRITON_TYPES[kv_dtype]}",
        "block_tables_ptr": "*i64",
        "context_lens_ptr": "*i64",
        "query_lens_ptr": "*i64",
        "query_starts_ptr": "*i64",
        "workspace_ptr": "*fp32",
        "split_counts_ptr": "*i32",
        "sinks_ptr": "*bf16",  # q when the model has no sinks (unread)
    }
    fixed = dict(constants)
    signature: dict[str, str] = {}
    divisible: list[int] = []
    for index, name in enumerate(names):
        if index in kernel.constexprs and name in scalars:
            fixed[name] = scalars[name]
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            if name not in exempt_alignment:
                divisible.append(index)
        elif name == "scale_log2":
            signature[name] = "fp32"
        elif name in scalars:
            value = scalars[name]
            if name not in exempt and value == 1:
                fixed[name] = 1
                signature[name] = "constexpr"
                continue
            signature[name] = "i32"
            if name not in exempt | exempt_alignment and value % 16 == 0 and value:
                divisible.append(index)
        else:
            signature[name] = "constexpr"
    source_type = GluonASTSource if kernel.is_gluon() else ASTSource
    source = source_type(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in fixed.items()},
        attrs={(index,): [["tt.divisibility", 16]] for index in divisible},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel: triton.compiler.CompiledKernel) -> tuple[int, int, str]:
    """(registers a thread, local memory bytes a thread: spills, SASS) of a compiled kernel,
    read from its cubin by Triton's own cuobjdump. Spilled registers live in the thread's
    stack frame (``STACK``; ``LOCAL`` counts other local arrays): both are local memory."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as directory:
        cubin = Path(directory, "kernel.cubin")
        cubin.write_bytes(kernel.asm["cubin"])

        def dump(flag: str) -> str:
            command = [str(cuobjdump), flag, str(cubin)]
            return subprocess.run(command, capture_output=True, text=True, check=True).stdout

        usage, sass = dump("-res-usage"), dump("-sass")
    registers = re.search(r"REG:(\d+)", usage)
    stack, local = re.search(r"STACK:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    assert registers is not None and stack is not None and local is not None, usage
    return int(registers.group(1)), int(stack.group(1)) + int(local.group(1)), sass


def instruction_mix(sass: str) -> collections.Counter[str]:
    """SASS opcodes (without modifiers) and how often each appears in the code."""
    opcodes: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            opcodes[match.group(1)] += 1
    return opcodes


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> dict[str, int]:
    """Resident programs an SM holds by each limit (registers are allocated 8 a thread at a
    time)."""
    per_warp = -(-registers // 8) * 8 * 32
    return {
        "registers": REGISTERS_PER_SM // (per_warp * num_warps),
        "shared memory": SHARED_BYTES_PER_SM // (shared_bytes + RESERVED_SHARED_PER_PROGRAM),
        "warps": WARPS_PER_SM // num_warps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 8], help="query, KV")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--split", action="store_true", help="the split-K variant")
    parser.add_argument("--query-len", type=int, default=1, help="1 + k: a verify step")
    parser.add_argument(
        "--batch", type=int, default=2, help="sequences a step (1: a batch-1 step's variant)"
    )
    parser.add_argument("--sliding-window", type=int)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--block-n", type=int, help="keys a tile (default: the engine's)")
    parser.add_argument("--num-warps", type=int, help="default: the engine's")
    parser.add_argument("--num-stages", type=int, help="default: the engine's")
    parser.add_argument(
        "--gluon",
        action="store_true",
        help="the Gluon kernel the engine runs over an fp8 cache on sm_89+ (fp8_decode.py)",
    )
    parser.add_argument("--prefill", action="store_true", help="the prefill kernel instead")
    args = parser.parse_args()
    num_heads, num_kv_heads = args.heads
    kv_dtype = torch.bfloat16 if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn
    if args.gluon:
        gluon_resources(args, num_heads, num_kv_heads)
        return
    if args.prefill:
        prefill_resources(args, num_heads, num_kv_heads, kv_dtype)
        return
    constants, args.num_warps = decode_constants(
        torch.bfloat16,
        kv_dtype,
        num_heads,
        num_kv_heads,
        args.head_dim,
        args.block_size,
        args.query_len,
        args.sliding_window,
        2 if args.split else 1,
        args.batch,
        num_warps=args.num_warps,  # its merge's splits a round follow the warps
    )
    if args.block_n is not None:
        constants["BLOCK_N"] = args.block_n
    if args.num_stages is None:
        args.num_stages = decode_num_stages(args.query_len, kv_dtype)
    scalars = engine_arguments(num_heads, num_kv_heads, args.head_dim, args.sliding_window)
    warps, stages = args.num_warps, args.num_stages
    kernel = compile_attention_kernel(constants, scalars, kv_dtype, warps, stages)
    print(
        f"decode kernel, sm_90, Triton {triton.__version__}: heads {num_heads}/{num_kv_heads}, "
        f"head_dim {args.head_dim}, K/V {kv_dtype}, BLOCK_N {constants['BLOCK_N']}, "
        f"{args.num_warps} warps, {args.num_stages} stages"
        f"{', split' if args.split else ''}"
    )
    report(kernel, args.num_warps)


def prefill_resources(
    args: argparse.Namespace, num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype
) -> None:
    """The prefill kernel with the engine's constants (or --block-n, --num-warps and
    --num-stages changed)."""
    constants = prefill_constants(
        torch.bfloat16, num_heads, num_kv_heads, args.head_dim, args.block_size, args.sliding_window
    )
    if args.block_n is not None:
        constants["BLOCK_N"] = args.block_n
    warps = args.num_warps or prefill_num_warps(int(constants["BLOCK_D"]))
    stages = args.num_stages or PREFILL_STAGES
    scalars = engine_arguments(num_heads, num_kv_heads, args.head_dim, args.sliding_window)
    kernel = compile_attention_kernel(constants, scalars, kv_dtype, warps, stages, _prefill_kernel)
    rows = int(constants["BLOCK_Q"]) * int(constants["GROUP_PAD"])
    print(
        f"prefill kernel, sm_90, Triton {triton.__version__}: heads {num_heads}/{num_kv_heads}, "
        f"head_dim {args.head_dim}, K/V {kv_dtype}, {rows} rows ({constants['BLOCK_Q']} tokens) "
        f"x BLOCK_N {constants['BLOCK_N']}, {warps} warps, {stages} stages"
    )
    report(kernel, warps)


def gluon_resources(args: argparse.Namespace, num_heads: int, num_kv_heads: int) -> None:
    """The fp8 Gluon kernel for one query a sequence, with the engine's constants; with two
    KV heads a program it reads the caches as [.., KV heads / 2, 2 * head_dim]."""
    assert args.kv_cache_dtype == "fp8" and args.query_len == 1, "fp8, one query a sequence"
    window = args.sliding_window or 0
    constants = fp8_decode_constants(
        num_heads, num_kv_heads, args.head_dim, args.block_size, window, 2 if args.split else 1
    )
    scalars = engine_arguments(num_heads, num_kv_heads, args.head_dim, args.sliding_window)
    scalars["stride_cache_head"] *= constants["HEADS"]
    warps = FP8_DECODE_NUM_WARPS
    kernel = compile_attention_kernel(
        constants, scalars, torch.float8_e4m3fn, warps, 1, _fp8_decode_kernel
    )
    print(
        f"fp8 decode kernel (Gluon), sm_90, Triton {triton.__version__}: heads "
        f"{num_heads}/{num_kv_heads}, head_dim {args.head_dim}, {constants['HEADS']} KV heads "
        f"a program, BLOCK_N {constants['BLOCK_N']}, {warps} warp, {constants['STAGES']} "
        f"tiles in flight{', split' if args.split else ''}"
    )
    report(kernel, warps)


def report(kernel: triton.compiler.CompiledKernel, num_warps: int) -> None:
    registers, spills, sass = resources(kernel)
    shared = kernel.metadata.shared
    print(
        f"registers a thread {registers}, local (spilled) bytes {spills}, shared memory {shared} B"
    )
    limits = programs_per_sm(registers, shared, num_warps)
    print(
        "programs an SM holds: "
        + ", ".join(f"{count} by {limit}" for limit, count in limits.items())
        + f" -> {min(limits.values())}"
    )
    mix = instruction_mix(sass)
    top = ", ".join(f"{opcode} {count}" for opcode, count in mix.most_common(14))
    print(f"SASS instructions {sum(mix.values())}: {top}")


if __name__ == "__main__":
    main()
