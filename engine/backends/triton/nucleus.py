"""Sampling with cuts (min-p, top-k, top-p) without sorting the vocabulary.

The reference (``sampling_draw.race_sample``) sorts each row's probabilities to find what its
top-k and top-p keep, then races over that. A sort of [B, V] with its cumulative sum is most
of a sampled step's draw wherever a model's generation config sets top-p or top-k (Llama
3's 0.9; Qwen3's 0.95 and 20), which the server applies to every request that names none.
The race needs no sort. The kept set N is the most probable tokens: a token is in it where
min-p keeps it, fewer than top-k tokens are more probable, and their mass is below top-p of
what min-p keeps. So, over the logits scaled by the temperature:

1. race over every token (``argmax.race_chunks``, the uncut draw's first pass, split over
   the row's chunks, keeping each chunk's largest logit too): the winner w;
2. count the tokens min-p keeps that are more probable than w, and their mass, split over
   the chunks again (``_chunk_mass_kernel``): where w is kept and these are within top-k and
   top-p, w is in N, and since N lies within what was raced over, w is N's winner;
3. otherwise (``_finish_kernel``, a program a row) no token of N is as improbable as w:
   race again over the kept tokens more probable than w, reading only the chunks whose
   largest logit (the first pass's) lies above w's, and in the same read count the tokens
   above a few pivots spread between w and the largest logit. A pivot that a token would be
   cut at bounds N from below (the next race starts above it); one it would be kept at
   bounds it from above (a winner there is in N without counting). A winner between the
   two is counted in one more read, with pivots again. So each race narrows N by the
   pivots as well as by its winner: a flat row's top-k 20 of 128k takes a few reads, not
   the dozen or more that racing above each winner alone would.

The most probable token is always in N, so it ends. A winner over the whole distribution is
in N about as often as N's mass (top-p, or more), so most rows end at step 2 with the row
split over the GPU, and the rest take a race or two more in one program. The token is the
reference's but where tokens tie at N's boundary (its sort orders them arbitrarily; here a
tie is kept or cut whole) or float32 sums of the masses fall on either side of top-p. A
greedy row takes its argmax (the first pass races it without noise), min-p's cut of a row
its ``exp(logit / T - max) >= min_p`` (the reference's probabilities against min-p times
the largest).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.sampling_draw import Cuts
from engine.backends.triton.argmax import CHUNK, log_race, race_chunks, row_key, sample_rows
from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

# Races a row at most: a bound that a kernel cannot spin past, whatever its inputs (its last
# winner, kept). Each race is over the tokens above the last winner and above the pivots its
# counts showed cut, so a flat row's top-k 20 of 128k takes a few.
_MAX_RACES = tl.constexpr(64)
_LOOP_WARPS = 8  # more bytes in flight for a row's one SM
# Thresholds a pass counts above: more narrow N faster, each costs a compare and two adds a
# token.
PIVOTS = tl.constexpr(4)
# Tokens a lane group takes at once in a pass: its accumulators are [PIVOTS, SUB], held in
# registers across the pass and reduced once at its end.
SUB = tl.constexpr(1024)


@triton.jit
def _scaled_logits(row_ptr, cols, vocab_size, stride_col, scale):
    logits = tl.load(row_ptr + cols * stride_col, mask=cols < vocab_size, other=-float("inf"))
    return logits / scale


@triton.jit
def _row_cuts(row, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, strides, HAS_TOP, HAS_MIN_P):
    """A row's temperature as a divisor (1 for a greedy row), top-p, top-k and min-p (a greedy
    row's none: its argmax is kept), and whether anything cuts its draw."""
    stride_temperature, stride_top_p, stride_top_k, stride_min_p = strides
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    sampled = temperature != 0
    top_p = 1.0
    top_k = 0
    min_p = 0.0
    if HAS_TOP:
        top_p = tl.load(top_p_ptr + row * stride_top_p)
        top_k = tl.load(top_k_ptr + row * stride_top_k)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row * stride_min_p)
    min_p = tl.where(sampled, min_p, 0.0)
    cut = sampled & ((top_p < 1.0) | (top_k > 0) | (min_p > 0.0))
    return tl.where(sampled, temperature, 1.0), top_p, top_k, min_p, cut


