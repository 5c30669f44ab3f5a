"""Decode attention over a float8 (e4m3) KV cache, written in Gluon (Triton's layout-explicit
dialect) for GPUs that convert e4m3 in hardware (compute capability 8.9 and up).

Why not the Triton kernel (``paged_attention.py``): an fp8 value tile feeds PV's product
across its contiguous dimension, and Hopper's tensor cores cannot take 8-bit values that
way (``fp8_widen.py``). Triton widens each V tile in registers and passes it through shared
memory a second time, which left it reading an fp8 cache far below copy bandwidth, barely
faster than bf16 at twice the bytes (docs/history/benchmarks-lab-notebook.md;
``scripts/bench_kernels.py --kv-cache-dtype fp8`` prints the share this module's kernel
reaches). Here the layouts are ours to choose:

- One warp a program (kv head, sequence, split); K and V tiles of ``_BLOCK_N`` keys come in by
  ``cp.async`` into swizzled shared memory, ``_STAGES`` tiles in flight.
- QK on the tensor cores in float16: K is loaded straight into the MMA operand's registers
  and widened by the hardware conversion (exact: every e4m3 value is a float16).
- PV in float16 with V's bytes transposed in registers: a thread reads one 32-bit word (4
  columns) of an even and of an odd key, and one ``prmt`` pairs their bytes column by column,
  which the conversion widens into exactly the (key, key + 1) pairs the MMA operand holds. The
  MMA's columns are thereby V's columns permuted (output column ``i * D/4 + w`` is V's
  ``4w + i``); the output is written back through the inverse.
- Scores, softmax and the accumulator stay in float32, as in the Triton kernel; P enters PV
  in float16 (the Triton kernel: bfloat16).

It writes the output, or a split's unnormalized output with its max and sum for
``_decode_merge_kernel`` (a second launch: the Triton decode kernel merges its own splits,
its last program of each KV head's), for one query token a sequence, head
dims 64 and 128 and up to 16 query heads a KV head; anything else takes the Triton kernel.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

# Gluon's API moves between Triton releases; the GPU machines run 3.6, CI's CPUs 3.9.
_thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
if hasattr(async_copy, "async_load"):  # the name since Triton 3.7
    from triton.experimental.gluon.language.nvidia.ampere.async_copy import (
        async_load as _copy_to_shared,
    )
else:
    from triton.experimental.gluon.language.nvidia.ampere.async_copy import (
        async_copy_global_to_shared as _copy_to_shared,
    )

# Keys a tile, by the tile's width (KV heads a program x head_dim): 8 KB of K and V either way.
_BLOCK_N = {64: 64, 128: 32}
_STAGES = 3  # tiles in flight
_MAX_GROUP = 16  # the MMA's rows: a program's query heads
FP8_DECODE_NUM_WARPS = 1
# decode_num_splits' parameters for this kernel: split until about this many one-warp
# programs run on each SM (counted a KV head each), in parts of at least two tiles. Of 6-16
# programs an SM, the count near the best in most cases over head_dim 64 and 128, batches
# 1-256 and contexts 512-4096: ``scripts/bench_kernels.py --kv-cache-dtype fp8 --head-dims
# 64 128`` measures it (change the constant to compare another).
FP8_DECODE_PROGRAMS_PER_SM = 8
FP8_DECODE_MIN_SPLIT_TOKENS = 64  # two tiles of 32 keys, one of 64
_NO_SCORE = gl.constexpr(-1.0e30)

# Word $8 (an even key's 4 codes, columns c0..c3) and word $9 (the odd key's) -> for each
# column, (even, odd) as two float16: prmt interleaves the bytes, cvt widens pairs.
_PAIR_COLUMNS_ASM = gl.constexpr("""
{
.reg .b32 t0, t1, h0, h1, h2, h3;
.reg .b16 a0, a1, a2, a3;
prmt.b32 t0, $8, $9, 0x5140;
prmt.b32 t1, $8, $9, 0x7362;
mov.b32 {a0, a1}, t0;
mov.b32 {a2, a3}, t1;
cvt.rn.f16x2.e4m3x2 h0, a0;
cvt.rn.f16x2.e4m3x2 h1, a1;
cvt.rn.f16x2.e4m3x2 h2, a2;
cvt.rn.f16x2.e4m3x2 h3, a3;
mov.b32 {$0, $1}, h0;
mov.b32 {$2, $3}, h1;
mov.b32 {$4, $5}, h2;
mov.b32 {$6, $7}, h3;
}
""")


@gluon.constexpr_function
def _copy_layout(head_dim):
    """A [keys, head_dim] byte tile as cp.async moves it: 16 bytes a thread."""
    chunks = head_dim // 16
    return gl.BlockedLayout([1, 16], [32 // chunks, chunks], [1, 1], [1, 0])


@gluon.constexpr_function
def _tile_layout(head_dim, vec):
    """Shared memory of a tile: 16-byte chunks swizzled by key, so that the MMA operand's
    loads (K: 8 keys at once; V: 4 key pairs) hit distinct banks."""
    return gl.SwizzledSharedLayout(vec, 1, min(head_dim // 16, 8), [1, 0])


@gluon.constexpr_function
def _value_words_layout(block_n, words):
    """V's tile as [keys, 4-byte words]: lane 4g + t holds keys 2t and 2t + 1 (then +8,
    +16, ...) of word columns g (+8, +16, ...), the key's parity in the first register: what
    PV's B operand (k_width 2) needs, once each word pair is split by column."""
    registers = [[1, 0]]
    registers += [[1 << bit, 0] for bit in range(3, block_n.bit_length() - 1)]
    registers += [[0, 1 << bit] for bit in range(3, words.bit_length() - 1)]
    lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
    return gl.DistributedLinearLayout(registers, lanes, [], [], [block_n, words])


