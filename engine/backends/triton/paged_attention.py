"""Attention over the paged KV cache: a decode kernel (split-K) and a varlen prefill kernel.

Both kernels are GQA-aware: a program owns one KV head and stacks all the query heads that
share it (times the tile's query tokens) as the rows of one tile, so every K/V tile it
gathers through the block table is loaded once per group and fed to ``tl.dot``. Softmax
is online, in float32 and base 2 (scores are pre-multiplied by log2(e)).

- ``paged_decode_attention``: a fixed number of query tokens per sequence (``query_len``),
  its last positions: one for a decode step, 1 + k for a speculative verify step (the
  sequence's last token and its k drafts, fewer drafts padded at the front), causal among
  them. The context is split into ``num_splits`` parts computed by separate programs
  (flash-decoding), so a few sequences with long contexts still fill the GPU; the last of a
  (KV head, sequence)'s split programs to finish merges their partial results, in the same
  launch (``decode_split_counts``). Its launch grid depends on the batch and the block
  tables' width alone, so CUDA graphs capture it for both kinds of step.
- ``paged_prefill_attention``: the packed new tokens of sequences of any lengths whose
  earlier tokens are already cached (chunked prefill, prefix caching), causal; decodes are
  sequences of one new token, so one launch serves a mixed step.

Attention sinks (gpt-oss: ``sinks``, a logit a query head) start each row's online softmax
as a key already seen, of score the sink and value zero (``_initial_state``): the state's
max is the sink, its sum one. Split decode keeps them out of the splits and puts them in the
merge, once.

The new tokens' K and V must be in the cache (``rotary_store_kv``) before either runs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.backends.triton.dependent_launch import (
    launch_options,
    let_next_kernel_start,
    prefetch_to_l2,
    wait_for_previous_kernel,
)
from engine.backends.triton.device import sm_count, zeroed_counters
from engine.backends.triton.fp8_decode import (
    FP8_DECODE_MIN_SPLIT_TOKENS,
    FP8_DECODE_PROGRAMS_PER_SM,
    fp8_paged_decode,
    uses_fp8_decode_kernel,
)
from engine.backends.triton.fp8_widen import widen, widen_factor

# Keys per prefill tile, and key tiles loaded ahead (Triton's software pipelining); its rows
# are ``prefill_block_m``'s.
_PREFILL_BLOCK_N = 64
PREFILL_STAGES = 3
_BLOCK_N = 64
# A decode over an fp8 cache takes twice the keys a tile: the same bytes a load, and half the
# tiles' fixed costs (its widening and V's pass through shared memory, ``fp8_widen``). At 64
# keys fp8 measured no faster than bf16, at 128 faster; bf16 is fastest at 64
# (docs/history/benchmarks-lab-notebook.md). ``scripts/bench_kernels.py --kv-cache-dtype fp8``
# measures it where this kernel takes fp8 (``fp8_decode`` takes head_dim 64 and 128 on
# compute capability 8.9 and up: ``--head-dims 256`` there).
_FP8_DECODE_BLOCK_N = 128
# tl.dot needs at least 16 rows; a decode tile has one token's group of heads.
_MIN_DOT_ROWS = 16
# Split decode until there are this many programs per SM (enough resident programs to keep
# the memory system busy), but never into parts shorter than _MIN_SPLIT_TOKENS keys (two
# tiles), whose setup and merge would cost more than they save. One sequence of a model
# with one KV head (Gemma 3 1B) at 16k keys thus still gets 128 programs.
# ``scripts/bench_kernels.py`` measures decode attention, split as a step splits it, against
# copy bandwidth over batches and contexts.
_DECODE_PROGRAMS_PER_SM = 4
# Splits a context takes per tile of each split, at most (``_least_split_tiles``): 8 tiles in
# 8 splits, 32 in 16 of 2, 128 in 32 of 4. Timed at batch 1 in a chain of one-row products
# and attentions, the 8B shape's heads whole and at TP=2, against split counts of 1 to 132:
# these were the fastest or close to it (docs/benchmarks.md, decode attention at batch 1).
_SPLITS_PER_SPLIT_TILE = tl.constexpr(8.0)
_MIN_SPLIT_TOKENS = 128
# The unit L2 fills: what one prefetch instruction pulls in.
_CACHE_LINE_BYTES = tl.constexpr(128)
MAX_DECODE_SPLITS = 256
# The merge kernel's (after the fp8 kernel's splits, and a verify step's) tile: rows times
# splits read at a time. Up to 64 splits a chunk: a batch-1 step's 66 (8 KV heads on 132 SMs)
# in two, where 16 would take five, each waiting on the one before. Fewer splits (a verify
# step's few a sequence) leave room for more rows: a program a row, the tile mostly masked,
# was a verify step's largest kernel after attention (thousands of programs, each a chain of
# latencies for a few hundred bytes).
_MERGE_TILE_SPLITS_TIMES_ROWS = 64
# Rows a merge program stop growing where fewer programs than this an SM would remain: the
# fp8 decode kernel's splits at batches of 8-128 (a handful of splits, a few hundred to a
# few thousand rows) would otherwise merge in as few programs as a quarter of the SMs. At
# a verify step's many rows (thousands, a few splits) it ties with the tile filled
# (``scripts/time_verify_steps.py``).
_MERGE_PROGRAMS_PER_SM = 8
# The split decode kernel's last program merges its group's rows together, as many splits at
# a time as keep this many values of a chunk a thread (powers of two; at least one split): at
# 8 no split variant of the models' head shapes takes more registers than the kernel took
# before the merge moved in, so the merge costs no program its place on an SM; at 16 and 32
# some take many more (``scripts/kernel_resources.py --split`` prints them). It reads one
# split a step at the group of 8 and head_dim 128: a long context's many splits are a serial
# tail of the last program (``scripts/bench_kernels.py --contexts 32768`` times it).
_MERGE_VALUES_PER_THREAD = 8
# The most rows the split decode kernel's last program merges: a decode step's group (up to
# 16 query heads a KV head), at once. A verify step's taller tile (1 + k tokens of the group)
# goes to the merge kernel, several rows a program: its last program, merging it in rounds of 16
# rows one split at a time, was a serial tail longer than the attention before it (a verify
# step's cost: ``scripts/bench_speculative.py`` prints it); merged all at once, the tall tile
# spills at head_dim 128 (``scripts/kernel_resources.py --split --query-len 17``).
_MOST_MERGE_ROWS = 16
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second and third axes
# Arguments that change from step to step in eager steps (views of the step's one packed
# input buffer, block tables of any width): Triton would otherwise compile a variant per
# alignment and divisibility it sees, mid-run. Their values need no specialization.
_STEP_ARGUMENTS = [
    "block_tables_ptr",
    "context_lens_ptr",
    "query_lens_ptr",
    "query_starts_ptr",
    "stride_table",
]
# Scores below any real one: a row whose keys are all masked keeps a finite max, so its
# rescaling factors stay exp2(0) = 1 instead of exp2(-inf - -inf) = NaN.
_NO_SCORE = tl.constexpr(-1.0e30)
_LOG2E = tl.constexpr(1.4426950408889634)  # sinks are natural logits; scores here base 2


@triton.jit
def _group_rows(
    kv_head,
    num_tokens,
    GROUP: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    first_row=0,
):
    """Tile row -> (token within the tile, query head, row holds a real query), for the
    BLOCK_M rows from ``first_row`` on, each token's group of heads TOKEN_ROWS rows apart (the
    group, or the group padded to a power of two)."""
    rows = first_row + tl.arange(0, BLOCK_M)
    token = rows // TOKEN_ROWS
    head_in_group = rows % TOKEN_ROWS
    valid = (token < num_tokens) & (head_in_group < GROUP)
    return token, kv_head * GROUP + head_in_group, valid


@triton.jit
def _initial_state(
    sinks_ptr,
    heads,
    valid,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """The online softmax's (output, max, sum) before any key: empty, or with each row's
    head's sink as a key seen, of value zero (max: the sink, base 2; sum: exp2(0) = 1)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32) * _LOG2E
        return acc, sink, tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    return acc, tl.full([BLOCK_M], _NO_SCORE, dtype=tl.float32), tl.zeros([BLOCK_M], tl.float32)