@triton.jit
def _race_winner(values_ptr, indices_ptr, maxes_ptr, row, num_chunks, BLOCK_CHUNKS):
    """The first pass's winner of a row from its chunks' (the first chunk wins a tie, as
    torch's argmax), and the row's largest logit."""
    chunks = tl.arange(0, BLOCK_CHUNKS)
    mask = chunks < num_chunks
    at = row * num_chunks + chunks
    values = tl.load(values_ptr + at, mask=mask, other=-float("inf"))
    best = tl.argmax(values, 0, tie_break_left=True)
    largest = tl.max(tl.load(maxes_ptr + at, mask=mask, other=-float("inf")), 0)
    return tl.load(indices_ptr + row * num_chunks + best), largest


@triton.jit
def _masses_above(x, largest, min_p, bound):
    """Over a block of scaled logits: the mass (relative to the largest's) of the tokens
    min-p keeps that are above ``bound``, how many they are, and the mass min-p keeps."""
    mass = tl.exp(x - largest)  # 0 at -inf
    kept = mass >= min_p
    above = kept & (x > bound)
    return (
        tl.sum(tl.where(above, mass, 0.0), 0),
        tl.sum(above.to(tl.int32), 0),
        tl.sum(tl.where(kept, mass, 0.0), 0),
    )


@triton.jit
def _in_nucleus(above_mass, above_count, kept_mass, top_p, top_k):
    """Whether a kept token is in N, that min-p keeps ``above_count`` tokens more probable
    than, of ``above_mass`` (relative to the largest's; ``kept_mass`` all min-p keeps)."""
    mass_limit = tl.where(top_p < 1.0, top_p * kept_mass, float("inf"))
    count_limit = tl.where(top_k > 0, top_k.to(tl.float32), float("inf"))
    return (above_mass < mass_limit) & (above_count < count_limit)


@triton.jit
def _narrowed(lo, hi, thresholds, mass, count, kept_mass, top_p, top_k):
    """``lo`` raised to the highest of ``thresholds`` that a kept token there would be cut
    at (N lies above it), ``hi`` lowered to the lowest it would be in N at (every kept token
    at or above it is), from the mass and count above each."""
    in_n = _in_nucleus(mass, count, kept_mass, top_p, top_k)
    lo = tl.maximum(lo, tl.max(tl.where(in_n, -float("inf"), thresholds), 0))
    hi = tl.minimum(hi, tl.min(tl.where(in_n, thresholds, float("inf")), 0))
    return lo, hi