@gluon.jit
def _tile_blocks(
    block_table_ptr,
    tile_start,
    key_end,
    TILE_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
):
    """The cache block of each key of the tile at tile_start (0 past key_end)."""
    copy: gl.constexpr = _copy_layout(TILE_D)
    keys = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy))
    return gl.load(block_table_ptr + keys // BLOCK_SIZE, mask=keys < key_end, other=0)


@gluon.jit
def _load_tile(
    key_buffer,
    value_buffer,
    key_cache_ptr,
    value_cache_ptr,
    blocks,
    kv_head,
    tile_start,
    key_end,
    stride_cache_slot,
    stride_cache_head,
    TILE_D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
):
    """Start copying keys [tile_start, tile_start + BLOCK_N), in cache ``blocks``
    (``_tile_blocks``), into the buffers; keys at or past key_end are filled with zeros."""
    copy: gl.constexpr = _copy_layout(TILE_D)
    keys = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy))
    dims = gl.arange(0, TILE_D, layout=gl.SliceLayout(0, copy))
    key_mask = keys < key_end
    slots = blocks * BLOCK_SIZE + keys % BLOCK_SIZE
    offsets = slots[:, None] * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
    _copy_to_shared(key_buffer, key_cache_ptr + offsets, mask=key_mask[:, None])
    _copy_to_shared(value_buffer, value_cache_ptr + offsets, mask=key_mask[:, None])


