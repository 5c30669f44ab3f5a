"""The Triton kernels against the PyTorch backend's ops (attention against the loop in
tandem/testing/kernel_reference.py), and the two attention backends against each other.

Runs natively on CUDA (bfloat16) and, without it, in Triton's interpreter on CPU (float32;
tests/conftest.py selects the interpreter). Shapes are small so the interpreter stays fast.
Outputs and unused cache slots start as NaN, so an element a kernel fails to write, or
garbage it reads, shows up as a mismatch.

Every kernel is held to a float32 reference computed from the same inputs, within a few
units of its dtype's own rounding error (``assert_rounding_close``): a bf16 kernel must be
about as close as rounding that reference to bf16 is, not within a flat 2e-2.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from engine.backends.attention import AttentionMetadata, LayerKVCache, Rotary
from engine.backends.deferred_norm import DeferredNorm
from engine.backends.penalties import Penalties, penalized
from engine.backends.pytorch import TorchLayerOps, TorchPagedAttention, apply_rotary, with_bias
from engine.backends.pytorch import store_kv as store_kv_reference
from engine.backends.sampling_draw import Cuts, race_sample
from engine.backends.triton import (
    add_rms_norm,
    decode_num_splits,
    decode_workspace,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    rotary_store_kv,
    silu_and_mul,
)
from engine.backends.triton.argmax import argmax_rows, sample_rows
from engine.backends.triton.backend import TritonLayerOps, TritonPagedAttention
from engine.backends.triton.fp8_decode import (
    FP8_DECODE_MIN_SPLIT_TOKENS,
    FP8_DECODE_PROGRAMS_PER_SM,
    uses_fp8_decode_kernel,
)
from engine.backends.triton.fp8_widen import widen, widen_factor
from engine.backends.triton.nucleus import draw_tokens, sample_within_cuts
from engine.backends.triton.one_row_matmul import one_row_matmul
from engine.backends.triton.paged_attention import (
    decode_split_counts,
    merge_splits,
    merge_tile,
    merge_tiles,
)
from engine.backends.triton.penalties import apply_penalties
from engine.execution.batch import pad_verify
from engine.quantization.linear_methods import quantize_per_channel
from tandem.testing.kernel_reference import paged_attention_reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
REFERENCE_OPS = TorchLayerOps()
TRITON_OPS = TritonLayerOps()


# The unit of error: DTYPE's epsilon. In float32, where rounding the reference to DTYPE is
# nil, the kernels' order of summation (and exp2 for exp) sets the scale: a few epsilons.
EPS = torch.finfo(DTYPE).eps * (8 if DTYPE is torch.float32 else 1)
BLOCK_SIZE = 16


def assert_rounding_close(out: torch.Tensor, reference: torch.Tensor, units: float = 2.0) -> None:
    """``out`` (in DTYPE) is within ``units`` of DTYPE's rounding error of the float32
    ``reference``: overall, ||out - reference|| <= units * ||round(reference) - reference||
    (the error the rounding to DTYPE alone makes, at least EPS * ||reference||), and
    elementwise, no element off by more than units * 4 EPS of the largest one. NaN
    anywhere fails."""
    assert out.dtype == DTYPE and reference.dtype == torch.float32
    assert not out.isnan().any(), "NaN in the output"
    out = out.float()
    rounding = (reference.to(DTYPE).float() - reference).norm().item()
    rounding = max(rounding, EPS * reference.norm().item())
    error = (out - reference).norm().item()
    assert error <= units * rounding, f"error {error:.3g} > {units} x rounding {rounding:.3g}"
    worst = (out - reference).abs().max().item()
    bound = units * 4 * EPS * reference.abs().max().item()
    assert worst <= bound, f"an element is off by {worst:.3g} > {bound:.3g}"


# Lengths around block boundaries (BLOCK_SIZE multiples and +-1), a lone token and one
# long enough to span several attention tiles and decode splits.
DECODE_CONTEXT_LENS = [1, 15, 16, 17, 33, 63, 64, 65, 300]
# (context_len, query_len): full prefills at odd lengths and across block ends, prefills
# after a cached prefix, and decodes (query_len 1) in the same batch.
PREFILL_SEQUENCES = [(17, 17), (40, 8), (16, 16), (33, 1), (70, 70), (48, 31), (129, 1)]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(DTYPE)


@dataclass
class PagedBatch:
    """A batch laid out in a paged cache the way the model runner lays it out."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata


def paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    fill: float,
) -> PagedBatch:
    """Caches filled with ``fill``, except every sequence's context, which is random.

    Each sequence gets shuffled physical blocks, never block 0 (the block tables' padding),
    so reading a padding entry or a slot past a context reads ``fill``.
    """
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    physical = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int64)
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = torch.tensor(physical[:count])
        physical = physical[count:]
    block_tables = block_tables.to(DEVICE)

    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.full(shape, fill, dtype=DTYPE, device=DEVICE)
    value_cache = torch.full(shape, fill, dtype=DTYPE, device=DEVICE)
    seq_index = torch.repeat_interleave(torch.arange(len(context_lens)), torch.tensor(context_lens))
    positions = torch.cat([torch.arange(n) for n in context_lens]).to(DEVICE)
    context_slots = slots(block_tables, seq_index.to(DEVICE), positions)
    key_cache.flatten(0, 1)[context_slots] = randn(len(positions), num_kv_heads, head_dim)
    value_cache.flatten(0, 1)[context_slots] = randn(len(positions), num_kv_heads, head_dim)

    new_positions = torch.cat(
        [torch.arange(c - q, c) for c, q in zip(context_lens, query_lens, strict=True)]
    )
    new_seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    new_positions, new_seq_index = new_positions.to(DEVICE), new_seq_index.to(DEVICE)
    query_lens_t = torch.tensor(query_lens, device=DEVICE)
    metadata = AttentionMetadata(
        positions=new_positions,
        slot_mapping=slots(block_tables, new_seq_index, new_positions),
        token_seq_index=new_seq_index,
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, device=DEVICE),
        query_lens=query_lens_t,
        query_starts=torch.cumsum(query_lens_t, 0) - query_lens_t,
        max_query_len=max(query_lens),
    )
    return PagedBatch(key_cache, value_cache, metadata)


