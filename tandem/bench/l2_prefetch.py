"""Whether a batch-1 decode step would gain from pulling the o projection's weights into L2
while attention runs: ``tandem bench kernels --l2-prefetch SHAPE``.

At batch 1 a layer's decode attention reads a few hundred KB of cache and takes several
microseconds of latency (its launch, its split programs, their merge), while the device's
memory sits nearly idle; the o projection after it then reads its weights from memory (at
the 8B shape 34 MB, 17 MB a rank at TP=2: about 7 and 3.5 us at copy bandwidth). L2 (50 MB
on an H100 or H200) holds them. This probes, with the engine's own kernels and before any
engine change, what starting that read during attention would gain: ``LAYERS`` layers of
the shape (a rank's share at ``tensor_parallel``) of decode attention over a context of
``context`` tokens, then the one-row o, gate/up and down products (``one_row_matmul``), each
layer its own weights and cache (the gate/up and down weights push the o projection's out of
L2 again), timed as one CUDA graph's replay (``time_ms``):

- plain: the chain as a decode step runs it now;
- prefetch: a second stream, at each layer's attention, runs a kernel of PTX
  ``prefetch.global.L2`` over the layer's o weights (no registers, no result), which the o
  product, not waiting for it, then finds in L2;
- bulk: the same with Hopper's ``cp.async.bulk.prefetch.L2`` (one instruction a 4 KB
  chunk);
- touch: the same with loads instead (a kernel that sums the weights), in case the hints
  are dropped;
- o alone, o in L2: the o products alone, one a layer, and each read a second time at once
  (from L2): the second read's time is what an o product takes with its weights in L2.

Left out: the QKV kernel, norms and the all-reduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.backends.triton import paged_decode_attention
from engine.backends.triton.one_row_matmul import one_row_matmul
from tandem.testing.random_checkpoint import shape_dims

LAYERS = 32
BLOCK_SIZE = 16
TABLE_TOKENS = 131072  # a graph's block tables are as wide as max_model_len
DTYPE = torch.bfloat16
LINE_BYTES = 128  # an L2 line: one prefetch each
LINES_A_PROGRAM = 1024
BULK_CHUNK_BYTES = 4096
BULK_CHUNKS_A_PROGRAM = 128
# A kernel reads only constexpr globals.
_BULK_PREFETCH_ASM = tl.constexpr(
    f"cp.async.bulk.prefetch.L2.global [$1], {BULK_CHUNK_BYTES}; mov.u32 $0, 0;"
)


@triton.jit
def _prefetch_kernel(weight_ptr, num_lines, LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    # An address past the weights would fault: those lanes prefetch the first line again.
    offsets = tl.where(lines < num_lines, lines.to(tl.int64) * LINE_ELEMENTS, 0)
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [weight_ptr + offsets],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _bulk_prefetch_kernel(weight_ptr, num_bytes, CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    chunks = tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)
    # The last chunk ends at the weights' end (it may overlap the one before): no fault.
    starts = tl.minimum(chunks.to(tl.int64) * CHUNK_BYTES, num_bytes - CHUNK_BYTES)
    tl.inline_asm_elementwise(
        _BULK_PREFETCH_ASM,
        "=r,l",
        [weight_ptr.to(tl.pointer_type(tl.uint8)) + starts],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _touch_kernel(weight_ptr, sums_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(weight_ptr + offsets, mask=offsets < numel, other=0.0)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(values.to(tl.float32)))


def prefetch_l2(weight: torch.Tensor) -> None:
    line_elements = LINE_BYTES // weight.element_size()
    num_lines = triton.cdiv(weight.numel(), line_elements)
    grid = (triton.cdiv(num_lines, LINES_A_PROGRAM),)
    _prefetch_kernel[grid](weight, num_lines, LINES_A_PROGRAM, line_elements)


def bulk_prefetch_l2(weight: torch.Tensor) -> None:
    num_bytes = weight.numel() * weight.element_size()
    assert num_bytes >= BULK_CHUNK_BYTES
    chunks = triton.cdiv(num_bytes, BULK_CHUNK_BYTES)
    grid = (triton.cdiv(chunks, BULK_CHUNKS_A_PROGRAM),)
    _bulk_prefetch_kernel[grid](weight, num_bytes, BULK_CHUNKS_A_PROGRAM, BULK_CHUNK_BYTES)


def touch(weight: torch.Tensor, sums: torch.Tensor) -> None:
    block = 8192
    _touch_kernel[(triton.cdiv(weight.numel(), block),)](weight, sums, weight.numel(), block)


@dataclass
class Layer:
    o: torch.Tensor  # [hidden, heads * head_dim / tp]
    gate_up: torch.Tensor  # [2 * intermediate / tp, hidden]
    down: torch.Tensor  # [hidden, intermediate / tp]
    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclass
class Chain:
    layers: list[Layer]
    q: torch.Tensor  # [1, heads, head_dim]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    sums: torch.Tensor  # the touch kernel's
    second: torch.cuda.Stream

    def run(self, hide: Callable[[Layer], None] | None = None) -> None:
        """The layers' attention and products, with ``hide(layer)`` on the second stream
        from each layer's attention on (joined at the end)."""
        main = torch.cuda.current_stream()
        scale = self.q.shape[-1] ** -0.5
        for layer in self.layers:
            if hide is not None:
                started = torch.cuda.Event()
                started.record(main)
                self.second.wait_event(started)
                with torch.cuda.stream(self.second):
                    hide(layer)
            out = paged_decode_attention(
                self.q,
                layer.key_cache,
                layer.value_cache,
                self.block_tables,
                self.context_lens,
                scale,
            )
            hidden = one_row_matmul(out.view(1, -1), layer.o)
            gate_up = one_row_matmul(hidden, layer.gate_up)
            one_row_matmul(gate_up, layer.down, gated=True)
        if hide is not None:
            done = torch.cuda.Event()
            done.record(self.second)
            main.wait_event(done)


