"""Sampling with cuts (min-p, top-k, top-p) without sorting the vocabulary: each row's token
in one program, in a few passes over its logits.

The reference (``sampling_draw.race_sample``) sorts each row's probabilities to find what its
top-k and top-p keep, then races over that. A sort of [B, V] with its cumulative sum is most
of a sampled step's draw wherever a model's generation config sets top-p or top-k (Llama
3's 0.9; Qwen3's 0.95 and 20), which the server applies to every request that names none.
The race needs no sort. The kept set N is the most probable tokens: a token is in it where
min-p keeps it, fewer than top-k tokens are more probable, and their mass is below top-p of
what min-p keeps. So, over the logits scaled by the temperature:

1. race over every token min-p keeps and above a bound (none at first): the winner w, the
   argmax of logit / T - log E as the uncut draw's (``argmax.py``);
2. count the tokens more probable than w, and their mass: where these are within top-k and
   top-p, w is in N, and since N lies within what was raced over, w is N's winner: done;
3. otherwise no token of N is as improbable as w: race again over the tokens more
   probable than w.

The most probable token is always in N, so it ends. A winner over the whole distribution is
in N about as often as N's mass, and a winner over the tokens above a rejected one more often
still: a row takes about one to three races, two passes each, after a pass for the largest
logit. The token is the reference's but where tokens tie at N's boundary (its sort orders
them arbitrarily; here a tie is kept or cut whole) or float32 sums of the masses fall on
either side of top-p. A greedy row takes its argmax, min-p's cut of a row its
``exp(logit / T - max) >= min_p`` (the reference's probabilities against min-p times the
largest).

One program a row: a large batch fills the GPU; a small one leaves most SMs idle, each
pass one SM's read of the row (a sampled step at batch 1 pays some tens of microseconds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.sampling_draw import Cuts
from engine.backends.triton.argmax import log_race, row_key, sample_rows
from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

_BLOCK = 4096
_NUM_WARPS = 8  # 16 logits a thread a pass: more bytes in flight for a row's one SM


@triton.jit
def _scaled_logits(row_ptr, cols, vocab_size, stride_col, scale):
    logits = tl.load(row_ptr + cols * stride_col, mask=cols < vocab_size, other=-float("inf"))
    return logits / scale


@triton.jit
def _nucleus_kernel(
    logits_ptr,
    out_ptr,
    temperature_ptr,
    seed_ptr,
    step_ptr,
    top_p_ptr,
    top_k_ptr,
    min_p_ptr,
    vocab_size,
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
):
    """Program per row: its token, raced within its cuts (the module's docstring)."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    row_ptr = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK)
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    sampled = temperature != 0
    scale = tl.where(sampled, temperature, 1.0)  # a greedy row: its logits, raced noiselessly
    key = row_key(tl.load(seed_ptr + row * stride_seed), tl.load(step_ptr + row * stride_step))
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

    # The largest scaled logit: the probabilities' common factor, which min-p compares with.
    largest = tl.full((), -float("inf"), tl.float32)
    if cut:
        for start in range(0, vocab_size, BLOCK):
            x = _scaled_logits(row_ptr, start + offsets, vocab_size, stride_col, scale)
            largest = tl.maximum(largest, tl.max(x, 0))

    bound = tl.full((), -float("inf"), tl.float32)  # race over the tokens above it
    token = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int32)
    while done == 0:
        best_score = tl.full((), -float("inf"), tl.float32)
        best_col = tl.zeros((), tl.int32)
        best_x = tl.full((), -float("inf"), tl.float32)
        for start in range(0, vocab_size, BLOCK):
            cols = start + offsets
            x = _scaled_logits(row_ptr, cols, vocab_size, stride_col, scale)
            candidate = x > bound
            if min_p > 0.0:  # then ``cut``: the largest logit was found
                candidate = candidate & (tl.exp(x - largest) >= min_p)
            noise = tl.where(sampled, log_race(key, cols), 0.0)
            score = tl.where(candidate, x - noise, -float("inf"))
            chunk_best = tl.argmax(score, 0, tie_break_left=True)
            chunk_score = tl.max(score, 0)
            # Strictly greater: the first chunk's token wins a tie, as torch's argmax.
            better = chunk_score > best_score
            chunk_x = tl.max(tl.where(offsets == chunk_best, x, -float("inf")), 0)
            best_col = tl.where(better, start + chunk_best, best_col)
            best_x = tl.where(better, chunk_x, best_x)
            best_score = tl.where(better, chunk_score, best_score)
        token = best_col
        done = tl.where(cut, 0, 1)
        if cut:
            above_mass = tl.zeros((), tl.float32)
            above_count = tl.zeros((), tl.int32)
            kept_mass = tl.zeros((), tl.float32)
            for start in range(0, vocab_size, BLOCK):
                x = _scaled_logits(row_ptr, start + offsets, vocab_size, stride_col, scale)
                mass = tl.exp(x - largest)  # 0 at -inf
                kept = mass >= min_p
                above = kept & (x > best_x)
                above_mass += tl.sum(tl.where(above, mass, 0.0), 0)
                above_count += tl.sum(above.to(tl.int32), 0)
                kept_mass += tl.sum(tl.where(kept, mass, 0.0), 0)
            in_top_p = (top_p >= 1.0) | (above_mass < top_p * kept_mass)
            in_top_k = (top_k == 0) | (above_count < top_k)
            done = tl.where((in_top_p & in_top_k) | (above_count == 0), 1, 0)
            bound = best_x
    tl.store(out_ptr + row, token.to(tl.int64))


_NUCLEUS = OneVariantKernel(_nucleus_kernel, num_warps=_NUM_WARPS)


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
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    has_top = cuts.top_p is not None and cuts.top_k is not None
    # Parameters a row does not read: any pointer does. The others are columns of a step's
    # packed parameters (``sampling_tensors``): strided views.
    top_p = cuts.top_p if cuts.top_p is not None else temperature
    top_k = cuts.top_k if cuts.top_k is not None else seed
    min_p = cuts.min_p if cuts.min_p is not None else temperature
    params = (temperature, seed, step, top_p, top_k, min_p)
    param_strides = tuple(t.stride(0) for t in params)
    stride_row, stride_col = logits.stride()
    _NUCLEUS.launch(
        (num_rows,),
        logits.device,
        logits,
        out,
        *params,
        vocab_size,
        stride_row,
        stride_col,
        *param_strides,
        has_top,
        cuts.min_p is not None,
        _BLOCK,
        # Its integers whole, whether its pointers are aligned, and what it cuts: all Triton
        # specializes on.
        variant=(
            vocab_size,
            stride_row,
            stride_col,
            param_strides,
            tuple(t.data_ptr() % 16 == 0 for t in (logits, *params)),
            has_top,
            cuts.min_p is not None,
        ),
    )
    return out
