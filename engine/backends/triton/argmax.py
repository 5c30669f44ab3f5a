"""The index of each row's largest logit, or of its sampled token, in two passes.

PyTorch reduces a row of logits in one thread block: at batch 1 one SM reads the whole
vocabulary's row while the others idle, and the argmax outlasted every kernel of the step but
the GEMVs (``scripts/profile_step.py --model DIR --batch 1`` lists a step's kernels by device
time). Here the first pass spreads each row over ``BLOCK``-wide chunks, one program each,
and the second picks each row's winner among its chunks'. Ties go to the lowest index, as
``torch.argmax`` breaks them. Both are launched past Triton's binding (``one_variant.py``):
what they specialize on is the same for every step of a model.

Sampling (``sample_rows``) is the same two passes over a score: a sampled row's token is the
exponential race's winner, argmax_i p_i / E_i (``sampling_draw.race_sample``), which is
argmax_i logit_i / T - log E_i, the softmax's sum and max being the row's constants. The
first pass hashes each token's random number in registers, the bits ``uniform_noise``
gives, as it reads the logits: one read of them, where PyTorch's ops (the torch backend's)
write and read [B, V] tensors of int64 lanes some thirty times and launch as many kernels.
Greedy rows (temperature 0) score their logits as the argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.backends.sampling_draw import (
    COLUMN_MULTIPLIER,
    MASK32,
    MIX_MULTIPLIER,
    SEED_HIGH_SALT,
)
from engine.backends.triton.dependent_launch import let_next_kernel_start, wait_for_previous_kernel
from engine.backends.triton.one_variant import OneVariantKernel

CHUNK = 4096  # tokens a program of the first pass reads
# A kernel reads only constexpr globals.
_MIX = tl.constexpr(MIX_MULTIPLIER)
_SALT = tl.constexpr(SEED_HIGH_SALT)
_COLUMN = tl.constexpr(COLUMN_MULTIPLIER)
_LOW_BITS = tl.constexpr(MASK32)


@triton.jit
def _mix32(x):
    """``sampling_draw.mix32`` on uint32 lanes: their products wrap at 2**32, as its masks
    make the int64 lanes' do."""
    x = x ^ (x >> 16)
    x = x * _MIX
    x = x ^ (x >> 16)
    x = x * _MIX
    return x ^ (x >> 16)


@triton.jit
def row_key(seed, step):
    """``sampling_draw.row_keys`` of one row's seed and output index (int64), as uint32."""
    low = (seed & _LOW_BITS).to(tl.uint32)
    high = ((seed >> 32) & _LOW_BITS).to(tl.uint32)
    key = _mix32(low) ^ _mix32(high ^ _SALT)
    return _mix32(key + _mix32((step & _LOW_BITS).to(tl.uint32)))


@triton.jit
def log_race(key, cols):
    """log E at token ids ``cols`` of the row of ``key``: E = -log U, U ``uniform_noise``'s
    (its bits, then ``unit_interval``'s float). The race's score is logit / T - log E."""
    bits = _mix32(_mix32(key ^ (cols.to(tl.uint32) * _COLUMN)))
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608)
    return tl.log(-tl.log(uniform))


