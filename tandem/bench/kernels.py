"""Decode attention against the memory wall: its share of the measured copy bandwidth.

    tandem bench kernels [--head-dims 64 128 256] [--heads Q:KV] [--batches 1 8 64 256]
                         [--contexts 256 1024 4096 16384] [--max-gib 24]
                         [--kv-cache-dtype auto|fp8] [--table-tokens 131072]
                         [--decode-warps 4 8]
    tandem bench kernels --moe SHAPE [SHAPE ...] [--moe-tokens 1 8 64 256 2048]
                         [--quantization fp8|mxfp4] [--moe-sweep]
    tandem bench kernels --prefill [--head-dims 64 128] [--heads Q:KV]
                         [--prompts 1x8192 16x512 1x32768]
    tandem bench kernels --fp8-products SHAPE [SHAPE ...] [--rows 32 64 128 256 2048]
    tandem bench kernels --overlap SHAPE [SHAPE ...] [--overlap-batch 256]
                         [--overlap-context 700]
    tandem bench kernels --l2-prefetch SHAPE [SHAPE ...] [--l2-prefetch-tp 1 2]
                         [--l2-prefetch-context 512]
    tandem bench kernels --sampler [--batches 1 8 64 256]
    tandem bench kernels --ragged 100:2048 [--head-dims 64 128] [--batches 32 64 128 256]
                         [--table-tokens 131072]

A decode step's attention must read every cached key and value of every sequence once; the
kernel (``paged_decode_attention``, split-K as the engine runs it: the split count from
the block table's width, a CUDA graph's case, the splits merged in the same launch; an fp8
cache's Gluon kernel and its merge kernel) is timed over random caches with shuffled
blocks, each table as wide as its context, so that the split count follows the context
(an engine's graph, wider, splits every context as its longest; ``--table-tokens`` makes the
tables that wide, as a graph's for contexts up to that many tokens: then the split count is
the engine's; either way a long context's parts hold at least about sqrt(tiles / 8) tiles,
so some splits may hold no keys: the "splits" column counts those launched), and its K/V
bytes over its time are compared with the device-to-device copy bandwidth measured at the
start (engine/roofline.py). Head shapes are the models': head_dim
64 as Llama 3.2 1B (32 query heads on 8 KV heads), 128 as Qwen3 0.6B (16 on 8), 256 as
Gemma 3 1B (4 on 1); ``--heads 32:8`` sets other counts for every head_dim given (with
``--head-dims 128``, Llama 3.1 8B's and 70B's group of 4). Every result is checked against
the float32 reference first. Each timing starts with the L2 cache flushed. "of same"
compares with a copy of the same bytes timed alike: small cases (a few MB) are bound by
launch and latency, not bandwidth, for any kernel. ``--decode-warps`` times the Triton
kernel in each of those warps a program, beside one another ("warps"; "rule": the engine's,
``decode_num_warps``), where the rule is to be changed.
Then the fused Q/K-norm + RoPE + cache-write kernel at a decode and a prefill step.
With --moe, instead, the fused MoE kernel at the shapes named (tandem/bench/moe_kernel.py
says what its table shows). With --prefill, instead, prefill attention
(``paged_prefill_attention``) over whole causal prompts (BATCHxLENGTH: sequences of that
many tokens, none cached before), checked against PyTorch's scaled_dot_product_attention
and timed: its FLOPs (4 a query-key pair a head a dimension, the causal half) over its time,
against the measured GEMM rate. With --fp8-products, instead, the W8A8 FP8 products of the
shapes' linear layers (tandem/bench/fp8_products.py says what its table shows). With
--overlap, instead, a large decode batch's products and attentions whole against two halves
on two streams (tandem/bench/overlap.py). --l2-prefetch, a batch-1 step's chain of
attention and one-row products with and without the o projection's weights pulled into L2
during attention (tandem/bench/l2_prefetch.py). --sampler, a sampled step's draw: the
Triton kernel against PyTorch's tensors (tandem/bench/sampler_kernel.py). --ragged, decode
attention over a batch whose contexts differ, as an offline batch's do, in the order drawn
and longest first (as the scheduler orders decodes). CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch

from engine.backends.attention import Rotary
from engine.backends.triton import (
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
)
from engine.backends.triton.paged_attention import MAX_DECODE_SPLITS, default_decode_splits
from engine.roofline import measure_rates
from tandem.bench.fp8_products import ROWS as FP8_ROWS
from tandem.bench.fp8_products import run_fp8_products
from tandem.bench.l2_prefetch import run_l2_prefetch
from tandem.bench.moe_kernel import SHAPES as MOE_SHAPES
from tandem.bench.moe_kernel import TOKENS as MOE_TOKENS
from tandem.bench.moe_kernel import run_moe
from tandem.bench.overlap import run_overlap
from tandem.bench.sampler_kernel import run_sampler
from tandem.testing.kernel_reference import paged_attention_reference

# head_dim: (query heads, KV heads)
HEADS = {64: (32, 8), 128: (16, 8), 256: (4, 1)}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


_L2_FLUSH_BYTES = 256 * 1024**2  # more than any GPU's L2: each timing starts cold


def time_ms(run: Callable[[], None], repeats: int = 20) -> float:
    """Median of ``repeats`` timings of ``run`` replayed from a CUDA graph (as the engine's
    decode runs), after a warm-up, each with the L2 cache flushed first (a decode step
    reads what the last step's other layers pushed out)."""
    run()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    timings = []
    for _ in range(repeats):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end))
    return statistics.median(timings)