@gluon.jit
def _value_operand(
    value_buffer, BLOCK_N: gl.constexpr, TILE_D: gl.constexpr, OPERAND: gl.constexpr
):
    """A V tile as PV's B operand in float16, its columns permuted (module docstring)."""
    words: gl.constexpr = TILE_D // 4
    word_layout: gl.constexpr = _tile_layout(TILE_D, 4)
    if _PUBLIC_REINTERPRET:
        tile = value_buffer.reinterpret(gl.int32, [BLOCK_N, words], word_layout)
    else:
        tile = value_buffer._reinterpret(gl.int32, [BLOCK_N, words], word_layout)
    tile = tile.load(_value_words_layout(BLOCK_N, words))
    even, odd = gl.split(gl.permute(gl.reshape(tile, [BLOCK_N // 2, 2, words]), (0, 2, 1)))
    e0, o0, e1, o1, e2, o2, e3, o3 = gl.inline_asm_elementwise(
        _PAIR_COLUMNS_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [even, odd],
        dtype=(gl.float16,) * 8,
        is_pure=True,
        pack=1,
    )
    # [key pair, word, parity, column bit 0, column bit 1] -> [key, column i * words + word]
    pairs = gl.join(
        gl.join(gl.join(e0, o0), gl.join(e1, o1)), gl.join(gl.join(e2, o2), gl.join(e3, o3))
    )
    pairs = gl.permute(pairs, (0, 2, 4, 3, 1))
    return gl.convert_layout(gl.reshape(pairs, [BLOCK_N, TILE_D]), OPERAND)


@gluon.jit(
    do_not_specialize=["stride_table", "stride_ws_seq", "stride_ws_head"],
    do_not_specialize_on_alignment=[
        "block_tables_ptr",
        "context_lens_ptr",
        "stride_table",
        "stride_ws_seq",
        "stride_ws_head",
    ],
)
def _fp8_decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    workspace_ptr,
    window,
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_table,
    stride_cache_slot,
    stride_cache_head,
    stride_out_seq,
    stride_out_head,
    stride_ws_seq,
    stride_ws_head,
    stride_ws_split,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    HEADS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    STAGES: gl.constexpr,
    USE_WINDOW: gl.constexpr,
    WRITE_PARTIAL: gl.constexpr,
):
    """Program (HEADS KV heads, sequence, split): their query heads (rows of a 16-row tile)
    over its part of the context, as ``_decode_kernel`` with one query token. With HEADS 2
    (``_kv_heads_per_program``) the caches come as [.., KV heads / 2, 2 * HEAD_DIM]: a query
    row holds its head's dims in its own half of the tile and zeros in the other, so QK sees
    only its head's keys, and each row keeps the half of PV that is its head's values."""
    kv_head = gl.program_id(0)  # of HEADS KV heads
    seq = gl.program_id(1)
    split = gl.program_id(2)
    num_splits = gl.num_programs(2)

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
    )
    # QK reads 4 head dims a register (one 32-bit load of codes), PV 2 keys a register.
    q_operand: gl.constexpr = gl.DotOperandLayout(0, mma, 4)
    k_operand: gl.constexpr = gl.DotOperandLayout(1, mma, 4)
    p_operand: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    v_operand: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    column_layout: gl.constexpr = gl.SliceLayout(0, mma)

    context_len = gl.load(context_lens_ptr + seq).to(gl.int32)
    first_key = 0
    if USE_WINDOW:
        first_key = gl.maximum(context_len - window, 0)
    # Every sequence divides its own (windowed) context evenly, in whole tiles.
    split_len = gl.cdiv(gl.cdiv(context_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    key_start = first_key + split * split_len
    key_end = gl.minimum(key_start + split_len, context_len)
    num_tiles = gl.cdiv(gl.maximum(key_end - key_start, 0), BLOCK_N)

    TILE_D: gl.constexpr = HEADS * HEAD_DIM
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    q_rows = gl.arange(0, 16, layout=gl.SliceLayout(1, q_layout))
    q_columns = gl.arange(0, TILE_D, layout=gl.SliceLayout(0, q_layout))
    q_heads = kv_head * HEADS * GROUP + q_rows
    q_dims = q_columns[None, :] - (q_rows // GROUP * HEAD_DIM)[:, None]  # its head's half
    q = gl.load(
        q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + q_dims,
        mask=(q_rows < HEADS * GROUP)[:, None] & (q_dims >= 0) & (q_dims < HEAD_DIM),
        other=0.0,
    )
    q = gl.convert_layout(q.to(gl.float16), q_operand)

    tile_layout: gl.constexpr = _tile_layout(TILE_D, 16)
    key_tiles = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, TILE_D], tile_layout)
    value_tiles = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, TILE_D], tile_layout)
    block_table_ptr = block_tables_ptr + seq * stride_table
    for first in gl.static_range(STAGES - 1):
        tile_start = key_start + first * BLOCK_N
        _load_tile(
            key_tiles.index(first),
            value_tiles.index(first),
            key_cache_ptr,
            value_cache_ptr,
            _tile_blocks(block_table_ptr, tile_start, key_end, TILE_D, BLOCK_N, BLOCK_SIZE),
            kv_head,
            tile_start,
            key_end,
            stride_cache_slot,
            stride_cache_head,
            TILE_D,
            BLOCK_N,
            BLOCK_SIZE,
        )
        async_copy.commit_group()

    acc = gl.zeros([16, TILE_D], gl.float32, layout=mma)
    row_max = gl.full([16], _NO_SCORE, gl.float32, layout=row_layout)
    row_sum = gl.zeros([16], gl.float32, layout=row_layout)
    # A program is one warp working through its keys a tile at a time, so its time is the
    # chain of each tile's latencies: the block numbers a copy needs are read a tile early.
    ahead_start = key_start + (STAGES - 1) * BLOCK_N
    blocks = _tile_blocks(block_table_ptr, ahead_start, key_end, TILE_D, BLOCK_N, BLOCK_SIZE)
    for tile in range(num_tiles):
        ahead = tile + STAGES - 1  # its buffer was read in the previous iteration
        _load_tile(
            key_tiles.index(ahead % STAGES),
            value_tiles.index(ahead % STAGES),
            key_cache_ptr,
            value_cache_ptr,
            blocks,
            kv_head,
            ahead_start,
            key_end,
            stride_cache_slot,
            stride_cache_head,
            TILE_D,
            BLOCK_N,
            BLOCK_SIZE,
        )
        async_copy.commit_group()
        ahead_start += BLOCK_N
        blocks = _tile_blocks(block_table_ptr, ahead_start, key_end, TILE_D, BLOCK_N, BLOCK_SIZE)
        async_copy.wait_group(STAGES - 1)  # this tile's copies (each thread's own) are done
        _thread_barrier()  # and every thread's
        stage = tile % STAGES
        k = key_tiles.index(stage).permute((1, 0)).load(k_operand).to(gl.float16)
        scores = mma_v2(q, k, gl.zeros([16, BLOCK_N], gl.float32, layout=mma)) * scale_log2
        keys = key_start + tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=column_layout)
        scores = gl.where((keys < key_end)[None, :], scores, float("-inf"))
        new_max = gl.maximum(row_max, gl.max(scores, 1))
        rescale = gl.exp2(row_max - new_max)
        p = gl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + gl.sum(p, 1)
        v = _value_operand(value_tiles.index(stage), BLOCK_N, TILE_D, v_operand)
        p = gl.convert_layout(p.to(gl.float16), p_operand)
        acc = mma_v2(p, v, acc * rescale[:, None])
        row_max = new_max
        _thread_barrier()  # before the next iteration's copy overwrites a buffer
    async_copy.wait_group(0)

    rows = gl.arange(0, 16, layout=row_layout)
    columns = gl.arange(0, TILE_D, layout=column_layout)
    words: gl.constexpr = TILE_D // 4
    # The MMA's column -> the tile's (V's permutation) -> the dim of the row's own head.
    tile_columns = 4 * (columns % words) + columns // words
    dims = tile_columns[None, :] - (rows // GROUP * HEAD_DIM)[:, None]
    heads = kv_head * HEADS * GROUP + rows
    valid = rows < HEADS * GROUP
    mask = valid[:, None] & (dims >= 0) & (dims < HEAD_DIM)
    if WRITE_PARTIAL:
        # Unnormalized output, then the row's max and sum, for the merge kernel.
        row_ptr = workspace_ptr + seq * stride_ws_seq + heads * stride_ws_head
        row_ptr += split * stride_ws_split
        gl.store(row_ptr[:, None] + dims, acc, mask=mask)
        gl.store(row_ptr + HEAD_DIM, row_max, mask=valid)
        gl.store(row_ptr + HEAD_DIM + 1, row_sum, mask=valid)
    else:
        out = acc / row_sum[:, None]
        gl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@functools.cache
def _converts_fp8(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def uses_fp8_decode_kernel(q: torch.Tensor, key_cache: torch.Tensor, query_len: int) -> bool:
    """Whether ``paged_decode_attention`` takes this kernel for these arguments."""
    if q.device.type != "cuda" or key_cache.dtype != torch.float8_e4m3fn or query_len != 1:
        return False
    index = torch.cuda.current_device() if q.device.index is None else q.device.index
    group = q.shape[1] // key_cache.shape[2]
    return _converts_fp8(index) and q.shape[-1] in _BLOCK_N and group <= _MAX_GROUP


def _kv_heads_per_program(head_dim: int, num_kv_heads: int, group: int) -> int:
    """Two KV heads a program at head_dim 64, where their query heads fit the tile's 16 rows:
    adjacent in the cache, their keys are one 128-byte read instead of two of 64 bytes. Over
    64-byte rows this kernel stays well below copy bandwidth whatever its tiles, stages,
    splits or swizzle, and comes near it over 128-byte ones
    (``scripts/bench_kernels.py --kv-cache-dtype fp8 --head-dims 64 128`` prints the share)."""
    pair = head_dim * 2 in _BLOCK_N and num_kv_heads % 2 == 0 and 2 * group <= _MAX_GROUP
    return 2 if pair else 1


def fp8_decode_constants(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int, num_splits: int
) -> dict[str, int | bool]:
    """The kernel's compile-time arguments for a step of this shape (also for
    ``scripts/kernel_resources.py --gluon``, which compiles it without a GPU)."""
    group = num_heads // num_kv_heads
    heads = _kv_heads_per_program(head_dim, num_kv_heads, group)
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEADS": heads,
        "BLOCK_N": _BLOCK_N[heads * head_dim],
        "BLOCK_SIZE": block_size,
        "STAGES": _STAGES,
        "USE_WINDOW": window > 0,
        "WRITE_PARTIAL": num_splits > 1,
    }


def fp8_paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    out: torch.Tensor,
    workspace: torch.Tensor,
    ws_strides: tuple[int, int, int],
    num_splits: int,
) -> None:
    """Launch the kernel as ``paged_decode_attention`` launches ``_decode_kernel``: into
    ``out``, or with more than one split into ``workspace`` for the merge kernel."""
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    constants = fp8_decode_constants(
        num_heads, num_kv_heads, head_dim, block_size, window, num_splits
    )
    heads = constants["HEADS"]
    shape = (num_blocks, block_size, num_kv_heads // heads, heads * head_dim)
    key_cache, value_cache = key_cache.view(shape), value_cache.view(shape)
    _fp8_decode_kernel[(num_kv_heads // heads, block_tables.shape[0], num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        workspace,
        window,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        out.stride(0),
        out.stride(1),
        *ws_strides,
        **constants,
        num_warps=FP8_DECODE_NUM_WARPS,
    )