def slots(
    block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    blocks = block_tables[seq_index, positions // BLOCK_SIZE]
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


def attention_reference(
    q: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    m = batch.metadata
    return paged_attention_reference(
        q,
        batch.key_cache,
        batch.value_cache,
        m.block_tables,
        m.context_lens,
        m.query_lens,
        q.shape[-1] ** -0.5,
        sliding_window,
        sinks,
    )


# (num_heads, num_kv_heads, head_dim): GQA groups of 1, 4 and 8, an odd group and head_dim
# (padded inside the kernels), and Gemma 3 1B's four heads of 256 on one KV head.
HEAD_SHAPES = [(4, 4, 64), (8, 2, 128), (16, 2, 64), (6, 2, 80), (4, 1, 256)]


@pytest.mark.parametrize(
    ("heads", "num_splits", "sliding_window", "lens"),
    [
        (HEAD_SHAPES[0], 1, None, DECODE_CONTEXT_LENS),
        (HEAD_SHAPES[1], 3, None, DECODE_CONTEXT_LENS),
        (HEAD_SHAPES[2], 4, 40, DECODE_CONTEXT_LENS),
        (HEAD_SHAPES[3], 2, None, DECODE_CONTEXT_LENS),
        (HEAD_SHAPES[4], 2, 100, DECODE_CONTEXT_LENS),
        # more splits than the merge reads at once; most empty
        ((2, 1, 64), 70, None, DECODE_CONTEXT_LENS),
        # long contexts cut into parts of at least about sqrt(tiles / 8) tiles (64 keys a
        # tile: 700 keys in 6 parts of 2, 2,100 in 11 of 3, 3,000 in 16 of 3), the other
        # splits empty, and the merge weighs only those that hold keys
        ((4, 1, 64), 40, None, [700, 2100, 3000]),
    ],
)
def test_decode_attention(
    heads: tuple[int, int, int], num_splits: int, sliding_window: int | None, lens: list[int]
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    batch = paged_batch(lens, [1] * len(lens), num_kv_heads, head_dim, fill=float("nan"))
    q = randn(len(lens), num_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q,
        batch.key_cache,
        batch.value_cache,
        batch.metadata.block_tables,
        batch.metadata.context_lens,
        head_dim**-0.5,
        sliding_window=sliding_window,
        num_splits=num_splits,
        out=out,
    )
    assert_rounding_close(out, attention_reference(q, batch, sliding_window))


@pytest.mark.parametrize("num_warps", [None, 2, 4, 8], ids=["rule", "2", "4", "8"])
def test_one_sequence_split_decode_in_any_warps(num_warps: int | None) -> None:
    """One sequence's split decode at head_dim 128 (a batch-1 step: eight warps by the rule)
    and the warps a benchmark asks for: the last program merges as many splits a round as
    its warps hold (one to four here, over 700 keys in 6 splits), each right."""
    num_heads, num_kv_heads, head_dim = 8, 2, 128
    batch = paged_batch([700], [1], num_kv_heads, head_dim, fill=float("nan"))
    m = batch.metadata
    q = randn(1, num_heads, head_dim)
    out = paged_decode_attention(
        *(q, batch.key_cache, batch.value_cache, m.block_tables, m.context_lens),
        head_dim**-0.5,
        num_splits=6,
        out=torch.full_like(q, float("nan")),
        num_warps=num_warps,
    )
    assert_rounding_close(out, attention_reference(q, batch, None))


def test_split_decode_resets_its_counts() -> None:
    """Split decode's last program of each (KV head, sequence) merges the group's splits and
    sets its count back to zero: launched twice on the same counts, each launch's output is
    whole (it starts as NaN) and right, and the counts are zero after. Sequences of one
    split's keys and of every split's, and windowed: the merge reads only the splits that
    hold keys."""
    num_heads, num_kv_heads, head_dim, num_splits, window = 8, 2, 32, 3, 100
    lens = [1, 70, 300]
    batch = paged_batch(lens, [1] * len(lens), num_kv_heads, head_dim, fill=float("nan"))
    m = batch.metadata
    for _ in range(2):
        q = randn(len(lens), num_heads, head_dim)
        out = paged_decode_attention(
            *(q, batch.key_cache, batch.value_cache, m.block_tables, m.context_lens),
            head_dim**-0.5,
            sliding_window=window,
            num_splits=num_splits,
            out=torch.full_like(q, float("nan")),
        )
        assert_rounding_close(out, attention_reference(q, batch, window))
    assert not decode_split_counts(DEVICE, len(lens) * num_kv_heads).any()


@pytest.mark.parametrize("decode", [True, False])
def test_attention_refuses_int32_block_tables(decode: bool) -> None:
    """A key's cache offset is computed in the block table's dtype: int32 overflows past 2**31
    elements of a layer's cache (an illegal address on a GPU), so the kernels take int64 only
    and say so, instead of reading a wrong slot once the cache is large."""
    batch = paged_batch([20, 5], [1, 1], 2, 32, fill=0.0)
    m = batch.metadata
    q = randn(2, 4, 32)
    tables = m.block_tables.to(torch.int32)
    with pytest.raises(AssertionError, match="int64"):
        if decode:
            paged_decode_attention(
                q, batch.key_cache, batch.value_cache, tables, m.context_lens, 32**-0.5
            )
        else:
            paged_prefill_attention(
                *(q, batch.key_cache, batch.value_cache, tables, m.context_lens),
                *(m.query_lens, m.query_starts, m.max_query_len, 32**-0.5),
            )


@pytest.mark.parametrize("splits", [70, 5, 2])
def test_decode_merge_rescales_across_chunks(splits: int) -> None:
    """The merge kernel (after the fp8 kernel's splits, and a verify step's) reads up to 64
    splits at a time and rescales what it has summed to each chunk's larger max, several rows
    a program where the splits are few: partial results with the largest maxima in the last
    splits and some splits empty (max _NO_SCORE, sum 0, weighing nothing), against their
    softmax-weighted sum in float32. 9 x 7 rows (four a program at 2 and 5 splits, at least
    eight programs on the interpreter's one SM) fill no program's rows evenly, and the output
    is a view whose tokens lie further apart than its heads."""
    tokens, heads, head_dim = 9, 7, 64
    workspace = torch.randn(tokens, heads, splits, head_dim + 2, device=DEVICE)
    maxima = torch.randn(tokens, heads, splits, device=DEVICE) * 4
    maxima[..., splits - splits // 8 - 1 :] += 16
    sums = torch.rand(tokens, heads, splits, device=DEVICE) + 0.5
    empty = slice(splits // 7, splits // 7 + max(splits // 7, 1))
    maxima[..., empty], sums[..., empty] = -1.0e30, 0.0
    workspace[..., head_dim], workspace[..., head_dim + 1] = maxima, sums
    wide = torch.full((tokens, heads + 2, head_dim), float("nan"), dtype=DTYPE, device=DEVICE)
    out = wide[:, :heads]

    merge_splits(workspace, out)
    weights = torch.exp2(maxima - maxima.amax(-1, keepdim=True))
    expected = (workspace[..., :head_dim] * weights[..., None]).sum(2)
    assert_rounding_close(out, expected / (sums * weights).sum(-1)[..., None])
    assert wide[:, heads:].isnan().all()  # nothing written past each token's heads


@pytest.mark.parametrize(
    ("fp8_kernel", "query_len", "heads"),
    [(False, 17, (4, 1)), (False, 9, (32, 8)), (True, 1, (16, 8)), (True, 1, (32, 4))],
    ids=["verify-k16-gemma3-1b", "verify-k8-8b", "fp8-qwen3-0.6b", "fp8-qwen3-30b-a3b"],
)
def test_merge_tiles_hold_every_eager_step_s_tile(
    fp8_kernel: bool, query_len: int, heads: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up compiles the merge kernel for each tile ``merge_tiles`` names (an eager
    verify step of gemma3-1b once compiled one after start-up): each step's tile, from the
    split count ``paged_decode_attention`` takes for its batch and block tables' width (the
    fp8 kernel's rule or the Triton kernel's) on 132 SMs and its rows, is among them."""
    num_heads, num_kv_heads = heads
    max_batch, max_context_len, head_dim = 256, 4096, 128
    monkeypatch.setattr(paged_attention, "sm_count", lambda device: 132)
    monkeypatch.setattr(paged_attention, "uses_fp8_decode_kernel", lambda *args: fp8_kernel)
    tiles = merge_tiles(
        num_heads, num_kv_heads, query_len, max_batch, max_context_len, 132, fp8_kernel
    )
    key_cache = torch.empty(1, BLOCK_SIZE, num_kv_heads, head_dim)
    seen = set()
    for batch in [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 256]:
        q = torch.empty(batch * query_len, num_heads, head_dim)
        for width in range(1, max_context_len // BLOCK_SIZE + 1, 7):
            tables = torch.empty(batch, width, dtype=torch.int64)
            splits = paged_attention.default_decode_splits(q, key_cache, tables, query_len)
            if splits > 1:
                seen.add(merge_tile(splits, batch * query_len * num_heads, 132))
    assert seen <= tiles
    assert len(seen) > 3  # many tiles, not one


# (context_len, real query tokens): a verify step's sequences, each its last token and up to
# four drafts, padded to five query tokens at the front; one context shorter than five.
VERIFY_SEQUENCES = [(3, 2), (17, 5), (64, 1), (65, 3), (300, 5)]
VERIFY_QUERY_LEN = 5


@pytest.mark.parametrize(
    ("heads", "num_splits", "sliding_window", "sequences"),
    [
        (HEAD_SHAPES[0], 1, None, VERIFY_SEQUENCES),
        (HEAD_SHAPES[1], 3, None, VERIFY_SEQUENCES),
        (HEAD_SHAPES[2], 4, 40, VERIFY_SEQUENCES),
        (HEAD_SHAPES[3], 1, 5, VERIFY_SEQUENCES),
        (HEAD_SHAPES[4], 37, None, VERIFY_SEQUENCES),
        # groups of 3 and 6 heads, their tokens' rows back to back (unpadded): 15 rows merged
        # by the decode kernel's last program, 30 by the merge kernel
        (HEAD_SHAPES[3], 3, None, VERIFY_SEQUENCES),
        ((12, 2, 64), 4, None, VERIFY_SEQUENCES),
        # long contexts in parts of at least about sqrt(tiles / 8) tiles, windowed: the merge
        # kernel reads every split, the empty ones weighing nothing
        (HEAD_SHAPES[0], 40, 900, [(700, 5), (2100, 5), (3000, 3)]),
    ],
)
def test_decode_attention_of_several_queries(
    heads: tuple[int, int, int],
    num_splits: int,
    sliding_window: int | None,
    sequences: list[tuple[int, int]],
) -> None:
    """The decode kernel with a verify step's padded queries: each sequence's real queries
    (its last positions) attend causally as the prefill reference does; the padding queries
    in front of them are finite and ignored."""
    num_heads, num_kv_heads, head_dim = heads
    context_lens, query_lens = (list(x) for x in zip(*sequences, strict=True))
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=float("nan"))
    width = VERIFY_QUERY_LEN
    real = torch.cat(
        [torch.arange(b * width + width - n, (b + 1) * width) for b, n in enumerate(query_lens)]
    ).to(DEVICE)
    q = randn(len(context_lens) * width, num_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    m = batch.metadata
    paged_decode_attention(
        q,
        batch.key_cache,
        batch.value_cache,
        m.block_tables,
        m.context_lens,
        head_dim**-0.5,
        query_len=width,
        sliding_window=sliding_window,
        num_splits=num_splits,
        out=out,
    )
    assert not out.isnan().any()
    assert_rounding_close(out[real], attention_reference(q[real], batch, sliding_window))


@pytest.mark.parametrize(
    ("heads", "sliding_window"),
    [
        (HEAD_SHAPES[0], None),
        (HEAD_SHAPES[1], None),
        (HEAD_SHAPES[2], 24),
        (HEAD_SHAPES[3], 5),
        (HEAD_SHAPES[4], 24),
    ],
)
def test_prefill_attention(heads: tuple[int, int, int], sliding_window: int | None) -> None:
    num_heads, num_kv_heads, head_dim = heads
    context_lens, query_lens = (list(x) for x in zip(*PREFILL_SEQUENCES, strict=True))
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=float("nan"))
    q = randn(sum(query_lens), num_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    m = batch.metadata
    paged_prefill_attention(
        q,
        batch.key_cache,
        batch.value_cache,
        m.block_tables,
        m.context_lens,
        m.query_lens,
        m.query_starts,
        m.max_query_len,
        head_dim**-0.5,
        sliding_window=sliding_window,
        out=out,
    )
    assert_rounding_close(out, attention_reference(q, batch, sliding_window))


@pytest.mark.parametrize(
    ("kernel", "num_splits"),
    [("decode", 1), ("decode", 3), ("verify", 3), ("prefill", None)],
)
def test_attention_sinks(kernel: str, num_splits: int | None) -> None:
    """gpt-oss's sinks, a logit a head in the softmax's denominator: whole in one decode
    program, in the merge of split ones (once, not once a split: by the decode kernel's last
    program, or for a verify step's taller tile by the merge kernel), and in prefill, as the
    reference's extra column. Sinks from far below the scores (no effect) to far above
    (most of the weight, the output near zero), at small shapes for the interpreter."""
    num_heads, num_kv_heads, head_dim, window = 4, 2, 32, 24
    sinks = torch.tensor([-30.0, -1.0, 2.0, 8.0], device=DEVICE)
    if kernel == "decode":
        context_lens, query_lens = [1, 17, 70], [1, 1, 1]
    elif kernel == "verify":  # 9 tokens of 2 heads: a tile of 32 rows, past the kernel's merge
        context_lens, query_lens = [9, 17, 70], [9, 9, 9]
    else:
        context_lens, query_lens = [17, 40, 33], [17, 8, 1]
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=float("nan"))
    q = randn(sum(query_lens), num_heads, head_dim)
    m = batch.metadata
    common = dict(sliding_window=window, out=torch.full_like(q, float("nan")), sinks=sinks)
    if kernel in ("decode", "verify"):
        out = paged_decode_attention(
            q,
            batch.key_cache,
            batch.value_cache,
            m.block_tables,
            m.context_lens,
            head_dim**-0.5,
            query_len=query_lens[0],
            num_splits=num_splits,
            **common,
        )
    else:
        out = paged_prefill_attention(
            q,
            batch.key_cache,
            batch.value_cache,
            m.block_tables,
            m.context_lens,
            m.query_lens,
            m.query_starts,
            m.max_query_len,
            head_dim**-0.5,
            **common,
        )
    reference = attention_reference(q, batch, window, sinks)
    assert_rounding_close(out, reference)
    # The sinks bite: without them the output is another.
    assert not torch.allclose(out.float(), attention_reference(q, batch, window), atol=1e-2)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("decode", [True, False])
def test_attention_reads_an_fp8_cache(decode: bool) -> None:
    """With --kv-cache-dtype fp8 the kernels read float8 K/V as q's dtype: held to the
    float32 reference over the same float8 values, as closely as over a q-dtype cache."""
    num_heads, num_kv_heads, head_dim = 8, 2, 128
    if decode:
        context_lens, query_lens = DECODE_CONTEXT_LENS, [1] * len(DECODE_CONTEXT_LENS)
    else:
        context_lens, query_lens = (list(x) for x in zip(*PREFILL_SEQUENCES, strict=True))
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=float("nan"))
    batch.key_cache, batch.value_cache = batch.key_cache.to(FP8), batch.value_cache.to(FP8)
    m = batch.metadata
    q = randn(sum(query_lens), num_heads, head_dim)
    args = (q, batch.key_cache, batch.value_cache, m.block_tables, m.context_lens)
    if decode:
        out = paged_decode_attention(*args, head_dim**-0.5, num_splits=3)
    else:
        out = paged_prefill_attention(
            *args, m.query_lens, m.query_starts, m.max_query_len, head_dim**-0.5
        )
    assert_rounding_close(out, attention_reference(q, batch, None))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "num_splits", "sliding_window"),
    [(16, 8, 128, 1, None), (16, 4, 64, 3, None), (32, 4, 64, 1, 40), (7, 1, 64, 2, 40)],
    # At head_dim 64 two KV heads share a program where their query heads fit 16 rows.
    ids=["qwen3-heads", "two-kv-heads-a-program", "sixteen-rows-window", "odd-group-window"],
)
def test_fp8_decode_kernel(
    num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int, sliding_window: int | None
) -> None:
    """One query a sequence over an fp8 cache: on GPUs that convert e4m3 (compute capability
    8.9 and up) the Gluon kernel (fp8_decode.py; elsewhere the Triton kernel), held to the
    float32 reference at tile edges (32 and 64 keys), with and without splits and a window."""
    lens = DECODE_CONTEXT_LENS
    batch = paged_batch(lens, [1] * len(lens), num_kv_heads, head_dim, fill=float("nan"))
    batch.key_cache, batch.value_cache = batch.key_cache.to(FP8), batch.value_cache.to(FP8)
    q = randn(len(lens), num_heads, head_dim)
    expected_kernel = CUDA and torch.cuda.get_device_capability() >= (8, 9)
    assert uses_fp8_decode_kernel(q, batch.key_cache, query_len=1) == expected_kernel
    m = batch.metadata
    out = paged_decode_attention(
        *(q, batch.key_cache, batch.value_cache, m.block_tables, m.context_lens),
        head_dim**-0.5,
        sliding_window=sliding_window,
        num_splits=num_splits,
    )
    assert_rounding_close(out, attention_reference(q, batch, sliding_window))


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, BLOCK: tl.constexpr) -> None:  # noqa: ANN001 (pointers)
    offsets = tl.arange(0, BLOCK)
    codes = tl.load(codes_ptr + offsets)
    values = widen(codes, out_ptr.dtype.element_ty)
    factor = widen_factor(codes_ptr.dtype.element_ty, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, (values.to(tl.float32) * factor).to(out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_widening_is_exact(dtype: torch.dtype) -> None:
    """Every e4m3 code but NaN, subnormals and both zeros included, widens to its own value
    (on CUDA by placing bits, or to float32 by the hardware's conversion, ``fp8_widen``; the
    interpreter converts)."""
    bits = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    bits[[0x7F, 0xFF]] = 0x3F  # the two NaN codes: 1.875 instead (256, a power of two)
    codes = bits.view(FP8)
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    _widen_kernel[(1,)](codes, out, BLOCK=256)
    expected = codes.float().to(dtype)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.skipif(
    not CUDA, reason="Triton's CPU interpreter rounds to float8 wrongly (-7.84 to -4.0)"
)
def test_rotary_store_into_an_fp8_cache() -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 64
    rotary = make_rotary(head_dim, norms=True, max_positions=50)
    positions = torch.randint(0, 50, (num_tokens,), device=DEVICE)
    q, k, v = (
        randn(num_tokens, num_heads, head_dim),
        *(randn(num_tokens, num_kv_heads, head_dim) for _ in range(2)),
    )
    slot_mapping = torch.randperm(2 * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    shape = (2, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache, value_cache = (torch.zeros(shape, dtype=FP8, device=DEVICE) for _ in range(2))
    _, expected_k = apply_rotary(q.float(), k.float(), positions, float32_rotary(rotary))
    rotary_store_kv(q, k, v, key_cache, value_cache, slot_mapping, positions, rotary)
    stored_k = key_cache.flatten(0, 1)[slot_mapping].float()
    # float8 e4m3 keeps 3 bits of mantissa: within one of its roundings (2^-4 relative).
    torch.testing.assert_close(stored_k, expected_k, rtol=2**-3, atol=2**-6)
    expected_v = v.to(FP8).float()
    torch.testing.assert_close(value_cache.flatten(0, 1)[slot_mapping].float(), expected_v)


def make_rotary(
    head_dim: int, norms: bool, max_positions: int = 512, norm_offset: float | None = None
) -> Rotary:
    """RoPE tables as the model builds them and, with ``norms``, random per-head norm
    weights (in DTYPE), so that a kernel ignoring them shows; with ``norm_offset``, Gemma's
    (weights about 0, scaling by norm_offset + weight)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq).repeat(1, 2).to(DEVICE)
    if not norms:
        return Rotary(angles.cos(), angles.sin())
    weights = ((norm_offset is None) + 0.5 * torch.randn(2, head_dim, device=DEVICE)).to(DTYPE)
    return Rotary(
        angles.cos(), angles.sin(), weights[0], weights[1], eps=1e-6, norm_offset=norm_offset
    )


def float32_rotary(rotary: Rotary) -> Rotary:
    """The same Rotary for a float32 reference."""
    if rotary.q_norm is None or rotary.k_norm is None:
        return rotary
    return Rotary(
        rotary.cos,
        rotary.sin,
        rotary.q_norm.float(),
        rotary.k_norm.float(),
        rotary.eps,
        rotary.norm_offset,
    )


# The per-head norm rounds twice before RoPE rounds (as Llama's RMSNorm does, on purpose):
# three roundings of the float32 reference's one.
ROTARY_UNITS = 3.0


# Decodes at the front of a mixed step, as the scheduler orders them: (context_len, 1).
LEADING_DECODES = [(5, 1), (17, 1), (200, 1)]


@pytest.mark.parametrize(
    ("step", "sliding_window", "norms"),
    [
        ("decode", None, True),
        ("prefill", None, False),
        ("prefill", 20, True),
        ("decodes-then-prefill", None, True),
        ("decodes-then-prefill", 20, False),
    ],
)
def test_triton_backend_matches_torch_backend(
    step: str, sliding_window: int | None, norms: bool
) -> None:
    """TritonPagedAttention.forward against TorchPagedAttention.forward in float32 on one
    step, the Q/K norms, RoPE and cache writes included: a pure decode step (the decode
    kernel), a step of prompts' chunks (the prefill kernel), or decodes in front of them
    (the decode kernel for those, ``num_leading_decodes``; the prefill kernel for the rest,
    a one-token chunk among them)."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    if step == "decode":
        context_lens, query_lens = [5, 16, 17, 200], [1, 1, 1, 1]
    else:
        leading = LEADING_DECODES if step == "decodes-then-prefill" else []
        sequences = leading + PREFILL_SEQUENCES
        context_lens, query_lens = (list(x) for x in zip(*sequences, strict=True))
    # Zero-filled like the engine's cache: the backend reads whole blocks.
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=0.0)
    m = batch.metadata
    if step == "decodes-then-prefill":
        m.num_leading_decodes = len(LEADING_DECODES)
    num_tokens = sum(query_lens)
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    rotary = make_rotary(head_dim, norms)
    real = torch.arange(num_tokens, device=DEVICE)
    assert_backends_agree(batch, m, (q, k, v), real, sliding_window, rotary)


def assert_backends_agree(
    batch: PagedBatch,
    metadata: AttentionMetadata,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    real: torch.Tensor,
    sliding_window: int | None,
    rotary: Rotary,
) -> None:
    """TritonPagedAttention over ``metadata`` against TorchPagedAttention in float32 over
    ``batch``'s own (packed) metadata, whose tokens are ``qkv``'s rows ``real``: the outputs
    at those rows and the caches agree."""
    q, k, v = qkv
    scale = q.shape[-1] ** -0.5
    # Copies, also where DTYPE is float32 (on the CPU): the reference writes into them.
    expected_cache = LayerKVCache(
        batch.key_cache.to(torch.float32, copy=True),
        batch.value_cache.to(torch.float32, copy=True),
    )
    reference = TorchPagedAttention()
    reference.prepare(batch.metadata)
    expected = reference.forward(
        q[real].float(),
        k[real].float(),
        v[real].float(),
        expected_cache,
        batch.metadata,
        scale,
        sliding_window,
        rotary=float32_rotary(rotary),
    )
    cache = LayerKVCache(batch.key_cache, batch.value_cache)
    triton_backend = TritonPagedAttention()
    triton_backend.prepare(metadata)
    out = triton_backend.forward(q, k, v, cache, metadata, scale, sliding_window, rotary=rotary)
    assert not out.isnan().any()
    assert_rounding_close(batch.key_cache, expected_cache.key, ROTARY_UNITS)
    torch.testing.assert_close(batch.value_cache, expected_cache.value.to(DTYPE), atol=0, rtol=0)
    assert_rounding_close(out[real], expected, ROTARY_UNITS)


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_triton_backend_verify_step_in_the_uniform_layout(sliding_window: int | None) -> None:
    """A verify step padded to VERIFY_QUERY_LEN tokens a sequence
    (engine.execution.batch.pad_verify), through TritonPagedAttention (the decode kernel of several
    queries), against the torch backend on the same step packed: the real tokens' outputs and the
    cache agree, so the padding writes nothing and changes nothing."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    context_lens, query_lens = (list(x) for x in zip(*VERIFY_SEQUENCES, strict=True))
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=0.0)
    m = batch.metadata
    width = VERIFY_QUERY_LEN
    index, _, slot_mapping, positions = pad_verify(
        width,
        m.context_lens.cpu().numpy(),
        m.query_lens.cpu().numpy(),
        m.query_starts.cpu().numpy(),
        np.zeros(sum(query_lens), np.int64),
        m.slot_mapping.cpu().numpy(),
    )
    seqs = len(context_lens)
    uniform = AttentionMetadata(
        positions=torch.from_numpy(positions).to(DEVICE),
        slot_mapping=torch.from_numpy(slot_mapping).to(DEVICE),
        token_seq_index=torch.arange(seqs * width, device=DEVICE) // width,
        block_tables=m.block_tables,
        context_lens=m.context_lens,
        query_lens=torch.full((seqs,), width, device=DEVICE),
        query_starts=torch.arange(seqs, device=DEVICE) * width,
        max_query_len=width,
        uniform_queries=True,
    )
    q = randn(seqs * width, num_heads, head_dim)
    k, v = randn(seqs * width, num_kv_heads, head_dim), randn(seqs * width, num_kv_heads, head_dim)
    rotary = make_rotary(head_dim, norms=True)
    real = torch.from_numpy(index).to(DEVICE)
    assert_backends_agree(batch, uniform, (q, k, v), real, sliding_window, rotary)


def test_decode_num_splits() -> None:
    # Few sequences with long contexts: split to fill the SMs, in parts of >= 128 keys.
    assert decode_num_splits(batch=1, num_kv_heads=8, max_context_len=16384, num_sms=132) == 66
    assert decode_num_splits(batch=1, num_kv_heads=8, max_context_len=8192, num_sms=132) == 64
    assert decode_num_splits(batch=2, num_kv_heads=8, max_context_len=2048, num_sms=132) == 16
    # One KV head (Gemma 3 1B): as many splits as 128-key parts allow, up to 4 per SM.
    assert decode_num_splits(batch=1, num_kv_heads=1, max_context_len=16384, num_sms=132) == 128
    # Enough programs already, or contexts too short to split.
    assert decode_num_splits(batch=64, num_kv_heads=8, max_context_len=8192, num_sms=132) == 1
    assert decode_num_splits(batch=1, num_kv_heads=8, max_context_len=200, num_sms=132) == 1
    # fp8_decode.py's one-warp programs: 8 an SM, parts of >= 64 keys (batch 1 at 4k keys: 64
    # splits).
    fp8_rule = {
        "programs_per_sm": FP8_DECODE_PROGRAMS_PER_SM,
        "min_split_tokens": FP8_DECODE_MIN_SPLIT_TOKENS,
    }
    assert decode_num_splits(1, 8, 4096, 132, **fp8_rule) == 64
    assert decode_num_splits(64, 8, 4096, 132, **fp8_rule) == 2
    assert decode_num_splits(256, 8, 4096, 132, **fp8_rule) == 1


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_decode_attention_cuda_graph() -> None:
    """Captured once with static buffers, replayed on new queries and longer contexts."""
    num_heads, num_kv_heads, head_dim, num_splits = 8, 2, 128, 4
    lens = [40, 100, 7]
    batch = paged_batch([n + 20 for n in lens], [1] * len(lens), num_kv_heads, head_dim, 0.0)
    context_lens = torch.tensor(lens, device=DEVICE)
    q = randn(len(lens), num_heads, head_dim)
    out = torch.empty_like(q)
    workspace = decode_workspace(len(lens), num_heads, head_dim, num_splits, DEVICE)

    def run() -> None:
        args = (batch.key_cache, batch.value_cache, batch.metadata.block_tables, context_lens)
        paged_decode_attention(
            q, *args, head_dim**-0.5, num_splits=num_splits, out=out, workspace=workspace
        )

    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(randn(*q.shape))
    context_lens.copy_(batch.metadata.context_lens)
    graph.replay()
    assert_rounding_close(out, attention_reference(q, batch, None))


def test_store_kv_without_rotary() -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 7, 2, 64, 3
    # q, k and v as strided views of one fused projection, as the model produces them.
    qkv = randn(num_tokens, 3 * num_kv_heads * head_dim)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([128, 128, 128], dim=-1))
    before = qkv.clone()
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slot_mapping[3] = -1  # a padding token
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(4)]

    rotary_store_kv(q, k, v, caches[0], caches[1], slot_mapping)
    store_kv_reference(k, v, caches[2], caches[3], slot_mapping)
    # Exact, and the slots nobody wrote are still NaN in both.
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0, equal_nan=True)
    assert caches[0].flatten(0, 1).isnan().all(-1).all(-1).sum() == num_blocks * BLOCK_SIZE - 6
    torch.testing.assert_close(qkv, before, atol=0, rtol=0)  # q, k and v untouched


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "norms", "norm_offset"),
    [
        (4, 2, 64, False, None),
        (4, 2, 64, True, None),
        (6, 2, 80, True, None),
        (16, 8, 128, True, None),
        (4, 1, 64, True, 1.0),  # Gemma's
    ],
)
def test_rotary_store(
    num_heads: int, num_kv_heads: int, head_dim: int, norms: bool, norm_offset: float | None
) -> None:
    """Q/K norms, RoPE and the cache write in one kernel, against the torch backend's norms
    and RoPE in float32 and its cache write."""
    num_tokens, num_blocks, max_positions = 9, 2, 50
    rotary = make_rotary(head_dim, norms, max_positions, norm_offset)
    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE)
    # q rotated in place inside the fused QKV output; k and v must not move.
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    before = qkv.clone()
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slot_mapping[2] = -1  # a padding token: q rotated all the same, nothing stored
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache, value_cache = (
        torch.full(shape, float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(2)
    )
    expected_q, expected_k = apply_rotary(q.float(), k.float(), positions, float32_rotary(rotary))
    expected_keys = torch.full(shape, float("nan"), device=DEVICE)
    expected_values = torch.full(shape, float("nan"), dtype=DTYPE, device=DEVICE)
    store_kv_reference(expected_k, v.float(), expected_keys, expected_values.float(), slot_mapping)
    store_kv_reference(k, v, expected_values.clone(), expected_values, slot_mapping)

    rotary_store_kv(q, k, v, key_cache, value_cache, slot_mapping, positions, rotary)
    assert_rounding_close(q, expected_q, ROTARY_UNITS)
    torch.testing.assert_close(
        qkv[:, num_heads * head_dim :], before[:, num_heads * head_dim :], atol=0, rtol=0
    )
    stored = slot_mapping >= 0
    flat_keys, flat_expected = key_cache.flatten(0, 1), expected_keys.flatten(0, 1)
    assert_rounding_close(
        flat_keys[slot_mapping[stored]], flat_expected[slot_mapping[stored]], ROTARY_UNITS
    )
    assert flat_keys.isnan().all(-1).all(-1).sum() == num_blocks * BLOCK_SIZE - (num_tokens - 1)
    torch.testing.assert_close(value_cache, expected_values, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(with_residual: bool) -> None:
    num_rows, hidden = 5, 1000  # not a power of two: the row is masked
    x, weight = randn(num_rows, hidden), randn(hidden)
    residual = randn(num_rows, hidden) if with_residual else None
    if residual is None:  # the first layer: x starts the residual stream
        expected_out, expected_residual = REFERENCE_OPS.rms_norm(x.float(), weight.float(), 1e-5), x
    else:
        # The sum rounds to DTYPE before the norm, as the residual stream does.
        expected_residual = x + residual
        expected_out = REFERENCE_OPS.rms_norm(expected_residual.float(), weight.float(), 1e-5)

    out = torch.full_like(x, float("nan"))
    # In place on the residual stream, as a decoder layer would run it.
    got_out, got_residual = add_rms_norm(x, residual, weight, 1e-5, out=out, residual_out=residual)
    assert got_out is out
    assert got_residual is (residual if with_residual else x)
    # Normalized, rounded, times the weight, rounded: two roundings (Llama's RMSNorm).
    assert_rounding_close(got_out, expected_out, units=2.5)
    torch.testing.assert_close(got_residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize("heads", [0, 4], ids=["rows", "heads"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["olmo2", "gemma"])
def test_rms_norm_round_once(heads: int, weight_offset: float) -> None:
    """Whole rows (OLMo 2's and Gemma's layer norms) or each head of a view of wider rows
    (their Q/K norms, of the QKV projection's output), times weight_offset + weight in
    float32: one rounding, within the reference's."""
    hidden = 4 * 72 if heads else 1000  # not powers of two: masked
    wide = randn(5, hidden + 3 * 72)  # the rows' stride is not the norm's width
    x = wide[:, :hidden].view(5, heads, 72) if heads else wide[:, :hidden]
    weight = randn(x.shape[-1]) * 0.1
    expected = REFERENCE_OPS.rms_norm_round_once(x.float(), weight, 1e-6, weight_offset)
    out = TritonLayerOps().rms_norm_round_once(x, weight, 1e-6, weight_offset)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_rounding_close(out, expected, units=1.5)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["olmo2", "gemma"])
def test_add_rms_norm_round_once(weight_offset: float) -> None:
    """The residual added first (in the stream's dtype), in place on the stream, then the
    round-once norm (a Gemma layer's input and pre-MLP norms)."""
    x, residual, weight = randn(5, 1000), randn(5, 1000), randn(1000) * 0.1
    stream = x + residual
    expected = REFERENCE_OPS.rms_norm_round_once(stream.float(), weight, 1e-6, weight_offset)
    out, got_stream = TritonLayerOps().add_rms_norm_round_once(
        x, residual, weight, 1e-6, weight_offset
    )
    assert got_stream is residual
    torch.testing.assert_close(got_stream, stream, atol=0, rtol=0)
    assert_rounding_close(out, expected, units=1.5)


def test_add_rms_norm_round_once_of_a_normed_output() -> None:
    """Gemma's sandwich: a sublayer's output normalized by its own norm and rounded, added
    to the stream, and the stream normalized by the next norm, in one kernel."""
    x, residual = randn(5, 1000) * 8, randn(5, 1000)  # the output's scale not the stream's
    output_weight, weight = randn(1000) * 0.1, randn(1000) * 0.1
    normed_output = REFERENCE_OPS.rms_norm_round_once(x.float(), output_weight, 1e-6, 1.0)
    stream = normed_output.to(DTYPE) + residual
    expected = REFERENCE_OPS.rms_norm_round_once(stream.float(), weight, 1e-6, 1.0)
    out, got_stream = TritonLayerOps().add_rms_norm_round_once(
        x, residual.clone(), weight, 1e-6, 1.0, output_weight
    )
    assert_rounding_close(got_stream, (normed_output + residual.float()), units=1.5)
    assert_rounding_close(out, expected, units=1.5)


def test_silu_and_mul() -> None:
    num_rows, intermediate = 3, 1500  # two column blocks, the second partial
    # Rows of a wider buffer: the kernel follows the row stride.
    x = randn(num_rows, 2 * intermediate + 8)[:, : 2 * intermediate]
    out = torch.full((num_rows, intermediate), float("nan"), dtype=DTYPE, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    assert_rounding_close(out, REFERENCE_OPS.silu_and_mul(x.float()))


def test_gelu_tanh_and_mul() -> None:
    """Gemma's gated activation, in float32 and rounded once, against PyTorch's GELU."""
    x = randn(3, 2 * 1500 + 8)[:, : 2 * 1500]  # two column blocks; rows of a wider buffer
    out = TritonLayerOps().gelu_tanh_and_mul(x)
    assert out.shape == (3, 1500) and out.dtype == x.dtype
    assert_rounding_close(out, REFERENCE_OPS.gelu_tanh_and_mul(x.float()))


@pytest.mark.parametrize("gated", [False, True])
def test_one_row_matmul(gated: bool) -> None:
    # Sizes off every tile: the last block of channels and the last chunk of K are partial.
    channels, depth = 37, 300
    x = randn(1, 2 * depth if gated else depth)
    weight = randn(channels, depth)
    got = one_row_matmul(x, weight, gated=gated)
    assert got.shape == (1, channels) and got.dtype == DTYPE
    # The gated input is silu(gate) * up rounded to DTYPE, as silu_and_mul stores it.
    inputs = silu_and_mul(x) if gated else x
    assert_rounding_close(got, inputs.float() @ weight.float().T)


@pytest.mark.parametrize("weights", ["model dtype", "gated", "fp8 codes"])
def test_one_row_matmul_adds_the_stream_in_its_epilogue(weights: str) -> None:
    # A layer's o and down projections joining the residual stream: the product stored, then
    # the stream added in DTYPE, bit for bit as ``stream + product`` computes it.
    channels, depth = 37, 300
    gated = weights == "gated"
    x = randn(1, 2 * depth if gated else depth)
    weight, scale = randn(channels, depth), None
    if weights == "fp8 codes":
        weight, scale = quantize_per_channel(weight, FP8)
    stream = randn(1, channels)
    product = one_row_matmul(x, weight, scale, gated=gated)
    got = one_row_matmul(x, weight, scale, gated=gated, add=stream)
    assert torch.equal(got, stream + product)
    assert not torch.equal(got, product)


@pytest.mark.parametrize("weights", ["model dtype", "fp8 codes"])
def test_one_row_matmul_adds_its_bias_as_it_stores(weights: str) -> None:
    # gpt-oss's o projection and router at batch 1: the bias added in the epilogue, bit for
    # bit as ``with_bias`` adds it to the stored product (and the stream after, if joined).
    channels, depth = 37, 300
    x = randn(1, depth)
    weight, scale = randn(channels, depth), None
    if weights == "fp8 codes":
        weight, scale = quantize_per_channel(weight, FP8)
    bias, stream = randn(channels), randn(1, channels)
    product = one_row_matmul(x, weight, scale)
    got = one_row_matmul(x, weight, scale, bias=bias)
    assert torch.equal(got, with_bias(product.clone(), bias))
    assert not torch.equal(got, product)
    joined = one_row_matmul(x, weight, scale, bias=bias, add=stream)
    assert torch.equal(joined, stream + with_bias(product.clone(), bias))


@pytest.mark.parametrize("rows", [1, 4])
def test_linear_float32_is_not_rounded_to_the_inputs_dtype(rows: int) -> None:
    # The LM head's logits: bf16 inputs, the product accumulated and stored in float32 (one
    # row by the one-row kernel, more by cuBLAS's float32 epilogue), not rounded to bf16.
    if rows > 1 and not CUDA:
        pytest.skip("on the CPU a bf16 product is rounded first (CPU models run float32)")
    x = torch.randn(rows, 300, device=DEVICE).to(torch.bfloat16)
    weight = (4.0 * torch.randn(37, 300, device=DEVICE)).to(torch.bfloat16)
    if CUDA:
        got = TRITON_OPS.linear_float32(x, weight)
    else:
        got = one_row_matmul(x, weight, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    expected = x.double() @ weight.double().T
    # Values about 70: bf16 would be off by up to 0.25; float32 sums by about 1e-4.
    torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_one_row_matmul_computes_a_deferred_norm(with_residual: bool) -> None:
    # rms_norm(x + residual) * norm_weight, then the product: the norm's kernel folded into
    # the one-row kernel; the first program writes the stream x + residual, in DTYPE.
    channels, depth, eps = 37, 300, 1e-5
    x = randn(1, depth)
    residual = randn(1, depth) if with_residual else None
    norm_weight = (1.0 + 0.5 * torch.randn(depth, device=DEVICE)).to(DTYPE)
    weight = randn(channels, depth)
    deferred = DeferredNorm(x, residual, norm_weight, eps, TRITON_OPS)
    got = one_row_matmul(deferred, weight)
    stream = x if residual is None else x + residual
    assert torch.equal(deferred.stream, stream)
    normalized = REFERENCE_OPS.rms_norm(stream.float(), norm_weight.float(), eps)
    assert_rounding_close(got, normalized @ weight.float().T)
    # The norm's own kernel, for a reader that cannot fold it, writes the same stream.
    unfolded = DeferredNorm(x, residual, norm_weight, eps, TRITON_OPS)
    assert_rounding_close(unfolded.normalized(), normalized)
    assert torch.equal(unfolded.stream, stream)


def test_argmax_rows() -> None:
    # Three chunks of 4096, the last partial; rows whose best is in each, a tie across
    # chunks (the first wins, as torch's), and a row of -inf (token 0, as torch's).
    logits = torch.randn(5, 9000, device=DEVICE)
    logits[0, 8999] = 10.0
    logits[1, 4096] = 10.0
    logits[2, [7, 5000]] = 10.0
    logits[3] = -float("inf")
    logits[4, :] = 0.5
    expected = logits.argmax(dim=-1)
    assert expected.tolist()[:4] == [8999, 4096, 7, 0]
    assert torch.equal(argmax_rows(logits), expected)
    assert torch.equal(argmax_rows(logits.t().contiguous().t()), expected)  # column stride
    # Launched past Triton's binding on CUDA, each variant by its key: in one process, a
    # column stride (above), another vocabulary, rows that start 4 bytes past alignment.
    for view in (logits[:, :5000], logits[:, 1:]):
        assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_sample_rows_draws_the_reference_race_tokens() -> None:
    """The kernel hashes the random numbers the reference computes as tensors: the same
    token for every row (the scores agree but for float32 rounding, and no two random rows'
    best two are that close). Greedy rows take the argmax; seeds past 32 bits and negative
    ones, steps past 32 bits, three chunks, the last partial, tokens at -inf."""
    rows = 12
    logits = torch.randn(rows, 9000, device=DEVICE) * 3
    logits[1, 4500:] = -float("inf")  # cut, as top-k or a grammar cuts
    # Columns of packed parameters, as sampling_tensors makes them: strided views.
    floats = torch.zeros(rows, 6, device=DEVICE)
    floats[:, 0] = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0] * 2)
    ints = torch.zeros(rows, 3, dtype=torch.int64, device=DEVICE)
    ints[:, 1] = torch.tensor([0, 1, -1, 2**40 + 3, 7, -(2**62), 5, 6, 2**33, 9, 10, 11])
    ints[:, 2] = torch.tensor([0, 0, 3, 1, 2**35, 9, 100, 0, 1, 2, 3, 2**32 + 1])
    temperature, seed, step = floats[:, 0], ints[:, 1], ints[:, 2]
    expected = race_sample(logits, temperature, seed, step)
    got = sample_rows(logits, temperature, seed, step)
    assert torch.equal(got, expected)
    assert got[1] < 4500
    assert torch.equal(got[temperature == 0], logits[temperature == 0].argmax(dim=-1))
    # The draws depend on the step: a row's next output index draws other tokens.
    moved = sample_rows(logits, temperature, seed, step + 1)
    assert not torch.equal(moved[temperature > 0], got[temperature > 0])
    assert torch.equal(moved, race_sample(logits, temperature, seed, step + 1))


@pytest.mark.parametrize("with_min_p", [False, True])
def test_sampling_within_cuts_draws_the_reference_tokens_without_a_sort(with_min_p: bool) -> None:
    """The sort-free kernel draws the reference's token (which sorts each row) for rows
    cut by top-p alone, top-k alone, both, min-p, and by nothing beside them, greedy rows
    too; at several output indices, so that races are rejected and run again (a token
    past top-p or top-k wins the first race of some rows). Logits of a language model's
    spread: a few likely tokens, a long tail."""
    rows = 16
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, 5000, generator=generator) * 2.5
    logits[:, :12] += 6.0  # a head of likely tokens
    logits[3, 100:] = -float("inf")  # a grammar's or a ban's cut
    logits = logits.to(DEVICE)
    floats = torch.zeros(rows, 6, device=DEVICE)  # packed, as sampling_tensors packs them
    floats[:, 0] = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.0, 1.0, 2.0, 0.9] * 2)  # temperature
    floats[:, 1] = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.9, 1.0, 0.8, 0.3] * 2)  # top-p
    floats[:, 5] = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.2, 0.0, 0.02, 0.0] * 2)  # min-p
    ints = torch.zeros(rows, 3, dtype=torch.int64, device=DEVICE)
    ints[:, 0] = torch.tensor([0, 20, 5, 0, 3, 0, 50, 1] * 2)  # top-k
    ints[:, 1] = torch.arange(rows) * 7919 - 5  # seed
    min_p = floats[:, 5] if with_min_p else None
    cuts = Cuts(floats[:, 1], ints[:, 0], min_p)
    temperature, seed = floats[:, 0], ints[:, 1]
    rejected = 0
    for output_index in range(12):
        step = ints[:, 2] + output_index
        expected = race_sample(logits, temperature, seed, step, cuts)
        got = sample_within_cuts(logits, temperature, seed, step, cuts)
        assert torch.equal(got, expected), (output_index, got, expected)
        rejected += int((race_sample(logits, temperature, seed, step) != expected).sum())
    assert rejected > 0  # some rows' uncut draws fell outside their cuts
    # No cut but min-p: nothing sorted in the reference either.
    only_min_p = Cuts(None, None, floats[:, 5])
    args = (logits, temperature, seed, ints[:, 2], only_min_p)
    assert torch.equal(sample_within_cuts(*args), race_sample(*args))