@triton.jit
def _pass_above(
    row_args,
    bound,
    thresholds,
    key,
    RACE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One read of a row's chunks whose largest logit lies above ``bound``: the mass and
    count of the kept tokens above each of ``thresholds`` [PIVOTS] (none below ``bound``),
    and where ``RACE``, the race among the kept tokens above ``bound``: its score (-inf
    where none is), token and scaled logit. Lane by lane, reduced once at the end.
    ``row_args``: the row's logits, its chunks' largest logits and the rest of what every
    pass of the row reads."""
    row_ptr, row_maxes_ptr, num_chunks, vocab_size, stride_col, scale, largest, min_p = row_args
    offsets = tl.arange(0, SUB)
    lane_score = tl.full((SUB,), -float("inf"), tl.float32)
    lane_token = tl.zeros((SUB,), tl.int32)
    lane_mass = tl.zeros((PIVOTS, SUB), tl.float32)
    lane_count = tl.zeros((PIVOTS, SUB), tl.float32)
    for chunk in range(0, num_chunks):
        if tl.load(row_maxes_ptr + chunk) / scale > bound:
            for part in tl.static_range(BLOCK // SUB):
                cols = chunk * BLOCK + part * SUB + offsets
                x = _scaled_logits(row_ptr, cols, vocab_size, stride_col, scale)
                mass = tl.exp(x - largest)  # 0 at -inf
                kept = mass >= min_p
                if RACE:
                    score = tl.where(kept & (x > bound), x - log_race(key, cols), -float("inf"))
                    # Strictly greater: a lane's first token wins a tie, as torch's.
                    better = score > lane_score
                    lane_token = tl.where(better, cols, lane_token)
                    lane_score = tl.where(better, score, lane_score)
                above = kept[None, :] & (x[None, :] > thresholds[:, None])
                lane_mass += tl.where(above, mass[None, :], 0.0)
                lane_count += above.to(tl.float32)
    score = tl.max(lane_score, 0)
    # The first token of the best score, as torch's argmax.
    token = tl.min(tl.where(lane_score == score, lane_token, vocab_size), 0)
    token = tl.minimum(token, vocab_size - 1)
    best_x = tl.load(row_ptr + token * stride_col) / scale
    return score, token, best_x, tl.sum(lane_mass, 1), tl.sum(lane_count, 1)


@triton.jit
def _chunk_mass_kernel(
    logits_ptr,
    values_ptr,
    indices_ptr,
    maxes_ptr,
    partials_ptr,
    temperature_ptr,
    top_p_ptr,
    top_k_ptr,
    min_p_ptr,
    vocab_size,
    stride_row,
    stride_col,
    stride_temperature,
    stride_top_p,
    stride_top_k,
    stride_min_p,
    HAS_TOP: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    """Program per (row, chunk) of a row its cuts may reject the winner of: the chunk's
    ``_masses_above`` the winner, [3, B, chunks] in ``partials`` (the count as a float)."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    strides = (stride_temperature, stride_top_p, stride_top_k, stride_min_p)
    scale, _, _, min_p, cut = _row_cuts(
        row, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, strides, HAS_TOP, HAS_MIN_P
    )
    if cut:
        winner, largest = _race_winner(
            values_ptr, indices_ptr, maxes_ptr, row, num_chunks, BLOCK_CHUNKS
        )
        row_ptr = logits_ptr + row * stride_row
        winner_x = tl.load(row_ptr + winner * stride_col) / scale
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = _scaled_logits(row_ptr, cols, vocab_size, stride_col, scale)
        above_mass, above_count, kept_mass = _masses_above(x, largest / scale, min_p, winner_x)
        slot = row * num_chunks + chunk
        size = tl.num_programs(0) * num_chunks
        tl.store(partials_ptr + slot, above_mass)
        tl.store(partials_ptr + size + slot, above_count.to(tl.float32))
        tl.store(partials_ptr + 2 * size + slot, kept_mass)


@triton.jit
def _finish_kernel(
    logits_ptr,
    out_ptr,
    values_ptr,
    indices_ptr,
    maxes_ptr,
    partials_ptr,
    temperature_ptr,
    seed_ptr,
    step_ptr,
    top_p_ptr,
    top_k_ptr,
    min_p_ptr,
    vocab_size,
    num_chunks,
    stride_row,
    stride_col,
    stride_temperature,
    stride_seed,
    stride_step,
    stride_top_p,
    stride_top_k,
    stride_min_p,
    HAS_TOP: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    """Program per row: the first race's winner where the row's cuts keep it, else the
    races above it until one's winner is kept (the module's docstring)."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    strides = (stride_temperature, stride_top_p, stride_top_k, stride_min_p)
    scale, top_p, top_k, min_p, cut = _row_cuts(
        row, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, strides, HAS_TOP, HAS_MIN_P
    )
    token, largest = _race_winner(values_ptr, indices_ptr, maxes_ptr, row, num_chunks, BLOCK_CHUNKS)
    if cut:
        row_ptr = logits_ptr + row * stride_row
        largest = largest / scale
        key = row_key(tl.load(seed_ptr + row * stride_seed), tl.load(step_ptr + row * stride_step))
        # The first race's counts, from its chunks'.
        chunks = tl.arange(0, BLOCK_CHUNKS)
        at = row * num_chunks + chunks
        mask = chunks < num_chunks
        size = tl.num_programs(0) * num_chunks
        above_mass = tl.sum(tl.load(partials_ptr + at, mask=mask, other=0.0), 0)
        above_count = tl.sum(tl.load(partials_ptr + size + at, mask=mask, other=0.0), 0)
        kept_mass = tl.sum(tl.load(partials_ptr + 2 * size + at, mask=mask, other=0.0), 0)
        best_x = tl.load(row_ptr + token * stride_col) / scale
        kept = tl.exp(best_x - largest) >= min_p
        in_n = kept & _in_nucleus(above_mass, above_count, kept_mass, top_p, top_k)
        done = (in_n | (above_count == 0)).to(tl.int32)
        # N lies above lo (what a pass's thresholds showed cut) and holds every kept token at
        # or above hi (the largest logit's token is always in N).
        lo = tl.full((), -float("inf"), tl.float32)
        hi = largest
        ranks = tl.arange(0, PIVOTS).to(tl.float32)
        row_maxes_ptr = maxes_ptr + row * num_chunks
        row_args = (
            row_ptr,
            row_maxes_ptr,
            num_chunks,
            vocab_size,
            stride_col,
            scale,
            largest,
            min_p,
        )
        races = tl.full((), 1, tl.int32)
        while done == 0:
            races += 1
            # Race again over the kept tokens above the rejected winner (and lo), counting
            # those above pivots spread between that bound and the largest.
            bound = tl.maximum(best_x, lo)
            pivots = bound + (ranks + 1.0) * ((largest - bound) / (PIVOTS + 1))
            score, raced, raced_x, mass, count = _pass_above(
                row_args, bound, pivots, key, True, BLOCK
            )
            found = score > -float("inf")  # always: the largest's token is above the bound
            token = tl.where(found, raced, token)
            best_x = tl.where(found, raced_x, best_x)
            lo, hi = _narrowed(lo, hi, pivots, mass, count, kept_mass, top_p, top_k)
            done = tl.where(found & (best_x < hi), 0, 1)
            if (done == 0) & (best_x > lo):
                # Between: count above the winner itself (the first threshold), and above
                # pivots between it and the largest, for the next race should it lose.
                thresholds = best_x + ranks * ((largest - best_x) / PIVOTS)
                _, _, _, mass, count = _pass_above(row_args, best_x, thresholds, key, False, BLOCK)
                kept_at = _in_nucleus(mass, count, kept_mass, top_p, top_k).to(tl.int32)
                done = tl.max(tl.where(ranks == 0.0, kept_at, 0), 0)
                lo, hi = _narrowed(lo, hi, thresholds, mass, count, kept_mass, top_p, top_k)
            done = tl.where(races >= _MAX_RACES, 1, done)
    tl.store(out_ptr + row, token.to(tl.int64))


_CHUNK_MASS = OneVariantKernel(_chunk_mass_kernel)
_FINISH = OneVariantKernel(_finish_kernel, num_warps=_LOOP_WARPS)


def draw_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    cuts: Cuts | None,
) -> torch.Tensor:
    """The Triton backend's ``StepOps.sample_rows``: the uncut race in two passes split
    across programs (``argmax.sample_rows``), a cut one here."""
    if cuts is None:
        return sample_rows(logits, temperature, seed, step)
    return sample_within_cuts(logits, temperature, seed, step, cuts)


def sample_within_cuts(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    cuts: Cuts,
) -> torch.Tensor:
    """``StepOps.sample_rows`` of a step whose rows cut (``cuts``): token ids [B], int64."""
    num_rows, vocab_size = logits.shape
    values, indices, maxes = race_chunks(logits, (temperature, seed, step), store_max=True)
    assert maxes is not None
    num_chunks = values.shape[1]
    partials = logits.new_empty(3, num_rows, num_chunks)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    has_top = cuts.top_p is not None and cuts.top_k is not None
    # Parameters a row does not read: any pointer does. The others are columns of a step's
    # packed parameters (``sampling_tensors``): strided views.
    top_p = cuts.top_p if cuts.top_p is not None else temperature
    top_k = cuts.top_k if cuts.top_k is not None else seed
    min_p = cuts.min_p if cuts.min_p is not None else temperature
    cut_params = (top_p, top_k, min_p)
    strides = tuple(t.stride(0) for t in (temperature, *cut_params))
    block_chunks = triton.next_power_of_2(num_chunks)
    stride_row, stride_col = logits.stride()
    # What the kernels specialize on besides: their integers whole, whether their pointers
    # are aligned, and what the step cuts.
    variant = (
        vocab_size,
        stride_row,
        stride_col,
        strides,
        seed.stride(0),
        step.stride(0),
        tuple(t.data_ptr() % 16 == 0 for t in (logits, temperature, seed, step, *cut_params)),
        has_top,
        cuts.min_p is not None,
    )
    _CHUNK_MASS.launch(
        (num_rows, num_chunks),
        logits.device,
        logits,
        values,
        indices,
        maxes,
        partials,
        temperature,
        *cut_params,
        vocab_size,
        stride_row,
        stride_col,
        *strides,
        has_top,
        cuts.min_p is not None,
        CHUNK,
        block_chunks,
        variant=variant,
    )
    _FINISH.launch(
        (num_rows,),
        logits.device,
        logits,
        out,
        values,
        indices,
        maxes,
        partials,
        temperature,
        seed,
        step,
        *cut_params,
        vocab_size,
        num_chunks,
        stride_row,
        stride_col,
        strides[0],
        seed.stride(0),
        step.stride(0),
        *strides[1:],
        has_top,
        cuts.min_p is not None,
        CHUNK,
        block_chunks,
        variant=variant,
    )
    return out
