"""The Triton kernels against the PyTorch backend's ops (attention against the loop in
tests/kernel_reference.py), and the two attention backends against each other.

Runs natively on CUDA (bfloat16) and, without it, in Triton's interpreter on CPU (float32;
tests/conftest.py selects the interpreter). Shapes are small so the interpreter stays fast.
Outputs and unused cache slots start as NaN, so an element a kernel fails to write, or
garbage it reads, shows up as a mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from engine.attention import AttentionMetadata, LayerKVCache
from engine.backends.pytorch import TorchLayerOps, TorchPagedAttention
from engine.backends.pytorch import store_kv as store_kv_reference
from engine.backends.triton import (
    add_rms_norm,
    apply_rope_,
    decode_num_splits,
    decode_workspace,
    paged_decode_attention,
    paged_prefill_attention,
    silu_and_mul,
    store_kv,
)
from engine.backends.triton.backend import TritonPagedAttention
from tests.kernel_reference import paged_attention_reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
# bf16 outputs are one rounding (2^-8 relative) off a float32 reference.
ATTENTION_TOL = {"atol": 2e-2, "rtol": 2e-2} if CUDA else {"atol": 1e-4, "rtol": 1e-4}
REFERENCE_OPS = TorchLayerOps()
BLOCK_SIZE = 16
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
    q: torch.Tensor, batch: PagedBatch, sliding_window: int | None
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
    )


# (num_heads, num_kv_heads, head_dim): GQA groups of 1, 4 and 8, an odd group and head_dim
# (padded inside the kernels), and Gemma 3 1B's four heads of 256 on one KV head.
HEAD_SHAPES = [(4, 4, 64), (8, 2, 128), (16, 2, 64), (6, 2, 80), (4, 1, 256)]


@pytest.mark.parametrize(
    ("heads", "num_splits", "sliding_window"),
    [
        (HEAD_SHAPES[0], 1, None),
        (HEAD_SHAPES[1], 3, None),
        (HEAD_SHAPES[2], 4, 40),
        (HEAD_SHAPES[3], 2, None),
        (HEAD_SHAPES[4], 2, 100),
    ],
)
def test_decode_attention(
    heads: tuple[int, int, int], num_splits: int, sliding_window: int | None
) -> None:
    num_heads, num_kv_heads, head_dim = heads
    lens = DECODE_CONTEXT_LENS
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
    torch.testing.assert_close(out, attention_reference(q, batch, sliding_window), **ATTENTION_TOL)


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
    torch.testing.assert_close(out, attention_reference(q, batch, sliding_window), **ATTENTION_TOL)


@pytest.mark.parametrize(("decode", "sliding_window"), [(True, None), (False, None), (False, 20)])
def test_triton_backend_matches_torch_backend(decode: bool, sliding_window: int | None) -> None:
    """TritonPagedAttention.forward == TorchPagedAttention.forward on one step, cache writes
    included: a pure decode step (the decode kernel) or a mixed one (the prefill kernel)."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    if decode:
        context_lens, query_lens = [5, 16, 17, 200], [1, 1, 1, 1]
    else:
        context_lens, query_lens = (list(x) for x in zip(*PREFILL_SEQUENCES, strict=True))
    # Zero-filled like the engine's cache: the backend reads whole blocks.
    batch = paged_batch(context_lens, query_lens, num_kv_heads, head_dim, fill=0.0)
    m = batch.metadata
    num_tokens = sum(query_lens)
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    expected_cache = LayerKVCache(batch.key_cache.clone(), batch.value_cache.clone())
    reference = TorchPagedAttention()
    reference.prepare(m)
    expected = reference.forward(q, k, v, expected_cache, m, scale, sliding_window)

    cache = LayerKVCache(batch.key_cache, batch.value_cache)
    triton_backend = TritonPagedAttention()
    triton_backend.prepare(m)
    out = triton_backend.forward(q, k, v, cache, m, scale, sliding_window)
    torch.testing.assert_close(batch.key_cache, expected_cache.key, atol=0, rtol=0)
    torch.testing.assert_close(batch.value_cache, expected_cache.value, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **ATTENTION_TOL)


