"""scripts/kernel_resources.py compiles the decode kernel for sm_90 on this CPU machine and
reads its registers, shared memory and SASS: the Triton kernel's fp8 variant (128-key tiles, values
widened in registers) takes more registers and shared memory than bf16's."""

from __future__ import annotations

import re
import subprocess
import sys

from tandem.testing.processes import REPO_ROOT


def kernel_resources(*args: str) -> tuple[int, int, int, int]:
    """(registers, local bytes, shared bytes, SASS instructions) the script prints."""
    command = [sys.executable, "scripts/kernel_resources.py", *args]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    print(out)
    registers, local, shared = map(
        int,
        re.search(
            r"registers a thread (\d+), local \(spilled\) bytes (\d+), shared memory (\d+) B", out
        ).groups(),
    )
    instructions = int(re.search(r"SASS instructions (\d+):", out).group(1))
    assert re.search(r"programs an SM holds: \d+ by registers, \d+ by shared memory", out)
    return registers, local, shared, instructions


def test_fp8_variant_needs_more_registers_and_shared_memory_than_bf16() -> None:
    bf16 = kernel_resources("--kv-cache-dtype", "auto")
    fp8 = kernel_resources("--kv-cache-dtype", "fp8")
    # With the model's strides as constants ptxas keeps the fp8 variant at three programs an
    # SM by spilling a few bytes; with any one group of them (q's, the cache's, out's) an
    # argument of the launch instead, it spills nothing but fits two programs an SM
    # (docs/benchmarks.md has the registers).
    assert 0 < bf16[0] < fp8[0] <= 255 and bf16[1] == 0 and fp8[1] <= 8
    assert 0 < bf16[2] < fp8[2] and 0 < bf16[3] < fp8[3]
    # Half the keys a tile: fewer registers than the engine's 128.
    assert kernel_resources("--kv-cache-dtype", "fp8", "--block-n", "64")[0] < fp8[0]


def test_gluon_fp8_kernel_holds_only_its_tiles_in_shared_memory() -> None:
    """The fp8 Gluon kernel (one warp, V transposed in registers): three tiles of K and V in
    shared memory and nothing else, no spills; at head_dim 64, two KV heads a program."""
    for heads, head_dim in (("16", "8"), "128"), (("32", "8"), "64"):
        arguments = ("--gluon", "--kv-cache-dtype", "fp8", "--heads", *heads)
        registers, local, shared, _ = kernel_resources(*arguments, "--head-dim", head_dim)
        assert 0 < registers <= 255 and local == 0
        assert shared == 3 * 2 * 32 * 128  # tiles of 32 keys, 128 bytes a key (one or two heads)


def test_verify_tile_fits_its_warps_registers() -> None:
    """A verify step of 16 drafts over three query heads a KV head (SmolLM2-135M's 9/3 at
    head_dim 64) is a tile of 128 rows: in the engine's warps it spills nothing (in two warps
    it spilled to local memory and ran several times slower)."""
    shape = ("--heads", "9", "3", "--head-dim", "64", "--split", "--query-len", "17")
    registers, local, _, _ = kernel_resources(*shape)
    assert 0 < registers <= 255 and local == 0


def test_one_sequence_split_variant_spills_nothing() -> None:
    """A batch-1 step's split decode at head_dim 128 (Qwen3-30B-A3B's 32/4 heads) takes eight
    warps (``decode_num_warps``), larger batches' four: neither spills to local memory."""
    shape = ("--heads", "32", "4", "--head-dim", "128", "--split")
    for batch in ("1", "2"):
        registers, local, _, _ = kernel_resources(*shape, "--batch", batch)
        assert 0 < registers <= 255 and local == 0