@triton.jit
def _race_scores(logits, cols, row, temperature_ptr, seed_ptr, step_ptr, param_strides):
    """logits / T - log E over a chunk of a sampled row (``race_sample``'s order); a greedy
    row's logits as they are. ``param_strides``: the three row parameters' strides (columns
    of the step's packed parameters)."""
    stride_temperature, stride_seed, stride_step = param_strides
    temperature = tl.load(temperature_ptr + row * stride_temperature)
    scores = logits
    if temperature != 0:
        seed = tl.load(seed_ptr + row * stride_seed)
        key = row_key(seed, tl.load(step_ptr + row * stride_step))
        scores = logits / temperature - log_race(key, cols)
    return scores


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr,
    values_ptr,
    indices_ptr,
    maxes_ptr,
    temperature_ptr,
    seed_ptr,
    step_ptr,
    vocab_size,
    stride_row,
    stride_col,
    stride_temperature,
    stride_seed,
    stride_step,
    BLOCK: tl.constexpr,
    RACE: tl.constexpr,
    STORE_MAX: tl.constexpr,
):
    """Program per (row, chunk): the chunk's largest logit (its largest race score where
    ``RACE``) and its index; where ``STORE_MAX``, its largest logit too (a race's)."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    row_ptr = logits_ptr + row * stride_row
    logits = tl.load(row_ptr + cols * stride_col, mask=cols < vocab_size, other=-float("inf"))
    scores = logits
    if RACE:
        strides = (stride_temperature, stride_seed, stride_step)
        scores = _race_scores(logits, cols, row, temperature_ptr, seed_ptr, step_ptr, strides)
    best = tl.argmax(scores, 0, tie_break_left=True)
    slot = row * tl.num_programs(1) + chunk
    tl.store(values_ptr + slot, tl.max(scores, 0))
    tl.store(indices_ptr + slot, chunk * BLOCK + best)
    if STORE_MAX:
        tl.store(maxes_ptr + slot, tl.max(logits, 0))


@triton.jit
def _row_argmax_kernel(values_ptr, indices_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
    """Program per row: the first chunk holding the row's largest logit gives the index."""
    wait_for_previous_kernel()  # launched dependent (dependent_launch.py)
    let_next_kernel_start()
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    mask = chunks < num_chunks
    values = tl.load(values_ptr + row * num_chunks + chunks, mask=mask, other=-float("inf"))
    best = tl.argmax(values, 0, tie_break_left=True)
    index = tl.load(indices_ptr + row * num_chunks + best)
    tl.store(out_ptr + row, index.to(tl.int64))


_CHUNK_ARGMAX = OneVariantKernel(_chunk_argmax_kernel)
_ROW_ARGMAX = OneVariantKernel(_row_argmax_kernel)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 logits [B, V]: token ids [B], int64. A row of
    -inf only gives 0, as torch's does (NaN logits are not ordered: none reach here)."""
    return _two_passes(logits, None)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """``StepOps.sample_rows``: each row's token of float32 logits [B, V], int64 [B]; the
    argmax where its temperature [B] (float32) is 0, else the exponential race over the
    random numbers of its seed and step [B] (int64)."""
    return _two_passes(logits, (temperature, seed, step))


def _two_passes(
    logits: torch.Tensor, race: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    values, indices, _ = race_chunks(logits, race, store_max=False)
    num_rows, num_chunks = values.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _ROW_ARGMAX.launch(
        (num_rows,),
        logits.device,
        values,
        indices,
        out,
        num_chunks,
        triton.next_power_of_2(num_chunks),
        variant=num_chunks,
    )
    return out


def race_chunks(
    logits: torch.Tensor,
    race: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    store_max: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first pass over float32 logits [B, V] in chunks of ``CHUNK`` tokens: each chunk's
    largest logit, or race score where ``race`` gives the rows' temperature, seed and step,
    and its token, [B, chunks] each (float32, int32); with ``store_max``, each chunk's
    largest logit too (else None)."""
    num_rows, vocab_size = logits.shape
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    # New allocations, aligned as any the caching allocator makes: their pointers need no key.
    values = logits.new_empty(num_rows, num_chunks)
    indices = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    maxes = logits.new_empty(num_rows, num_chunks) if store_max else None
    stride_row, stride_col = logits.stride()
    # Without a race its row parameters are not read: any pointers do. With one they are
    # columns of a step's packed parameters (``sampling_tensors``): strided views.
    params = race if race is not None else (logits, logits, logits)
    param_strides = tuple(t.stride(0) for t in params)
    _CHUNK_ARGMAX.launch(
        (num_rows, num_chunks),
        logits.device,
        logits,
        values,
        indices,
        values if maxes is None else maxes,
        *params,
        vocab_size,
        stride_row,
        stride_col,
        *param_strides,
        CHUNK,
        race is not None,
        store_max,
        # Its integers whole, whether its pointers are aligned, whether it races and stores
        # the maxima: all Triton specializes on.
        variant=(
            vocab_size,
            stride_row,
            stride_col,
            param_strides,
            tuple(t.data_ptr() % 16 == 0 for t in (logits, *params)),
            race is not None,
            store_max,
        ),
    )
    return values, indices, maxes