@triton.jit
def _key_rows(
    block_table_ptr,
    keys,
    key_mask,
    stride_cache_slot,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Where ``keys``' rows start in the cache (their first KV head's), through the
    sequence's block table (with MASKED, only the entries of ``key_mask``'s keys read; the
    others' rows are block 0's)."""
    if MASKED:
        blocks = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
    else:
        blocks = tl.load(block_table_ptr + keys // BLOCK_SIZE)
    return (blocks * BLOCK_SIZE + keys % BLOCK_SIZE) * stride_cache_slot


@triton.jit
def _attend_keys(
    q,
    acc,
    row_max,
    row_sum,
    query_pos,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    kv_head,
    key_start,
    masked_start,
    key_end,
    window,
    scale_log2,
    stride_cache_slot,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UNMASKED_TILES: tl.constexpr,
):
    """Fold keys [key_start, key_end) of one sequence into the online-softmax state.

    A key is seen by a row when it is at or before the row's position (and within the
    sliding window); keys are gathered through the block table one by one, so a tile may
    span cache blocks and the block size need not divide the tile. With ``UNMASKED_TILES``
    the keys before ``masked_start`` are whole tiles that every row sees all of (a prompt's
    keys before its block's first query), read and weighed without masks; without it (a
    decode kernel, compiled as one loop) ``masked_start`` must be ``key_start``.
    """
    widened = widen_factor(key_cache_ptr.dtype.element_ty, q.dtype)
    scale_log2 *= widened
    acc /= widened  # the state's output is kept in the widened V's units until the end
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # Two loops, each compiled for its tiles: the unmasked ones (with UNMASKED_TILES), then
    # the masked ones. ``masked`` is known at compile time.
    for masked in tl.static_range(0 if UNMASKED_TILES else 1, 2):
        start = masked_start if masked else key_start
        end = key_end if masked else masked_start
        for tile_start in range(start, end, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_mask = keys < key_end
            kv_mask = key_mask[:, None] & dim_mask[None, :] if masked else dim_mask[None, :]
            rows = _key_rows(block_table_ptr, keys, key_mask, stride_cache_slot, BLOCK_SIZE, masked)
            offsets = (rows + kv_head * stride_cache_head)[:, None] + dims[None, :]
            # An fp8 cache is read as q's dtype, divided by the factor (applied below).
            k = widen(tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0), q.dtype)
            v = widen(tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0), q.dtype, True)

            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            if masked:
                visible = key_mask[None, :] & (keys[None, :] <= query_pos[:, None])
                if USE_WINDOW:
                    visible &= keys[None, :] > query_pos[:, None] - window
                scores = tl.where(visible, scores, float("-inf"))

            new_max = tl.maximum(row_max, tl.max(scores, 1))
            rescale = tl.exp2(row_max - new_max)
            p = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            row_max = new_max
    return acc * widened, row_max, row_sum


@triton.jit
def _least_split_tiles(tiles):
    """The fewest tiles of a split of a context of ``tiles``: about the square root of
    tiles / _SPLITS_PER_SPLIT_TILE, so that there are that many times as many splits as each
    has tiles. A split's tiles are a serial chain of its program, its partial results one
    more step of the merge's serial chain (the last program's), so the two chains balance
    there; the split count alone (``decode_num_splits``: one for the longest context a step
    may hold) cut a long context at batch 1 into as many one-tile splits as the SMs take,
    and its merge was the longer wait. ``scripts/bench_kernels.py`` times decode attention."""
    return tl.ceil(tl.sqrt_rn(tiles.to(tl.float32) / _SPLITS_PER_SPLIT_TILE)).to(tl.int32)


@triton.jit
def _prefetch_tile(
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    kv_head,
    key_start,
    key_end,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Pull the K/V rows of keys [key_start, key_start + BLOCK_N) (below key_end) into L2,
    without waiting for them. Before the kernel before has finished: the block tables are a
    step input, the rows were written by earlier steps but for the newest tokens', which that
    kernel may still be writing. A prefetch reads nothing into the program, and L2 is where
    that kernel's stores land, so the loads after the wait still see them."""
    LINE_VALUES: tl.constexpr = (
        8 * _CACHE_LINE_BYTES // key_cache_ptr.dtype.element_ty.primitive_bitwidth
    )
    LINES: tl.constexpr = (BLOCK_D + LINE_VALUES - 1) // LINE_VALUES  # a power of two
    lines = tl.arange(0, LINES)
    keys = key_start + tl.arange(0, BLOCK_N)
    key_mask = keys < key_end
    rows = _key_rows(block_table_ptr, keys, key_mask, stride_cache_slot, BLOCK_SIZE, True)
    offsets = (rows + kv_head * stride_cache_head)[:, None] + lines[None, :] * LINE_VALUES
    mask = key_mask[:, None] & (lines * LINE_VALUES < HEAD_DIM)[None, :]
    prefetch_to_l2(key_cache_ptr + offsets, mask)
    prefetch_to_l2(value_cache_ptr + offsets, mask)


