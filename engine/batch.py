"""A scheduled batch as one step's device inputs: packed on the host in numpy over the
whole batch (no loop over its tokens), moved in one copy.

``pack`` reads the requests and changes nothing in them; the model runner does the
bookkeeping of launching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress, repeat

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.request import Request
from engine.sampler import LogitBias, Penalties, SamplingTensors
from protocol import SamplingParams


@dataclass
class StepInputs:
    """One forward pass's inputs on the device, and the host's facts about them."""

    input_ids: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_index: torch.Tensor  # [R] int64: the packed tokens whose logits are sampled
    # The R requests those are the last tokens of: every one whose tokens are all computed
    # after this step (not a prompt's first chunks), in batch order.
    rows: list[Request]
    num_seqs: int

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token and samples the next: what a decode graph runs."""
        return self.metadata.max_query_len == 1 and len(self.rows) == self.num_seqs


def pack(
    batch: list[Request], block_size: int, device: torch.device, last_sampled: torch.Tensor
) -> StepInputs:
    """The scheduled tokens of ``batch`` and its cache layout on ``device``. A decode whose
    input is a token the step in flight sampled (pending) takes it from ``last_sampled``,
    that step's sampled ids, on the device."""
    seqs = len(batch)
    starts = np.fromiter((r.num_cached_tokens for r in batch), np.int64, seqs)
    query_lens = np.fromiter((r.num_scheduled_tokens for r in batch), np.int64, seqs)
    ends = starts + query_lens
    completes = ends == np.fromiter((r.num_tokens for r in batch), np.int64, seqs)
    query_ends = np.cumsum(query_lens)
    query_starts = query_ends - query_lens
    num_tokens = int(query_ends[-1])
    token_ids = np.fromiter(
        chain.from_iterable(r.scheduled_token_ids() for r in batch),
        np.int64,
        num_tokens,
    )
    token_seq_index = np.repeat(np.arange(seqs), query_lens)
    # Each token's position: its index in the packed batch, shifted by its sequence's offset.
    positions = np.arange(num_tokens) - np.repeat(query_starts - starts, query_lens)
    max_blocks = max(len(r.block_ids) for r in batch)
    block_tables = np.fromiter(
        chain.from_iterable(
            chain(r.block_ids, repeat(0, max_blocks - len(r.block_ids))) for r in batch
        ),
        np.int64,
        seqs * max_blocks,
    ).reshape(seqs, max_blocks)
    slot_mapping = (
        block_tables[token_seq_index, positions // block_size] * block_size + positions % block_size
    )
    logits_index = (query_ends - 1)[completes]
    # Decodes whose input is a pending token: where it goes in the packed batch, and where
    # it is in the last step's sampled tokens.
    source_rows = np.fromiter(
        (r.pending_row if r.num_pending_tokens else -1 for r in batch), np.int64, seqs
    )
    pending = source_rows >= 0
    host = np.concatenate(
        [
            token_ids,
            positions,
            slot_mapping,
            token_seq_index,
            ends,
            query_lens,
            query_starts,
            block_tables.ravel(),
            logits_index,
            query_starts[pending],
            source_rows[pending],
        ]
    )
    # Pinned, so the copy is asynchronous: the device may still be running the last step.
    host_t = torch.from_numpy(host)
    if device.type == "cuda":
        host_t = host_t.pin_memory()
    on_device = host_t.to(device, non_blocking=True)
    num_pending = int(pending.sum())
    sizes = [num_tokens] * 4 + [seqs] * 3 + [block_tables.size, logits_index.size]
    (
        input_ids,
        positions_t,
        slot_mapping_t,
        seq_index_t,
        context_lens,
        query_lens_t,
        query_starts_t,
        tables,
        logits_index_t,
        pending_index,
        pending_source,
    ) = on_device.split([*sizes, num_pending, num_pending])
    if num_pending:
        input_ids.index_copy_(0, pending_index, last_sampled[pending_source])
    metadata = AttentionMetadata(
        positions=positions_t,
        slot_mapping=slot_mapping_t,
        token_seq_index=seq_index_t,
        block_tables=tables.view(seqs, max_blocks),
        context_lens=context_lens,
        query_lens=query_lens_t,
        query_starts=query_starts_t,
        max_query_len=int(query_lens.max()),
    )
    rows = batch if completes.all() else list(compress(batch, completes.tolist()))
    return StepInputs(input_ids, metadata, logits_index_t, rows, seqs)


def sampling_tensors(
    rows: list[Request], vocab_size: int, device: torch.device
) -> SamplingTensors | None:
    """The sampling parameters of the requests sampled in a step, on the device; None when
    every one is greedy without penalties or bias, which needs none (no tensors, no copies)."""
    params = [r.sampling for r in rows]
    penalized = any(p.presence_penalty or p.frequency_penalty for p in params)
    biased = any(p.logit_bias_token_ids for p in params)
    if not (penalized or biased) and all(p.temperature == 0 for p in params):
        return None
    floats = torch.tensor(
        [(p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty) for p in params],
        dtype=torch.float32,
    ).to(device, non_blocking=True)
    ints = torch.tensor(
        [(p.top_k, r.seed, r.num_output_tokens) for p, r in zip(params, rows, strict=True)],
        dtype=torch.int64,
    ).to(device, non_blocking=True)
    penalties = None
    if penalized:
        counts = _output_token_counts(rows, vocab_size, device)
        penalties = Penalties(counts, floats[:, 2], floats[:, 3])
    return SamplingTensors(
        temperature=floats[:, 0],
        top_p=floats[:, 1],
        top_k=ints[:, 0],
        seed=ints[:, 1],
        step=ints[:, 2],
        any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
        penalties=penalties,
        logit_bias=_logit_bias(params, device) if biased else None,
    )


def _logit_bias(params: list[SamplingParams], device: torch.device) -> LogitBias:
    rows, token_ids = _ragged_to_device([p.logit_bias_token_ids for p in params], device)
    values = list(chain.from_iterable(p.logit_bias_values for p in params))
    values_t = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
    return LogitBias(rows, token_ids, values_t)


def _output_token_counts(
    rows: list[Request], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[B, V] float32: how often each request has generated each token."""
    row_index, tokens = _ragged_to_device([r.output_token_ids for r in rows], device)
    counts = torch.zeros(len(rows), vocab_size, device=device)
    ones = torch.ones_like(row_index, dtype=counts.dtype)
    return counts.index_put_((row_index, tokens), ones, True)


def _ragged_to_device(
    lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ints, one per row, as two flat int64 tensors on the device, moved in one
    copy: each item's row, and the items."""
    lengths = [len(items) for items in lists]
    total = sum(lengths)
    host = np.concatenate(
        [
            np.repeat(np.arange(len(lists)), lengths),
            np.fromiter(chain.from_iterable(lists), np.int64, total),
        ]
    )
    on_device = torch.from_numpy(host).to(device, non_blocking=True)
    rows, items = on_device.split([total, total])
    return rows, items