def test_decode_num_splits() -> None:
    # Few sequences with long contexts: split to fill the SMs, in parts of >= 256 keys.
    assert decode_num_splits(batch=1, num_kv_heads=8, max_context_len=8192, num_sms=132) == 32
    assert decode_num_splits(batch=2, num_kv_heads=8, max_context_len=2048, num_sms=132) == 8
    # Enough programs already, or contexts too short to split.
    assert decode_num_splits(batch=64, num_kv_heads=8, max_context_len=8192, num_sms=132) == 1
    assert decode_num_splits(batch=1, num_kv_heads=8, max_context_len=300, num_sms=132) == 1


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
    torch.testing.assert_close(out, attention_reference(q, batch, None), **ATTENTION_TOL)


def test_store_kv() -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 7, 2, 64, 3
    # k and v as strided views of one fused projection, as the model produces them.
    kv = randn(num_tokens, 2 * num_kv_heads * head_dim)
    k, v = (t.view(num_tokens, num_kv_heads, head_dim) for t in kv.chunk(2, dim=-1))
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slot_mapping[3] = -1  # a padding token
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=DTYPE, device=DEVICE) for _ in range(4)]

    store_kv(k, v, caches[0], caches[1], slot_mapping)
    store_kv_reference(k, v, caches[2], caches[3], slot_mapping)
    # Exact, and the slots nobody wrote are still NaN in both.
    torch.testing.assert_close(caches[0], caches[2], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0, equal_nan=True)
    assert caches[0].flatten(0, 1).isnan().all(-1).all(-1).sum() == num_blocks * BLOCK_SIZE - 6


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(with_residual: bool) -> None:
    num_rows, hidden = 5, 1000  # not a power of two: the row is masked
    x, weight = randn(num_rows, hidden), randn(hidden)
    residual = randn(num_rows, hidden) if with_residual else None
    if residual is None:  # the first layer: x starts the residual stream
        expected_out, expected_residual = REFERENCE_OPS.rms_norm(x, weight, 1e-5), x
    else:
        expected_out, expected_residual = REFERENCE_OPS.add_rms_norm(x, residual, weight, 1e-5)

    out = torch.full_like(x, float("nan"))
    # In place on the residual stream, as a decoder layer would run it.
    got_out, got_residual = add_rms_norm(x, residual, weight, 1e-5, out=out, residual_out=residual)
    assert got_out is out
    assert got_residual is (residual if with_residual else x)
    torch.testing.assert_close(got_out, expected_out)
    torch.testing.assert_close(got_residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (6, 2, 80)])
def test_rope(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    num_tokens, max_positions = 9, 50
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq).repeat(1, 2).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE)
    # q and k rotated in place inside the fused QKV output; v must not move.
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    before = qkv.clone()
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    # The kernel computes in float32 and rounds once: so does the reference, given float32.
    expected_q, expected_k = (
        t.to(DTYPE) for t in REFERENCE_OPS.rope(q.float(), k.float(), positions, cos, sin)
    )

    apply_rope_(q, k, positions, cos, sin)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    torch.testing.assert_close(v, before[:, -num_kv_heads * head_dim :], atol=0, rtol=0)


def test_silu_and_mul() -> None:
    num_rows, intermediate = 3, 1500  # two column blocks, the second partial
    # Rows of a wider buffer: the kernel follows the row stride.
    x = randn(num_rows, 2 * intermediate + 8)[:, : 2 * intermediate]
    out = torch.full((num_rows, intermediate), float("nan"), dtype=DTYPE, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    # In float32, rounded once, as the kernel computes.
    torch.testing.assert_close(out, REFERENCE_OPS.silu_and_mul(x.float()).to(DTYPE))