def test_the_draw_agrees_with_the_reference_over_random_cuts() -> None:
    """The Triton backend's draw (``draw_tokens``) against the reference over random rows:
    vocabularies under one chunk, at a chunk's edge and over several; tokens masked to -inf;
    temperatures from peaked to flat; top-p from 0.01, top-k from 1, min-p up to 1 (only the
    most probable token kept), each with and without the others."""
    generator = random.Random(7)
    torch.manual_seed(7)
    for _ in range(120):
        rows, vocab = generator.choice([1, 3, 7]), generator.choice([17, 4096, 4097, 9000])
        logits = torch.randn(rows, vocab) * generator.choice([0.5, 2.0, 6.0])
        if generator.random() < 0.3:
            logits[:, torch.rand(vocab) < 0.5] = -float("inf")

        def column(*values: float, rows: int = rows) -> torch.Tensor:
            return torch.tensor([generator.choice(values) for _ in range(rows)])

        temperature = column(0.0, 0.05, 0.5, 1.0, 5.0)
        top = (column(1.0, 0.01, 0.5, 0.9, 0.99), column(0, 1, 2, 20, 5000).long())
        if generator.random() < 0.2:
            top = (None, None)
        min_p = column(0.0, 0.05, 0.5, 1.0) if generator.random() < 0.5 else None
        cuts = None if top[0] is None and min_p is None else Cuts(*top, min_p)
        seed = torch.randint(-(2**40), 2**40, (rows,))
        step = torch.randint(0, 1000, (rows,))
        args = [t.to(DEVICE) for t in (logits, temperature, seed, step)]
        if cuts is not None:
            cuts = Cuts(*(None if t is None else t.to(DEVICE) for t in vars(cuts).values()))
        assert torch.equal(draw_tokens(*args, cuts), race_sample(*args, cuts))