def copy_ms(num_bytes: int) -> float:
    """A device-to-device copy reading ``num_bytes`` (and writing as many), timed alike: the
    best a kernel reading that much could do, launch included."""
    source = torch.empty(num_bytes // 2, dtype=DTYPE, device="cuda")
    target = torch.empty_like(source)
    return time_ms(lambda: target.copy_(source))


def decode_case(
    head_dim: int,
    heads: tuple[int, int],
    contexts: list[int],
    bandwidth: float,
    check: bool,
    kv_dtype: torch.dtype = DTYPE,
    table_tokens: int = 0,
    splits_times: int = 1,
    num_warps: int | None = None,
) -> tuple[int, float, float]:
    """(splits, ms, share of copy bandwidth) of one decode step's attention with ``heads``
    (query heads, KV heads) for a sequence of each context of ``contexts``, over a cache of
    ``kv_dtype`` (bf16, or float8 e4m3 as --kv-cache-dtype fp8 stores it); block tables as
    wide as ``table_tokens`` where that is longer than the longest context (their other
    entries never read); split ``splits_times`` as many times as the engine's rule splits;
    the Triton kernel in ``num_warps`` (None: the engine's rule, ``decode_num_warps``)."""
    num_heads, num_kv_heads = heads
    batch = len(contexts)
    blocks = [-(-context // BLOCK_SIZE) for context in contexts]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype)
    value_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype)
    table_width = max(max(blocks), -(-table_tokens // BLOCK_SIZE))
    block_tables = torch.zeros(batch, table_width, dtype=torch.int64, device="cuda")
    shuffled = (torch.randperm(num_blocks - 1, device="cuda") + 1).split(blocks)
    for row, ids in enumerate(shuffled):
        block_tables[row, : len(ids)] = ids
    context_lens = torch.tensor(contexts, device="cuda")
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    splits = default_decode_splits(q, key_cache, block_tables, query_len=1)
    splits = min(splits * splits_times, MAX_DECODE_SPLITS)

    def run() -> None:
        paged_decode_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            num_splits=splits,
            out=out,
            num_warps=num_warps,
        )

    if check:
        run()
        reference = paged_attention_reference(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            torch.ones_like(context_lens),
            scale,
        )
        error = ((out.float() - reference).norm() / reference.norm()).item()
        rounding = ((reference.to(DTYPE).float() - reference).norm() / reference.norm()).item()
        assert error < 2 * rounding, f"head_dim {head_dim} contexts {contexts}: error {error:.2e}"
    ms = time_ms(run)
    kv_bytes = 2 * sum(contexts) * num_kv_heads * head_dim * kv_dtype.itemsize
    return splits, ms, kv_bytes / (ms / 1e3) / bandwidth


def run_ragged(args: argparse.Namespace, bandwidth: float, kv_dtype: torch.dtype) -> None:
    """Decode attention over contexts drawn uniformly in LOW..HIGH (seed 0), as an offline
    batch's differ, in the order drawn and longest first (the scheduler's order): whether
    the order the programs start in loses bandwidth to a long context started last; and
    longest first split 2 and 4 times as many times as the engine's rule splits (whether
    smaller parts would balance such a batch better)."""
    low, high = map(int, args.ragged.split(":"))
    print(
        f"\n{'head_dim':>8} {'heads':>6} {'batch':>6} {'contexts':>11} {'order':>13} "
        f"{'splits':>6} {'us':>9} {'of copy':>8}"
    )
    for head_dim in args.head_dims:
        heads = tuple(map(int, args.heads.split(":"))) if args.heads else HEADS[head_dim]
        for batch in args.batches:
            drawn = torch.randint(
                low, high + 1, (batch,), generator=torch.Generator().manual_seed(0)
            )
            longest_first = drawn.sort(descending=True).values.tolist()
            check = batch * high <= 64 * 1024  # the float32 reference loops in Python
            for order, contexts, times in (
                ("as drawn", drawn.tolist(), 1),
                ("longest first", longest_first, 1),
                ("longest, 2x", longest_first, 2),
                ("longest, 4x", longest_first, 4),
            ):
                splits, ms, share = decode_case(
                    head_dim, heads, contexts, bandwidth, check, kv_dtype, args.table_tokens, times
                )
                print(
                    f"{head_dim:8d} {f'{heads[0]}/{heads[1]}':>6} {batch:6d} "
                    f"{f'{low}-{high}':>11} {order:>13} {splits:6d} {ms * 1e3:9.1f} {share:8.0%}"
                )
                torch.cuda.empty_cache()


def prefill_case(
    head_dim: int, heads: tuple[int, int], batch: int, length: int, flops_per_s: float
) -> tuple[float, float, float]:
    """(ms, share of the GEMM rate, error against scaled_dot_product_attention relative to
    its norm) of prefill attention over ``batch`` whole prompts of ``length`` tokens."""
    num_heads, num_kv_heads = heads
    blocks_per_seq = -(-length // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    value_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    block_tables = (torch.randperm(num_blocks - 1, device="cuda") + 1)[
        : batch * blocks_per_seq
    ].view(batch, blocks_per_seq)
    lengths = torch.full((batch,), length, device="cuda")
    starts = torch.arange(batch, device="cuda") * length
    q = torch.randn(batch * length, num_heads, head_dim, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)

    def run() -> None:
        paged_prefill_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            lengths,
            lengths,
            starts,
            length,
            head_dim**-0.5,
            out=out,
        )

    run()
    group = num_heads // num_kv_heads

    def dense(cache: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim]
        rows = cache[block_tables].flatten(1, 2)[:, :length]
        return rows.transpose(1, 2).repeat_interleave(group, 1)

    queries = q.view(batch, length, num_heads, head_dim).transpose(1, 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        queries, dense(key_cache), dense(value_cache), is_causal=True
    )
    expected = expected.transpose(1, 2).flatten(0, 1).float()
    error = ((out.float() - expected).norm() / expected.norm()).item()
    ms = time_ms(run, repeats=5)
    flops = 4 * head_dim * num_heads * batch * length * (length + 1) / 2
    return ms, flops / (ms / 1e3) / flops_per_s, error


def run_prefill(args: argparse.Namespace, flops_per_s: float) -> None:
    print(f"\n{'head_dim':>8} {'heads':>6} {'prompts':>10} {'ms':>9} {'of GEMM':>8} {'error':>8}")
    for head_dim in args.head_dims:
        heads = tuple(map(int, args.heads.split(":"))) if args.heads else HEADS[head_dim]
        for prompts in args.prompts:
            batch, length = map(int, prompts.split("x"))
            ms, share, error = prefill_case(head_dim, heads, batch, length, flops_per_s)
            # bf16 rounding of the output and of the softmax's weights: a few 1e-3 at most.
            assert error < 1e-2, f"head_dim {head_dim}, {prompts}: error {error:.1e}"
            print(
                f"{head_dim:8d} {f'{heads[0]}/{heads[1]}':>6} {prompts:>10} {ms:9.3f} "
                f"{share:8.0%} {error:8.1e}"
            )
            torch.cuda.empty_cache()


def rotary_case(num_tokens: int, bandwidth: float) -> tuple[float, float]:
    """(ms, share of copy bandwidth) of the fused Q/K norms + RoPE + cache write at Qwen3
    0.6B's shape: q read and written, k and v read, k and v written to the cache."""
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda")
    qkv = qkv.to(DTYPE)
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k, v = (t.view(num_tokens, num_kv_heads, head_dim) for t in (k, v))
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, device="cuda", dtype=DTYPE)
    value_cache = torch.empty_like(key_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    angles = torch.rand(4096, head_dim, device="cuda")
    norms = torch.ones(2, head_dim, device="cuda", dtype=DTYPE)
    rotary = Rotary(angles.cos(), angles.sin(), norms[0], norms[1], 1e-6)

    def run() -> None:
        rotary_store_kv(q, k, v, key_cache, value_cache, slots, positions, rotary)

    ms = time_ms(run)
    moved = (2 * q.numel() + 2 * k.numel() + 2 * v.numel()) * DTYPE.itemsize
    return ms, moved / (ms / 1e3) / bandwidth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument(
        "--heads", help="Q:KV, query and KV heads for every head_dim (default: the table's)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--max-gib", type=float, default=24, help="largest cache to allocate")
    parser.add_argument(
        "--decode-warps",
        type=int,
        nargs="+",
        help="time decode attention's Triton kernel in each of these warps a program "
        "(default: the engine's rule, decode_num_warps)",
    )
    parser.add_argument("--target", type=float, default=0.85, help="share to reach")
    parser.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="block tables this many tokens wide, as a CUDA graph's (default: the context's)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bfloat16"
    )
    parser.add_argument(
        "--moe", nargs="+", choices=sorted(MOE_SHAPES), help="time the fused MoE kernel instead"
    )
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=list(MOE_TOKENS))
    parser.add_argument(
        "--quantization",
        choices=["fp8", "mxfp4"],
        help="--moe: FP8 weights, or MXFP4 ones (mxfp4_moe's kernels) (default: bf16)",
    )
    parser.add_argument(
        "--moe-sweep", action="store_true", help="--moe: time the rule's neighbours too"
    )
    parser.add_argument(
        "--prefill", action="store_true", help="time prefill attention instead (--prompts)"
    )
    parser.add_argument(
        "--fp8-products", nargs="+", metavar="SHAPE", help="time the W8A8 products instead"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(FP8_ROWS))
    parser.add_argument(
        "--overlap", nargs="+", metavar="SHAPE", help="time two half-batches' overlap instead"
    )
    parser.add_argument("--overlap-batch", type=int, default=256)
    parser.add_argument("--overlap-context", type=int, default=700)
    parser.add_argument(
        "--l2-prefetch",
        nargs="+",
        metavar="SHAPE",
        help="time a batch-1 chain with the o weights prefetched into L2 instead",
    )
    parser.add_argument("--l2-prefetch-tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--l2-prefetch-context", type=int, default=512)
    parser.add_argument(
        "--sampler", action="store_true", help="time a sampled step's draw instead (--batches)"
    )
    parser.add_argument(
        "--ragged",
        metavar="LOW:HIGH",
        help="decode attention over contexts drawn in LOW..HIGH, drawn order and longest first",
    )
    parser.add_argument(
        "--prompts", nargs="+", default=["16x512", "1x8192", "1x32768"], help="BATCHxLENGTH"
    )
    args = parser.parse_args(argv)
    kv_dtype = DTYPE if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn
    if not torch.cuda.is_available():
        parser.error("needs CUDA")

    rates = measure_rates(torch.device("cuda"))
    torch.cuda.empty_cache()
    if args.moe:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        weights = args.quantization or "bf16"
        run_moe(args.moe, args.moe_tokens, weights, rates, time_ms, args.moe_sweep)
        return
    if args.overlap:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        run_overlap(args.overlap, args.overlap_batch, args.overlap_context, time_ms)
        return
    if args.l2_prefetch:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        run_l2_prefetch(args.l2_prefetch, args.l2_prefetch_tp, args.l2_prefetch_context, time_ms)
        return
    if args.sampler:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        run_sampler(args.batches, rates.bytes_per_s, time_ms)
        return
    if args.fp8_products:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        run_fp8_products(args.fp8_products, args.rows, time_ms)
        return
    if args.prefill:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}")
        run_prefill(args, rates.flops_per_s)
        return
    if args.ragged:
        print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}; K/V in {kv_dtype}")
        run_ragged(args, rates.bytes_per_s, kv_dtype)
        return
    print(f"{torch.cuda.get_device_name()}: measured {rates.describe()}; K/V in {kv_dtype}")
    print(
        f"\n{'head_dim':>8} {'heads':>6} {'context':>8} {'batch':>6} {'splits':>6} "
        f"{'us':>9} {'GB/s':>7} {'of copy':>8} {'copy us':>8} {'of same':>8} {'warps':>6}"
    )
    shares = []
    for head_dim in args.head_dims:
        heads = tuple(map(int, args.heads.split(":"))) if args.heads else HEADS[head_dim]
        num_heads, num_kv_heads = heads
        for context, batch, warps in itertools.product(
            args.contexts, args.batches, args.decode_warps or [None]
        ):
            cache_bytes = 2 * batch * context * num_kv_heads * head_dim * kv_dtype.itemsize
            if cache_bytes > args.max_gib * 1024**3:
                continue
            check = batch * context <= 64 * 1024  # the float32 reference loops in Python
            splits, ms, share = decode_case(
                head_dim,
                heads,
                [context] * batch,
                rates.bytes_per_s,
                check,
                kv_dtype,
                args.table_tokens,
                num_warps=warps,
            )
            # A copy moves each byte twice (read, write): half as many bytes to copy.
            same_ms = copy_ms(cache_bytes // 2)
            shares.append((share, head_dim, context, batch))
            print(
                f"{head_dim:8d} {f'{num_heads}/{num_kv_heads}':>6} {context:8d} {batch:6d} "
                f"{splits:6d} {ms * 1e3:9.1f} {share * rates.bytes_per_s / 1e9:7.0f} "
                f"{share:8.0%} {same_ms * 1e3:8.1f} {same_ms / ms:8.0%} {warps or 'rule':>6}"
            )
            torch.cuda.empty_cache()
    print("\nfused Q/K norms + RoPE + cache write, Qwen3 0.6B's heads:")
    for num_tokens in (256, 8192):
        ms, share = rotary_case(num_tokens, rates.bytes_per_s)
        print(f"  {num_tokens:5d} tokens: {ms * 1e3:7.1f} us, {share:.0%} of copy bandwidth")
    worst = min(shares)
    below = [s for s in shares if s[0] < args.target]
    print(
        f"\ndecode attention: worst {worst[0]:.0%} of copy bandwidth (head_dim {worst[1]}, "
        f"context {worst[2]}, batch {worst[3]}); {len(below)} of {len(shares)} cases below "
        f"{args.target:.0%}"
    )


if __name__ == "__main__":
    main()
