"""The L2 prefetch probe's kernels (tandem/bench/l2_prefetch.py) compile for sm_90 on this CPU
machine, and each keeps its prefetch instructions (PTX that nothing reads from could be
dropped as dead code): the probe's first GPU call then times, rather than fails to build.
Compiled in a process of their own: the tests' interpreter (TRITON_INTERPRET) compiles
nothing."""

from __future__ import annotations

from tandem.testing.processes import compiled_in_a_process

COMPILE = """
import json
from tandem.bench import l2_prefetch as probe
from tandem.testing.sm90 import compile_for_sm90

def ptx(kernel, signature, **constants):
    return compile_for_sm90(kernel, signature, **constants).asm["ptx"]

lines = ptx(
    probe._prefetch_kernel,
    {"weight_ptr": "*bf16", "num_lines": "i32", "LINES": "constexpr", "LINE_ELEMENTS": "constexpr"},
    LINES=1024,
    LINE_ELEMENTS=64,
).splitlines()
bulk = ptx(
    probe._bulk_prefetch_kernel,
    {"weight_ptr": "*bf16", "num_bytes": "i64", "CHUNKS": "constexpr", "CHUNK_BYTES": "constexpr"},
    CHUNKS=128,
    CHUNK_BYTES=4096,
).splitlines()
print(json.dumps({
    "lines": sum("prefetch.global.L2 [" in line for line in lines),
    "bulk": sum("cp.async.bulk.prefetch.L2.global [" in line and "4096;" in line for line in bulk),
}))
"""


def test_prefetch_kernels_compile_for_sm90_and_keep_their_prefetches() -> None:
    counts = compiled_in_a_process(COMPILE, timeout_s=300)
    # 1,024 lines over a program's 128 threads: 8 each; 128 chunks: one each.
    assert counts == {"lines": 8, "bulk": 1}