@pytest.mark.parametrize("repetition", [False, True], ids=["frequency-presence", "repetition"])
def test_the_penalties_kernel_computes_the_reference(repetition: bool) -> None:
    """The penalties in one kernel against the reference's tensor ops: positive and negative
    logits, tokens generated never, once and often, prompt tokens never generated, rows with
    no penalty beside rows with each, a vocabulary past two of its blocks, the logits a view
    of a wider buffer, the parameters columns of the step's packed ones, and each row's
    counts and prompt in the row of a table its slot names (two rows sharing one)."""
    rows, vocab = 5, 5000
    generator = torch.Generator().manual_seed(11)
    wider = torch.randn(rows, vocab + 7, generator=generator) * 3
    logits = wider[:, :vocab]
    slots = torch.tensor([3, 0, 6, 0, 2])
    counts = torch.randint(0, 4, (7, vocab), generator=generator).float()
    counts[counts < 3] = 0  # a quarter generated
    floats = torch.zeros(rows, 6)  # packed, as sampling_tensors packs them
    floats[:, 2] = torch.tensor([0.0, 0.5, -0.3, 0.0, 1.0])  # presence
    floats[:, 3] = torch.tensor([0.0, 0.2, 0.0, -0.4, 0.7])  # frequency
    penalties = Penalties(counts, floats[:, 2], floats[:, 3], slots=slots)
    if repetition:
        floats[:, 4] = torch.tensor([1.0, 1.05, 1.3, 0.8, 2.0])
        penalties.repetition = floats[:, 4]
        penalties.prompt_tokens = torch.rand(7, vocab, generator=generator) < 0.1
    expected = penalized(logits, penalties)
    device_penalties = Penalties(
        *(t if t is None else t.to(DEVICE) for t in vars(penalties).values())
    )
    got = apply_penalties(logits.to(DEVICE), device_penalties).cpu()
    if CUDA:  # its products are fused into its differences there (one rounding, not two)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(got, expected)
    assert not torch.equal(expected, logits)  # the penalties changed something
