"""Whether a large decode batch would gain from running as two halves on two streams:
``tandem bench kernels --overlap SHAPE``.

At batch 129-256 a decode step runs its products (compute-bound, on cuBLAS' tiles, which at a
few hundred rows by a narrow output fill only part of the SMs) and its attention (bound by
the cache's bytes) one after the other; the roofline that ``bench_offline`` prints takes the
larger of the two, as if they overlapped. Split into two halves of the batch, one half's
attention could run beside the other half's products. This probes that with the engine's own
kernels before any engine change: ``LAYERS`` layers of the shape's Q/K/V, attention (the
engine's split decode at the step's split count, over a random paged cache of ``context``
tokens a sequence), o, gate/up and down products, each layer its own weights and cache (so
nothing stays in L2), timed as one CUDA graph's replay after an L2 flush (``time_ms``):

- whole: the batch, layer by layer, as a step runs it now;
- halves: the two halves one after the other (what splitting costs with no overlap);
- overlapped: the halves on two streams, the second starting once the first's first product
  is done, so that their attentions and products fall side by side.

Left out: norms, RoPE and the cache write, the activation, the LM head and the sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.triton import paged_decode_attention
from tandem.testing.random_checkpoint import shape_dims

LAYERS = 4
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


@dataclass
class Half:
    """One half's inputs, outputs and block tables: buffers reused by every layer, so that
    the graphs allocate nothing."""

    x: torch.Tensor  # [rows, hidden]: the Q/K/V and gate/up products' input
    q: torch.Tensor  # [rows, heads, head_dim]
    attention_out: torch.Tensor  # the o product's input
    activation: torch.Tensor  # [rows, intermediate]: the down product's input
    qkv_out: torch.Tensor
    hidden_out: torch.Tensor  # the o and down products'
    gate_up_out: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor


def make_layers(shape: str, batch: int, context: int) -> list[Layer]:
    d = shape_dims(shape)
    blocks = batch * -(-context // BLOCK_SIZE) + 1

    def weight(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, device="cuda", dtype=DTYPE) * columns**-0.5

    def cache() -> torch.Tensor:
        return torch.randn(blocks, BLOCK_SIZE, d.kv_heads, d.head_dim, device="cuda", dtype=DTYPE)

    return [
        Layer(
            weight((d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden),
            weight(d.hidden, d.heads * d.head_dim),
            weight(2 * d.intermediate, d.hidden),
            weight(d.hidden, d.intermediate),
            cache(),
            cache(),
        )
        for _ in range(LAYERS)
    ]


def make_half(shape: str, rows: int, context: int, first_block: int) -> Half:
    """Inputs of ``rows`` sequences whose cache blocks start at ``first_block``."""
    d = shape_dims(shape)
    per_sequence = -(-context // BLOCK_SIZE)
    blocks = torch.arange(rows * per_sequence, device="cuda") + first_block

    def rows_of(width: int) -> torch.Tensor:
        return torch.randn(rows, width, device="cuda", dtype=DTYPE)

    q = torch.randn(rows, d.heads, d.head_dim, device="cuda", dtype=DTYPE)
    return Half(
        x=rows_of(d.hidden),
        q=q,
        attention_out=torch.empty_like(q),
        activation=rows_of(d.intermediate),
        qkv_out=rows_of((d.heads + 2 * d.kv_heads) * d.head_dim),
        hidden_out=rows_of(d.hidden),
        gate_up_out=rows_of(2 * d.intermediate),
        block_tables=blocks.view(rows, per_sequence),
        context_lens=torch.full((rows,), context, device="cuda"),
    )


def run_layers(half: Half, layers: list[Layer], after_first: Callable[[], None] | None) -> None:
    """The half's chain of products and attentions through ``layers``; ``after_first``
    called once its first product is launched."""
    scale = half.q.shape[-1] ** -0.5
    for index, layer in enumerate(layers):
        torch.mm(half.x, layer.qkv.t(), out=half.qkv_out)
        if index == 0 and after_first is not None:
            after_first()
        paged_decode_attention(
            half.q,
            layer.key_cache,
            layer.value_cache,
            half.block_tables,
            half.context_lens,
            scale,
            num_splits=1,  # the two streams' kernels share no split counters
            out=half.attention_out,
        )
        torch.mm(half.attention_out.flatten(1), layer.o.t(), out=half.hidden_out)
        torch.mm(half.x, layer.gate_up.t(), out=half.gate_up_out)
        torch.mm(half.activation, layer.down.t(), out=half.hidden_out)


def run_overlapped(
    first: Half, other: Half, layers: list[Layer], second: torch.cuda.Stream
) -> None:
    """``first`` on the current stream and ``other`` on ``second``, from once ``first``'s
    first product is launched; joined at the end."""
    main = torch.cuda.current_stream()
    started = torch.cuda.Event()
    run_layers(first, layers, lambda: started.record(main))
    second.wait_event(started)
    with torch.cuda.stream(second):
        run_layers(other, layers, None)
    done = torch.cuda.Event()
    done.record(second)
    main.wait_event(done)


def time_shape(
    shape: str, batch: int, context: int, time_ms: Callable[[Callable[[], None]], float]
) -> tuple[float, float, float]:
    """ms of the whole batch, of its halves one after the other, and of them overlapped."""
    layers = make_layers(shape, batch, context)
    per_sequence = -(-context // BLOCK_SIZE)
    whole = make_half(shape, batch, context, 1)
    first = make_half(shape, batch // 2, context, 1)
    other = make_half(shape, batch - batch // 2, context, 1 + (batch // 2) * per_sequence)
    second = torch.cuda.Stream()
    return (
        time_ms(lambda: run_layers(whole, layers, None)),
        time_ms(lambda: (run_layers(first, layers, None), run_layers(other, layers, None))),
        time_ms(lambda: run_overlapped(first, other, layers, second)),
    )


def run_overlap(
    shapes: list[str], batch: int, context: int, time_ms: Callable[[Callable[[], None]], float]
) -> None:
    print(
        f"\nbatch {batch}, context {context}, {LAYERS} layers; us a layer: whole batch, "
        "halves one after the other, halves on two streams"
    )
    print(f"{'shape':14} {'whole':>8} {'halves':>8} {'overlapped':>10} {'overlapped / whole':>19}")
    for shape in shapes:
        whole_us, halves_us, overlapped_us = (
            t * 1e3 / LAYERS for t in time_shape(shape, batch, context, time_ms)
        )
        print(
            f"{shape:14} {whole_us:8.1f} {halves_us:8.1f} {overlapped_us:10.1f} "
            f"{overlapped_us / whole_us:19.2f}",
            flush=True,
        )
        torch.cuda.empty_cache()