def make_chain(shape: str, tensor_parallel: int, context: int) -> Chain:
    d = shape_dims(shape)
    heads, kv_heads = d.heads // tensor_parallel, max(d.kv_heads // tensor_parallel, 1)
    intermediate = d.intermediate // tensor_parallel
    blocks = -(-context // BLOCK_SIZE)

    def weight(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, device="cuda", dtype=DTYPE) * columns**-0.5

    def cache() -> torch.Tensor:
        return torch.randn(blocks, BLOCK_SIZE, kv_heads, d.head_dim, device="cuda", dtype=DTYPE)

    layers = [
        Layer(
            weight(d.hidden, heads * d.head_dim),
            weight(2 * intermediate, d.hidden),
            weight(d.hidden, intermediate),
            cache(),
            cache(),
        )
        for _ in range(LAYERS)
    ]
    table = torch.zeros(1, TABLE_TOKENS // BLOCK_SIZE, dtype=torch.int64, device="cuda")
    table[0, :blocks] = torch.arange(blocks, device="cuda")
    return Chain(
        layers,
        torch.randn(1, heads, d.head_dim, device="cuda", dtype=DTYPE),
        table,
        torch.tensor([context], device="cuda"),
        torch.empty(1 << 16, device="cuda"),
        torch.cuda.Stream(),
    )


def run_l2_prefetch(
    shapes: list[str],
    tensor_parallel: list[int],
    context: int,
    time_ms: Callable[[Callable[[], None]], float],
) -> None:
    print(
        f"\nbatch 1, context {context}, {LAYERS} layers of attention and o, gate/up and down "
        "one-row products; us a layer"
    )
    print(
        f"{'shape':14} {'TP':>3} {'o MB':>6} {'plain':>8} {'prefetch':>9} {'bulk':>8} "
        f"{'touch':>8} {'o alone':>8} {'o in L2':>8}"
    )
    for shape in shapes:
        for tp in tensor_parallel:
            chain = make_chain(shape, tp, context)
            plain = time_ms(chain.run)
            prefetched = time_ms(lambda c=chain: c.run(lambda layer: prefetch_l2(layer.o)))
            bulk = time_ms(lambda c=chain: c.run(lambda layer: bulk_prefetch_l2(layer.o)))
            touched = time_ms(lambda c=chain: c.run(lambda layer: touch(layer.o, c.sums)))
            x = torch.randn(1, chain.layers[0].o.shape[1], device="cuda", dtype=DTYPE)

            def o_products(c: Chain = chain, x: torch.Tensor = x) -> None:
                for layer in c.layers:
                    one_row_matmul(x, layer.o)

            def o_twice(c: Chain = chain, x: torch.Tensor = x) -> None:
                for layer in c.layers:  # each o product read again at once: from L2
                    one_row_matmul(x, layer.o)
                    one_row_matmul(x, layer.o)

            alone = time_ms(o_products)
            in_l2 = time_ms(o_twice) - alone
            o_mb = chain.layers[0].o.numel() * chain.layers[0].o.element_size() / 1e6
            us = [t * 1e3 / LAYERS for t in (plain, prefetched, bulk, touched, alone, in_l2)]
            print(
                f"{shape:14} {tp:3d} {o_mb:6.1f} {us[0]:8.2f} {us[1]:9.2f} {us[2]:8.2f} "
                f"{us[3]:8.2f} {us[4]:8.2f} {us[5]:8.2f}",
                flush=True,
            )
            del chain
            torch.cuda.empty_cache()