@triton.jit(
    do_not_specialize=["stride_table"],
    do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr", "stride_table"],
)
def _decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    workspace_ptr,
    split_counts_ptr,
    sinks_ptr,
    window: tl.constexpr,
    scale_log2: tl.constexpr,
    stride_q_seq: tl.constexpr,
    stride_q_head: tl.constexpr,
    stride_table,
    stride_cache_slot: tl.constexpr,
    stride_cache_head: tl.constexpr,
    stride_out_seq: tl.constexpr,
    stride_out_head: tl.constexpr,
    QUERY_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASK_WINDOW: tl.constexpr,  # USE_WINDOW with several queries: each has its own window
    WRITE_PARTIAL: tl.constexpr,
    MERGE_HERE: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (kv head, sequence, split): its part of the context, for the group's heads
    at each of the sequence's QUERY_LEN query tokens (rows seq * QUERY_LEN + token).

    Split (WRITE_PARTIAL), each program stores its partial results to the workspace. Where
    the tile's rows are few enough to merge at once (MERGE_HERE: a decode step's group), only
    the splits holding keys run (the rest end at once); each then counts itself done on its
    (kv head, sequence)'s counter in ``split_counts_ptr`` (the stores first, then a barrier,
    then the count's release); the program that finds itself the last (after the count's
    acquire) merges the group's rows from the workspace (``_merge_splits``, the sinks there,
    once) and sets the counter back to zero for the next launch. Only the counts are atomic:
    the result does not depend on which program came last. A taller tile's rows (a verify
    step's 1 + k tokens) are merged by ``_decode_merge_kernel``, several rows a program, after
    this kernel."""
    kv_head = tl.program_id(0)  # fastest: a sequence's KV heads run side by side
    seq = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # The split workspace [tokens, heads, splits, HEAD_DIM + 2] is contiguous: its strides
    # follow from the grid, so that, the model's strides being constants
    # (``_launch_decode_kernel``), the block tables' is the one stride left an argument.
    stride_ws_split: tl.constexpr = HEAD_DIM + 2
    stride_ws_head = num_splits * stride_ws_split
    stride_ws_seq = tl.num_programs(0) * GROUP * stride_ws_head
    # A step input, written before the forward pass: read before the wait.
    context_len = tl.load(context_lens_ptr + seq)
    first_key = 0
    if USE_WINDOW:  # the first query's window
        first_key = tl.maximum(context_len - QUERY_LEN + 1 - window, 0)
    # Every sequence divides its own (windowed) context evenly, in whole tiles, but into
    # parts of at least _least_split_tiles: the rest of the splits hold no keys.
    tiles = tl.cdiv(context_len - first_key, BLOCK_N)
    split_len = tl.maximum(tl.cdiv(tiles, num_splits), _least_split_tiles(tiles)) * BLOCK_N
    key_start = first_key + split * split_len
    key_end = tl.minimum(key_start + split_len, context_len)
    # Only the splits that start inside the context hold keys: the block tables' width (a
    # CUDA graph's: the longest context the engine takes) sets the split count, and a short
    # context leaves most of them empty. Merged here, they do nothing: not counted, stored or
    # merged (at batch 1, most of a step's programs; each stored its empty partial and took
    # its turn at the counter the last one merges after), nor waited for: a dependent launch
    # lets the next kernel start once each program has let it or ended.
    splits_with_keys = tl.cdiv(context_len - first_key, tl.maximum(split_len, 1))
    if MERGE_HERE and split >= splits_with_keys:
        return
    if WRITE_PARTIAL:
        # Split (a small batch, whose step is a chain of latencies): the split's first tile
        # pulled into L2 while the kernel before finishes, so that its loads after the wait
        # do not start from DRAM.
        _prefetch_tile(
            key_cache_ptr,
            value_cache_ptr,
            block_tables_ptr + seq * stride_table,
            kv_head,
            key_start,
            key_end,
            stride_cache_slot,
            stride_cache_head,
            BLOCK_SIZE,
            BLOCK_N,
            HEAD_DIM,
            BLOCK_D,
        )
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()

    token, heads, valid = _group_rows(kv_head, QUERY_LEN, GROUP, TOKEN_ROWS, BLOCK_M)
    rows = seq * QUERY_LEN + token
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    # The queries are the context's last positions. Padding queries (a verify step's rows
    # with fewer drafts than others, at the front) ask again for earlier ones; never below
    # 0, so that each sees a key and its (ignored) output stays finite.
    query_pos = tl.maximum(context_len - QUERY_LEN + token.to(tl.int64), 0)
    # Split, the sinks are the merge's.
    acc, row_max, row_sum = _initial_state(
        sinks_ptr, heads, valid, BLOCK_M, BLOCK_D, HAS_SINKS and not WRITE_PARTIAL
    )
    acc, row_max, row_sum = _attend_keys(
        q,
        acc,
        row_max,
        row_sum,
        query_pos,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + seq * stride_table,
        kv_head,
        key_start,
        key_start,  # every tile masked
        key_end,
        window,
        scale_log2,
        stride_cache_slot,
        stride_cache_head,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        MASK_WINDOW,  # one query (a decode): first_key already applies its window
        DOT_PRECISION,
        False,
    )
    if WRITE_PARTIAL:
        # Unnormalized output, then the row's max and sum, for the merge.
        row_ptr = workspace_ptr + rows * stride_ws_seq + heads * stride_ws_head
        row_ptr += split * stride_ws_split
        tl.store(row_ptr[:, None] + dims[None, :], acc, mask=mask)
        tl.store(row_ptr + HEAD_DIM, row_max, mask=valid)
        tl.store(row_ptr + HEAD_DIM + 1, row_sum, mask=valid)
    if MERGE_HERE:
        tl.debug_barrier()  # every thread's partial stored before the count releases them
        count_ptr = split_counts_ptr + seq * tl.num_programs(0) + kv_head
        finished = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if finished == splits_with_keys - 1:
            # The group's rows alone (MERGE_ROWS, not the tile's padding to a dot's 16).
            group_tokens, group_heads, group_valid = _group_rows(
                kv_head, QUERY_LEN, GROUP, TOKEN_ROWS, MERGE_ROWS
            )
            group_rows = seq * QUERY_LEN + group_tokens
            _merge_splits(
                workspace_ptr + group_rows * stride_ws_seq + group_heads * stride_ws_head,
                out_ptr + group_rows * stride_out_seq + group_heads * stride_out_head,
                sinks_ptr,
                group_heads,
                group_valid,
                splits_with_keys,
                stride_ws_split,
                HEAD_DIM,
                BLOCK_D,
                MERGE_ROWS,
                MERGE_SPLITS,
                HAS_SINKS,
            )
            tl.store(count_ptr, 0)  # zero again for the next launch
    if not WRITE_PARTIAL:
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr
            + rows[:, None] * stride_out_seq
            + heads[:, None] * stride_out_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _merge_splits(
    row_ptr,
    out_ptr,
    sinks_ptr,
    heads,
    valid,
    num_splits,
    stride_ws_split,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """BLOCK_R rows' outputs (to ``out_ptr``, each row's) from the partial results of their
    first ``num_splits`` splits (from ``row_ptr``, each row's first split in the workspace;
    ``heads``: their query heads, ``valid``: which are real; the splits after hold no keys):
    every split's partial sums rescaled to a common max, in one pass of BLOCK_S splits at a
    time (one compiled variant for every split count): each chunk's maxima, sums and partial
    sums are loaded together, for every row at once, and the state so far is rescaled to the
    new max, so the loads of a chunk wait on nothing before them. A head's sink, if any, is
    the state before the first split (``_initial_state``). Read from L2 (".cg"): other SMs
    wrote them, and this SM's L1 may hold an earlier layer's."""
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # An empty split holds max _NO_SCORE and sum 0: its weight is 0 once any split is not.
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_R, BLOCK_S], dtype=tl.float32)
    if HAS_SINKS:  # its sum, 1, in the first slot of the running sums
        top_max = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32) * _LOG2E
        total = tl.where(tl.arange(0, BLOCK_S)[None, :] == 0, 1.0, total)
    else:
        top_max = tl.full([BLOCK_R], _NO_SCORE, dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        splits = first + tl.arange(0, BLOCK_S)
        split_mask = valid[:, None] & (splits < num_splits)[None, :]
        split_ptr = row_ptr[:, None] + splits[None, :] * stride_ws_split
        row_max = tl.load(
            split_ptr + HEAD_DIM, mask=split_mask, other=_NO_SCORE, cache_modifier=".cg"
        )
        row_sum = tl.load(
            split_ptr + HEAD_DIM + 1, mask=split_mask, other=0.0, cache_modifier=".cg"
        )
        partial = tl.load(
            split_ptr[:, :, None] + dims[None, None, :],
            mask=split_mask[:, :, None] & dim_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(top_max, tl.max(row_max, 1))
        rescale = tl.exp2(top_max - new_max)
        weight = tl.exp2(row_max - new_max[:, None])
        acc = acc * rescale[:, None] + tl.sum(partial * weight[:, :, None], 1)
        total = total * rescale[:, None] + row_sum * weight
        top_max = new_max
    out = acc / tl.sum(total, 1)[:, None]
    out_mask = valid[:, None] & dim_mask[None, :]
    tl.store(out_ptr[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(
    do_not_specialize=["num_rows", "num_splits", "stride_ws_head"],
    do_not_specialize_on_alignment=["num_rows", "num_splits", "stride_ws_head"],
)
def _decode_merge_kernel(
    workspace_ptr,
    out_ptr,
    sinks_ptr,
    num_rows,
    num_splits,
    stride_ws_head,
    stride_ws_split,
    stride_out_seq,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program (BLOCK_R rows, a row a query token's head, token by token): their splits
    merged (``_merge_splits``), for the fp8 decode kernel's splits and for the Triton decode
    kernel's taller tiles (a verify step's: merged by its last program, their rows would be a
    serial tail). The workspace's rows are contiguous, ``stride_ws_head`` apart."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    tokens = rows // NUM_HEADS
    heads = rows % NUM_HEADS
    _merge_splits(
        workspace_ptr + rows.to(tl.int64) * stride_ws_head,
        out_ptr + tokens.to(tl.int64) * stride_out_seq + heads * stride_out_head,
        sinks_ptr,
        heads,
        valid,
        num_splits,
        stride_ws_split,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_R,
        BLOCK_S,
        HAS_SINKS,
    )


@triton.jit(do_not_specialize=["stride_table"], do_not_specialize_on_alignment=_STEP_ARGUMENTS)
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_lens_ptr,
    query_starts_ptr,
    out_ptr,
    sinks_ptr,
    window,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_table,
    stride_cache_slot,
    stride_cache_head,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (sequence, block of BLOCK_Q new tokens, kv head), causal over the cache.

    The blocks run last first: a later block attends to more keys, and programs start in
    grid order, so the longest start first and the short ones fill the tail."""
    seq = tl.program_id(0)
    query_block = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq)
    block_first = query_block * BLOCK_Q
    # The grid covers the longest sequence; shorter ones have nothing in this block.
    if block_first >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    first_pos = context_len - query_len + block_first  # position of the block's first token

    token, heads, valid = _group_rows(
        kv_head, query_len - block_first, GROUP, GROUP_PAD, BLOCK_Q * GROUP_PAD
    )
    rows = tl.load(query_starts_ptr + seq) + block_first + token  # rows of the packed batch
    dims = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    acc, row_max, row_sum = _initial_state(
        sinks_ptr, heads, valid, BLOCK_Q * GROUP_PAD, BLOCK_D, HAS_SINKS
    )
    # Whole tiles of keys before the block's first query: every row sees them all (without a
    # window), so they go without masks; the rest (the block's own keys, the window's edge)
    # with them.
    key_start = 0
    if USE_WINDOW:
        key_start = tl.maximum(first_pos - window + 1, 0)
        masked_start = key_start
    else:
        masked_start = first_pos // BLOCK_N * BLOCK_N
    acc, _, row_sum = _attend_keys(
        q,
        acc,
        row_max,
        row_sum,
        first_pos + token,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr + seq * stride_table,
        kv_head,
        key_start,
        masked_start,
        tl.minimum(first_pos + BLOCK_Q, context_len),
        window,
        scale_log2,
        stride_cache_slot,
        stride_cache_head,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        USE_WINDOW,
        DOT_PRECISION,
        not USE_WINDOW,
    )
    # Padding rows past the sequence's last token may see no key at all (sliding window):
    # give them a sum of 1 rather than computing 0 / 0; they are not stored anyway.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    out_offsets = rows[:, None] * stride_out_token + heads[:, None] * stride_out_head
    tl.store(out_ptr + out_offsets + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def decode_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context_len: int,
    num_sms: int,
    *,
    programs_per_sm: int = _DECODE_PROGRAMS_PER_SM,
    min_split_tokens: int = _MIN_SPLIT_TOKENS,
) -> int:
    """How many parts to split each sequence's context into for one decode step.

    Without splitting there are ``batch * num_kv_heads`` programs; split until there are
    about ``programs_per_sm`` per SM, keeping parts at least ``min_split_tokens`` long
    (defaults: the Triton kernel's; fp8_decode.py's kernel has its own).
    """
    programs = batch * num_kv_heads
    wanted = programs_per_sm * num_sms // programs
    return max(1, min(wanted, max_context_len // min_split_tokens, MAX_DECODE_SPLITS))


def default_decode_splits(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_len: int,
    has_sinks: bool = False,
) -> int:
    """The split count ``paged_decode_attention`` takes when given none: ``decode_num_splits``
    for the kernel these arguments run, block_tables' capacity as the longest context (known
    without reading the lengths back from the GPU)."""
    _, block_size, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_tables.shape
    rule = _split_rule(_takes_fp8_kernel(q, key_cache, query_len, has_sinks))
    max_context_len = max_blocks * block_size
    return decode_num_splits(batch, num_kv_heads, max_context_len, sm_count(q.device), **rule)


def _takes_fp8_kernel(
    q: torch.Tensor, key_cache: torch.Tensor, query_len: int, has_sinks: bool
) -> bool:
    """Whether a decode step of these arguments runs the Gluon fp8 kernel (fp8_decode.py):
    where that kernel runs, but with sinks, which are the Triton kernel's."""
    return uses_fp8_decode_kernel(q, key_cache, query_len) and not has_sinks


def _split_rule(fp8_kernel: bool) -> dict[str, int]:
    """``decode_num_splits``' rule for the fp8 kernel (``fp8_kernel``) or the Triton one."""
    if not fp8_kernel:
        return {}
    return {
        "programs_per_sm": FP8_DECODE_PROGRAMS_PER_SM,
        "min_split_tokens": FP8_DECODE_MIN_SPLIT_TOKENS,
    }


def decode_workspace(
    num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> torch.Tensor:
    """Float32 scratch for split decode: each query's split's unnormalized output, max and
    sum."""
    return torch.empty(
        num_tokens, num_heads, num_splits, head_dim + 2, dtype=torch.float32, device=device
    )


def decode_split_counts(device: torch.device, programs: int) -> torch.Tensor:
    """int32 [programs], zeros: each (KV head, sequence)'s split programs that have stored
    their partial results, counted up by the decode kernel and set back to zero by each one's
    last program (``zeroed_counters``), rounded up to a power of two so that the steps' many
    batch sizes share few buffers."""
    return zeroed_counters(device, triton.next_power_of_2(programs), "split decode")[:programs]


def _check_cache(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
    assert key_cache.dim() == 4 and key_cache[0, 0].is_contiguous()
    assert key_cache.dtype == value_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    assert q.stride(-1) == 1
    assert q.shape[-1] == key_cache.shape[-1] and q.shape[-2] % key_cache.shape[-2] == 0


def _check_tables(block_tables: torch.Tensor) -> None:
    # A key's offset is its block number times the cache's slot stride, computed in the
    # table's dtype: from int32 it overflows past 2**31 elements of one layer's cache (an
    # illegal address on a large cache), so the engine's int64 is the only one.
    assert block_tables.dtype == torch.int64, f"block tables are int64, not {block_tables.dtype}"


def dot_precision(dtype: torch.dtype) -> str:
    # float32 engines want float32 attention, not TF32's 10-bit mantissa.
    return "ieee" if dtype == torch.float32 else "tf32"


def _window(sliding_window: int | None) -> int:
    assert sliding_window is None or sliding_window > 0
    return sliding_window or 0


def decode_constants(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_len: int,
    sliding_window: int | None,
    num_splits: int,
    batch: int,
    has_sinks: bool = False,
    num_warps: int | None = None,
) -> tuple[dict[str, int | bool | str], int]:
    """The decode kernel's compile-time arguments for a step of this shape (``batch``
    sequences), and the warps it runs in (``num_warps``, default ``decode_num_warps``'):
    what picks its compiled variant (also for ``scripts/kernel_resources.py``, which compiles
    it without a GPU)."""
    group = num_heads // num_kv_heads
    token_rows, rows = _tile_rows(query_len, group)
    block_d = triton.next_power_of_2(head_dim)
    block_m = max(rows, _MIN_DOT_ROWS)
    # One sequence's one query, split: a batch-1 step, whose attention is a chain of
    # latencies rather than a read of the cache at copy bandwidth.
    one_sequence_split = num_splits > 1 and batch == 1 and query_len == 1
    warps = num_warps or decode_num_warps(head_dim, kv_dtype, block_m, one_sequence_split)
    merge_values = _MERGE_VALUES_PER_THREAD * 32 * warps
    constants: dict[str, int | bool | str] = {
        "QUERY_LEN": query_len,
        "GROUP": group,
        "TOKEN_ROWS": token_rows,
        "BLOCK_M": block_m,
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_N": _FP8_DECODE_BLOCK_N if kv_dtype.itemsize == 1 else _BLOCK_N,
        "BLOCK_SIZE": block_size,
        "USE_WINDOW": sliding_window is not None,
        "MASK_WINDOW": sliding_window is not None and query_len > 1,
        "WRITE_PARTIAL": num_splits > 1,
        "MERGE_HERE": num_splits > 1 and _merged_in_kernel(rows),
        "MERGE_ROWS": rows,
        "MERGE_SPLITS": max(merge_values // (rows * block_d), 1),
        "HAS_SINKS": has_sinks,
        "DOT_PRECISION": dot_precision(dtype),
    }
    return constants, warps


def _tile_rows(query_len: int, group: int) -> tuple[int, int]:
    """The decode kernel's rows a token and its tile's query rows, for ``query_len`` tokens
    of a KV head's ``group`` query heads. A decode step's tile holds one token's group, padded
    to a power of two; a verify step's the 1 + k tokens' groups back to back, unpadded, for a
    tile half as tall where the group is not a power of two (SmolLM2's 3 heads at k = 16: 51
    rows in 64, not 68 in 128)."""
    token_rows = group if query_len > 1 else triton.next_power_of_2(group)
    return token_rows, triton.next_power_of_2(query_len * token_rows)


def _merged_in_kernel(rows: int) -> bool:
    """Whether the split decode kernel's last program merges its splits (a tile of ``rows``
    query rows, ``_tile_rows``'), not the merge kernel after it."""
    return rows <= _MOST_MERGE_ROWS


def decode_num_warps(
    head_dim: int, kv_dtype: torch.dtype, block_m: int, one_sequence_split: bool
) -> int:
    """Warps a decode program takes for a tile of ``block_m`` query rows. Over a bf16 cache
    at head_dim 64, two where the tile has at most 32 rows: they read a large batch's cache
    (128-256 sequences) closer to copy bandwidth than four, and tie at smaller batches; at
    head_dim 128 two and four tie. A verify step's taller tile (1 + k tokens a row times the
    query heads of a KV head: 64 or 128 rows at k = 8 or 16) does not fit two warps'
    registers: compiled so, it spills to local memory (``scripts/kernel_resources.py
    --query-len 9 --heads 32 8 --head-dim 64 --split`` reports the bytes), and at 128 rows
    it ran several times slower than at 64. The other cases keep Triton's default, four.
    ``scripts/bench_kernels.py --head-dims 64 128 --batches 1 64 128 256`` measures the
    share of copy bandwidth (change this rule to compare).

    One sequence's split decode (``one_sequence_split``: a batch-1 step) over a bf16/fp16
    cache takes more: its few programs are a chain of latencies, and with more warps each
    program's loads of a tile, and its last program's merge (as many splits a round as
    ``_MERGE_VALUES_PER_THREAD`` allows), take fewer instructions a thread. Eight at head_dim
    128 and 256; four at 64, where eight lose at long contexts (32,768 keys). From four
    sequences up the extra warps lose where the contexts are long: the programs then
    outnumber an SM's places, and read the cache further from copy bandwidth
    (docs/benchmarks.md, decode attention at batch 1, eight warps; ``scripts/ablate_step.py``
    times the batch-1 step without attention)."""
    if one_sequence_split and kv_dtype.itemsize == 2:
        return 4 if head_dim <= 64 else 8
    return 2 if head_dim <= 64 and kv_dtype.itemsize == 2 and block_m <= 32 else 4


def decode_num_stages(query_len: int, kv_dtype: torch.dtype) -> int:
    """How many key tiles a decode program's loop loads ahead (Triton's software pipelining).
    Four for a decode step's one query a sequence over a bf16/fp16 cache: a large batch's
    programs of few tiles each (short contexts) start their loads sooner than at Triton's
    default three, which tie with four at small batches and long contexts (two lose there).
    Three elsewhere (a verify step's taller tile, an fp8 cache here), where four were not
    timed. ``scripts/bench_kernels.py`` measures the share of copy bandwidth (change this
    rule to compare); docs/benchmarks.md has the figures. Triton 3.9 compiles three and four
    alike (``scripts/kernel_resources.py``): a tile's K/V addresses come from a block-table
    load of the same iteration, so its pipeliner keeps one K/V tile in flight a program.
    Reading the block numbers a tile ahead would keep more, but takes more shared memory
    and so fewer programs an SM: slower at large batches and, in the engine's step, at
    batch 1 too (docs/benchmarks.md)."""
    return 4 if query_len == 1 and kv_dtype.itemsize == 2 else 3


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    query_len: int = 1,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Attention of ``query_len`` new tokens per sequence, its last ones, to its cached
    context, causal among them; with ``sinks`` [num_heads] (any float dtype), each head's
    sink logit in its softmax's denominator.

    q: [B * query_len, num_heads, head_dim], sequence b's tokens at rows b * query_len
    onwards, at positions context_lens[b] - query_len, ... (a position below 0 reads as 0:
    padding); caches: [num_blocks, block_size, num_kv_heads, head_dim]; block_tables:
    [B, max_blocks] int64; context_lens: [B] int, the new tokens included.
    ``num_splits`` defaults to ``default_decode_splits``, ``num_warps`` (the Triton kernel's,
    for benchmarks to compare) to ``decode_num_warps``. For CUDA graphs, pass ``out`` and,
    when splitting, ``workspace`` (``decode_workspace``).
    Returns out: [B * query_len, num_heads, head_dim] in q's dtype.
    """
    _check_cache(q, key_cache, value_cache)
    _check_tables(block_tables)
    num_tokens, num_heads, head_dim = q.shape
    batch = block_tables.shape[0]
    assert context_lens.shape[0] == batch and num_tokens == batch * query_len
    assert batch <= _MAX_GRID_Y, "the sequences are the grid's second axis"
    if num_splits is None:
        num_splits = default_decode_splits(q, key_cache, block_tables, query_len, sinks is not None)
    assert sinks is None or sinks.shape == (num_heads,)
    assert 1 <= num_splits <= MAX_DECODE_SPLITS
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(num_tokens, num_heads, head_dim, num_splits, q.device)
        assert workspace.shape == (num_tokens, num_heads, num_splits, head_dim + 2)
        assert workspace.dtype == torch.float32 and workspace.is_contiguous()
        ws_strides = workspace.stride()[:3]
    else:
        workspace, ws_strides = out, (0, 0, 0)  # unused: the kernel writes out directly

    # One query a sequence over an fp8 cache: the Gluon kernel (fp8_decode.py), where it runs.
    if _takes_fp8_kernel(q, key_cache, query_len, sinks is not None):
        fp8_paged_decode(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            _window(sliding_window),
            out,
            workspace,
            ws_strides,
            num_splits,
        )
        if num_splits > 1:
            merge_splits(workspace, out)
    else:
        _launch_decode_kernel(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale,
            query_len,
            sliding_window,
            out,
            workspace,
            num_splits,
            sinks,
            num_warps,
        )
    return out


def merge_splits(
    workspace: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None
) -> None:
    """The second kernel of a split step whose decode kernel does not merge (the fp8
    kernel's, a verify step's): each query head's splits in ``workspace`` (float32 [tokens,
    heads, splits, head_dim + 2]: unnormalized output, max, sum; see ``decode_workspace``)
    weighed to a common max, with its sink if any, into ``out`` [tokens, heads, head_dim],
    as the Triton decode kernel's last split program weighs its group's."""
    num_tokens, num_heads, num_splits, row = workspace.shape
    head_dim = row - 2
    assert out.shape == (num_tokens, num_heads, head_dim) and out.stride(-1) == 1
    assert workspace.is_contiguous()
    num_rows = num_tokens * num_heads
    block_s, block_r = merge_tile(num_splits, num_rows, sm_count(out.device))
    _launch_merge_kernel(workspace, out, sinks, num_rows, block_s, block_r)


def _launch_merge_kernel(
    workspace: torch.Tensor,
    out: torch.Tensor,
    sinks: torch.Tensor | None,
    num_rows: int,
    block_s: int,
    block_r: int,
) -> None:
    """``_decode_merge_kernel`` over the first ``num_rows`` rows, in tiles of ``block_s``
    splits by ``block_r`` rows."""
    num_heads, num_splits, row = workspace.shape[1:]
    _decode_merge_kernel[(triton.cdiv(num_rows, block_r),)](
        workspace,
        out,
        out if sinks is None else sinks,  # unread without sinks
        num_rows,
        num_splits,
        *workspace.stride()[1:3],
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=row - 2,
        BLOCK_D=triton.next_power_of_2(row - 2),
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        HAS_SINKS=sinks is not None,
        **launch_options(out.device),
    )


def compile_split_merges(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    query_len: int,
    max_batch: int,
    max_context_len: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Compile the merge kernel's variant for each tile that a split step of 1 to
    ``max_batch`` sequences of ``query_len`` queries each (``q``'s heads and dtype), contexts
    of up to ``max_context_len`` keys over ``key_cache``, may take (``merge_tiles``), where
    such a step's splits are merged by that kernel (the fp8 kernel's; a verify step's taller
    tile): the tile follows the step's split count and rows. A graph's step compiles its own
    at capture, but an eager one (a mixed step's decodes, a verify step past the graphs) may
    take any, and a first compile then stalls that step. Each is launched over no rows."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = key_cache.shape
    fp8_kernel = _takes_fp8_kernel(q, key_cache, query_len, sinks is not None)
    _, rows = _tile_rows(query_len, num_heads // num_kv_heads)
    if not fp8_kernel and _merged_in_kernel(rows):
        return
    # Eager tables are whole blocks wide.
    max_context_len = triton.cdiv(max_context_len, block_size) * block_size
    tiles = merge_tiles(
        num_heads,
        num_kv_heads,
        query_len,
        max_batch,
        max_context_len,
        sm_count(q.device),
        fp8_kernel,
    )
    out = torch.empty(1, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for block_s, block_r in tiles:
        workspace = decode_workspace(1, num_heads, head_dim, block_s, q.device)
        _launch_merge_kernel(workspace, out, sinks, 0, block_s, block_r)


def merge_tiles(
    num_heads: int,
    num_kv_heads: int,
    query_len: int,
    max_batch: int,
    max_context_len: int,
    num_sms: int,
    fp8_kernel: bool,
) -> set[tuple[int, int]]:
    """The merge kernel's tiles (``merge_tile``) for every split step of 1 to ``max_batch``
    sequences of ``query_len`` queries, ``num_heads`` a token, contexts of up to
    ``max_context_len`` keys, split by the fp8 kernel's rule (``fp8_kernel``) or the Triton
    kernel's. A step's split count is at most its batch's at the longest context, and any
    count below it, its tile's splits that count's power of two (at most
    ``_MERGE_TILE_SPLITS_TIMES_ROWS``); its rows follow the batch."""
    rule = _split_rule(fp8_kernel)
    tiles: set[tuple[int, int]] = set()
    for batch in range(1, max_batch + 1):
        most_splits = decode_num_splits(batch, num_kv_heads, max_context_len, num_sms, **rule)
        num_rows = batch * query_len * num_heads
        splits = 2
        while splits // 2 < most_splits and splits <= _MERGE_TILE_SPLITS_TIMES_ROWS:
            tiles.add(merge_tile(splits, num_rows, num_sms))
            splits *= 2
    return tiles


def merge_tile(num_splits: int, num_rows: int, num_sms: int) -> tuple[int, int]:
    """The merge kernel's splits a chunk and rows a program, for ``num_rows`` rows of
    ``num_splits`` splits each on ``num_sms`` SMs: as many splits as there are, up to 64 (a
    power of two: a step's split count follows its batch, and few variants compile), and the
    rows that fill the rest of the tile, but never so many that fewer than
    ``_MERGE_PROGRAMS_PER_SM`` programs an SM remain."""
    block_s = min(triton.next_power_of_2(num_splits), _MERGE_TILE_SPLITS_TIMES_ROWS)
    block_r = _MERGE_TILE_SPLITS_TIMES_ROWS // block_s
    while block_r > 1 and num_rows // block_r < _MERGE_PROGRAMS_PER_SM * num_sms:
        block_r //= 2
    return block_s, block_r


def _launch_decode_kernel(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_len: int,
    sliding_window: int | None,
    out: torch.Tensor,
    workspace: torch.Tensor,
    num_splits: int,
    sinks: torch.Tensor | None,
    num_warps: int | None,
) -> None:
    """``_decode_kernel``'s launch, into ``out``, through ``workspace`` when split, in
    ``num_warps`` (None: ``decode_num_warps``')."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = key_cache.shape
    batch = block_tables.shape[0]
    constants, warps = decode_constants(
        q.dtype,
        key_cache.dtype,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        query_len,
        sliding_window,
        num_splits,
        batch,
        sinks is not None,
        num_warps,
    )
    # Unread where the kernel does not merge (unsplit, or a taller tile's merge kernel).
    merges_here = constants["MERGE_HERE"]
    split_counts = decode_split_counts(q.device, batch * num_kv_heads) if merges_here else q
    # The KV heads of a cache block lie side by side in memory (each token's heads in one
    # row), and programs start in grid order, first axis fastest: with the heads first, the
    # programs reading one block's rows run together. Slightly faster than with the sequences
    # first at batch 64-256 (docs/history/benchmarks-lab-notebook.md;
    # ``scripts/bench_kernels.py --batches 64 256`` measures it).
    # The window, the scale and q's, the cache's and out's strides are the kernel's constants
    # (one variant for each model's, compiled at warm-up): the addresses they make fold into
    # shifts and immediates instead of 64-bit products of arguments, fewer instructions and
    # registers on the path of a batch-1 step's chain of latencies (``scripts/bench_kernels.py
    # --batches 1 --table-tokens 131072`` times it). The block tables' stride stays an
    # argument: an eager step's tables are as wide as its longest context.
    _decode_kernel[(num_kv_heads, batch, num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        workspace,
        split_counts,
        q if sinks is None else sinks,  # unread without sinks
        _window(sliding_window),
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        out.stride(0),
        out.stride(1),
        **constants,
        num_warps=warps,
        num_stages=decode_num_stages(query_len, key_cache.dtype),
        **launch_options(q.device),
    )
    if num_splits > 1 and not merges_here:
        merge_splits(workspace, out, sinks)


def prefill_constants(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    sliding_window: int | None,
    has_sinks: bool = False,
) -> dict[str, int | bool | str]:
    """The prefill kernel's compile-time arguments for heads of this shape (also for
    ``scripts/kernel_resources.py --prefill``, which compiles it without a GPU)."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": max(prefill_block_m(block_d) // group_pad, 1),
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_N": _PREFILL_BLOCK_N,
        "BLOCK_SIZE": block_size,
        "USE_WINDOW": sliding_window is not None,
        "HAS_SINKS": has_sinks,
        "DOT_PRECISION": dot_precision(dtype),
    }


def prefill_block_m(block_d: int) -> int:
    """Rows of a prefill tile (query tokens times the group's padded query heads) for heads
    padded to ``block_d``. 128 at head_dim 128: each tile of keys is read once for twice the
    queries, which measured faster on long prompts in the 8B shape's and Qwen3 0.6B's heads.
    64 at head_dim 64 (the 1B shape's heads ran no faster at 128) and at 256 (128 rows of
    256 would not fit a program's shared memory). ``scripts/bench_kernels.py --prefill``
    times it against the GEMM rate; docs/benchmarks.md has the figures."""
    return 128 if block_d == 128 else 64


def prefill_num_warps(block_d: int) -> int:
    """Warps a prefill program takes for heads padded to ``block_d``."""
    return 4 if block_d <= 128 else 8


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    query_starts: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a packed batch of new tokens to their sequences' caches; with
    ``sinks`` [num_heads], each head's sink logit in its softmax's denominator.

    q: [T, num_heads, head_dim], sequence b's tokens at rows
    [query_starts[b], query_starts[b] + query_lens[b]) and positions
    [context_lens[b] - query_lens[b], context_lens[b]); query_starts is the exclusive
    cumsum of query_lens, computed once per step; max_query_len must bound query_lens.
    Returns out: [T, num_heads, head_dim] in q's dtype.
    """
    _check_cache(q, key_cache, value_cache)
    _check_tables(block_tables)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    batch = block_tables.shape[0]
    assert context_lens.shape == query_lens.shape == query_starts.shape == (batch,)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1

    constants = prefill_constants(
        q.dtype, num_heads, num_kv_heads, head_dim, block_size, sliding_window, sinks is not None
    )
    grid = (batch, triton.cdiv(max_query_len, int(constants["BLOCK_Q"])), num_kv_heads)
    _prefill_kernel[grid](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        query_lens,
        query_starts,
        out,
        q if sinks is None else sinks,  # unread without sinks
        _window(sliding_window),
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        out.stride(0),
        out.stride(1),
        **constants,
        num_warps=prefill_num_warps(int(constants["BLOCK_D"])),
        num_stages=PREFILL_STAGES,
    )
    return out
