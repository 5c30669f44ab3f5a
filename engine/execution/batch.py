"""A scheduled batch as one step's device inputs: packed on the host in numpy over the
whole batch (no loop over its tokens), moved in one copy.

``pack`` reads the requests and changes nothing in them; the model runner does the
bookkeeping of launching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress

import numpy as np
import torch

from engine.backends.attention import AttentionMetadata
from engine.backends.step_ops import StepOps
from engine.execution.host_to_device import pending_rows_and_sources, to_device
from engine.execution.pinned_inputs import PinnedInputs
from engine.execution.seen_tokens import SeenTokens
from engine.sampling.prompt_logprobs import ScoredPositions, scored_chunks
from engine.sampling.rejection_sampler import VerifyLayout
from engine.sampling.sampler import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    Penalties,
    SamplingTensors,
)
from engine.scheduling.request import Request

# The tokens of a row without a list, where a step packs every row's.
_NO_TOKENS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class StepShape:
    """The sizes a step's packed device buffer splits by: with the buffer, all a
    tensor-parallel worker needs to run the step's forward pass."""

    num_tokens: int
    num_seqs: int
    max_blocks: int  # the block tables' width
    num_logits: int  # R + D + C
    num_targets: int  # C
    max_query_len: int
    num_rows: int  # R + D: the logits rows sampled (D: the drafts they verify)
    # q when every sequence has q tokens, its last ones, and samples each real one: 1 for a
    # decode step, 1 + k for a verify step in the uniform layout (``pad_verify``); such a
    # step may replay a CUDA graph of q tokens a row. 0: any other step.
    uniform_query_len: int = 0
    # In any other step, how many sequences at the batch's front are decodes (the scheduler
    # puts them first): each computes one token, its last, sampled (one logits row each,
    # the first ones). Their attention is a decode's, and they may run as a decode step of
    # their own (``engine.execution.mixed_steps``).
    num_leading_decodes: int = 0

    def split(self, packed: torch.Tensor) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The input ids, attention metadata and logits index that ``packed`` holds; views."""
        tokens, seqs = self.num_tokens, self.num_seqs
        sizes = [tokens] * 4 + [seqs] * 3 + [seqs * self.max_blocks, self.num_logits]
        (
            input_ids,
            positions,
            slot_mapping,
            seq_index,
            context_lens,
            query_lens,
            query_starts,
            tables,
            logits_index,
        ) = packed[: sum(sizes)].split(sizes)
        metadata = AttentionMetadata(
            positions=positions,
            slot_mapping=slot_mapping,
            token_seq_index=seq_index,
            block_tables=tables.view(seqs, self.max_blocks),
            context_lens=context_lens,
            query_lens=query_lens,
            query_starts=query_starts,
            max_query_len=self.max_query_len,
            uniform_queries=self.uniform_query_len > 0,
            num_leading_decodes=self.num_leading_decodes,
        )
        return input_ids, metadata, logits_index

    @property
    def packed_size(self) -> int:
        tokens, seqs = self.num_tokens, self.num_seqs
        return 4 * tokens + seqs * (3 + self.max_blocks) + self.num_logits + self.num_targets


@dataclass
class StepInputs:
    """One forward pass's inputs on the device, and the host's facts about them."""

    input_ids: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    # [R + D + C] int64: the packed tokens whose logits are sampled (each row's last token
    # and, with speculative decoding, its D drafts in all), then those of the C prompt
    # positions scored for prompt log-probabilities.
    logits_index: torch.Tensor
    # The R requests those are the last tokens of: every one whose tokens are all computed
    # after this step (not a prompt's first chunks), in batch order. (Empty on a
    # tensor-parallel worker, which knows no requests.)
    rows: list[Request]
    scored: ScoredPositions | None  # None when no request wants prompt log-probabilities
    shape: StepShape
    # All of the above in one int64 buffer, pending tokens filled in: what a tensor-parallel
    # engine broadcasts to its workers.
    packed: torch.Tensor
    # Per row, how many drafts it verifies (its logits rows are 1 + that); None: no drafts.
    # (Only rank 0 reads it, to sample: a worker needs only the packed buffer.)
    num_drafts: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.shape.num_seqs

    @property
    def uniform_query_len(self) -> int:
        """See ``StepShape``: 1 for a decode step, 1 + k for a padded verify step, else 0."""
        return self.shape.uniform_query_len


def pack(
    batch: list[Request],
    block_size: int,
    device: torch.device,
    last_sampled: torch.Tensor,
    step_ops: StepOps,
    verify_query_len: int = 0,
    pinned: PinnedInputs | None = None,
) -> StepInputs:
    """The scheduled tokens of ``batch`` and its cache layout on ``device``, copied there in
    one copy (on CUDA through ``pinned``'s buffers). A decode whose input is a token the step
    in flight sampled (pending) takes it from ``last_sampled``, that step's sampled ids, on
    the device (``step_ops.fill_pending_tokens``: the backend's).

    With ``verify_query_len`` (speculative decoding: 1 + k), a step whose every request
    verifies drafts or decodes takes the uniform layout of ``pad_verify``."""
    seqs = len(batch)
    starts = np.fromiter((r.num_cached_tokens for r in batch), np.int64, seqs)
    query_lens = np.fromiter((r.num_scheduled_tokens for r in batch), np.int64, seqs)
    ends = starts + query_lens
    # A request's drafts are computed after all its tokens: past num_tokens.
    drafts = ends - np.fromiter((r.num_tokens for r in batch), np.int64, seqs)
    completes = drafts >= 0
    query_ends = np.cumsum(query_lens)
    query_starts = query_ends - query_lens
    num_tokens = int(query_ends[-1])
    # Decodes whose input is a pending token: where it is in the last step's sampled tokens.
    source_rows = np.fromiter(
        (r.pending_row if r.num_pending_tokens else -1 for r in batch), np.int64, seqs
    )
    pending = source_rows >= 0
    if num_tokens == seqs and pending.all():
        # Overlapped decode steps: every input is a token still on the device, filled in
        # there; none to read from the requests.
        token_ids = np.zeros(seqs, np.int64)
    else:
        token_ids = np.fromiter(
            chain.from_iterable(r.scheduled_token_ids() for r in batch),
            np.int64,
            num_tokens,
        )
    token_seq_index = np.repeat(np.arange(seqs), query_lens)
    # Each token's position: its index in the packed batch, shifted by its sequence's offset.
    positions = np.arange(num_tokens) - np.repeat(query_starts - starts, query_lens)
    tables = block_tables(batch)
    slot_mapping = tables[token_seq_index, positions // block_size] * block_size + (
        positions % block_size
    )
    logits_index = (query_ends - 1)[completes]
    speculating = bool((drafts > 0).any())
    if speculating:  # a row verifying drafts samples after its last token and each draft
        num_logits = (1 + drafts)[completes]
        row_starts = np.cumsum(num_logits) - num_logits
        logits_index = np.repeat(logits_index - num_logits + 1 - row_starts, num_logits)
        logits_index += np.arange(logits_index.size)
    chunks, scored_index, target_ids = scored_chunks(batch, starts, query_starts)
    # Where each sequence's first token is in the packed batch (a pending token's place).
    first_index = query_starts
    uniform_query_len = int(query_lens.max() == 1 and completes.all())
    # A verify step of decodes alone: every sequence computes its last token and drafts.
    if speculating and verify_query_len and not chunks and (query_lens == 1 + drafts).all():
        assert query_lens.max() <= verify_query_len
        token_index, token_ids, slot_mapping, positions = pad_verify(
            verify_query_len, ends, query_lens, query_starts, token_ids, slot_mapping
        )
        uniform_query_len = verify_query_len
        logits_index = token_index  # every real token is sampled
        first_index = token_index[query_starts]
        num_tokens = token_ids.size
        token_seq_index = np.repeat(np.arange(seqs), verify_query_len)
        query_lens = np.full(seqs, verify_query_len)
        query_starts = np.arange(seqs) * verify_query_len
    parts = [
        token_ids,
        positions,
        slot_mapping,
        token_seq_index,
        ends,
        query_lens,
        query_starts,
        tables.ravel(),
        logits_index,
        scored_index,
        target_ids,
        first_index[pending],
        source_rows[pending],
    ]
    if pinned is not None:  # asynchronous: the device may still be running the last step
        on_device = pinned.to_device(parts)
    else:
        on_device = torch.from_numpy(np.concatenate(parts)).to(device)
    num_pending = int(pending.sum())
    shape = StepShape(
        num_tokens=num_tokens,
        num_seqs=seqs,
        max_blocks=tables.shape[1],
        num_logits=logits_index.size + scored_index.size,
        num_targets=target_ids.size,
        max_query_len=int(query_lens.max()),
        num_rows=logits_index.size,
        uniform_query_len=uniform_query_len,
        num_leading_decodes=0 if uniform_query_len else _leading_decodes(query_lens, completes),
    )
    packed, pending_index, pending_source = on_device.split(
        [shape.packed_size, num_pending, num_pending]
    )
    input_ids, metadata, logits_index_t = shape.split(packed)
    if num_pending:
        step_ops.fill_pending_tokens(input_ids, pending_index, pending_source, last_sampled)
    rows = batch if completes.all() else list(compress(batch, completes.tolist()))
    scored = None
    if chunks:
        num_top = max(chunk.request.sampling.prompt_logprobs or 0 for chunk in chunks)
        target_ids_t = packed[shape.packed_size - shape.num_targets :]
        scored = ScoredPositions(chunks, target_ids_t, num_top)
    num_drafts = drafts[completes].tolist() if speculating else None
    return StepInputs(input_ids, metadata, logits_index_t, rows, scored, shape, packed, num_drafts)


def block_tables(batch: list[Request]) -> np.ndarray:
    """[seqs, max blocks] int64: each request's block ids, padded with block 0. Their arrays'
    buffers are joined in one copy: converting the ids one by one took most of a large
    decode batch's packing."""
    lengths = np.fromiter((len(r.block_ids) for r in batch), np.int64, len(batch))
    ids = np.frombuffer(b"".join(r.block_ids for r in batch), np.int64)
    width = int(lengths.max())
    if ids.size == len(batch) * width:
        return ids.reshape(len(batch), width)
    tables = np.zeros((len(batch), width), np.int64)
    tables[np.arange(width) < lengths[:, None]] = ids
    return tables


def _leading_decodes(query_lens: np.ndarray, completes: np.ndarray) -> int:
    """How many sequences at the front compute one token each, their last (a prompt's
    one-token chunk before its end is not a decode: it samples nothing)."""
    others = np.flatnonzero((query_lens != 1) | ~completes)
    return int(others[0]) if others.size else query_lens.size


def pad_verify(
    width: int,
    ends: np.ndarray,
    query_lens: np.ndarray,
    query_starts: np.ndarray,
    token_ids: np.ndarray,
    slot_mapping: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A verify step's packed tokens (each sequence's last token and drafts, query_lens of
    them, ending at position ``ends`` - 1) in the uniform layout: ``width`` (1 + k) tokens a
    sequence, at its last positions, so that one CUDA graph serves every mix of draft
    counts. The padding tokens come first, write no cache slot (-1), sit at the positions
    before the real ones (at least 0) and are never sampled. Returns each packed token's
    index in the new layout, and its token ids, cache slots and positions."""
    seqs = ends.size
    shift = np.arange(seqs) * width + width - query_lens - query_starts
    token_index = np.arange(token_ids.size) + np.repeat(shift, query_lens)
    padded_ids = np.zeros(seqs * width, np.int64)
    padded_ids[token_index] = token_ids
    padded_slots = np.full(seqs * width, -1, np.int64)
    padded_slots[token_index] = slot_mapping
    positions = np.maximum((ends - width)[:, None] + np.arange(width), 0).ravel()
    return token_index, padded_ids, padded_slots, positions


def verify_layout(rows: list[Request], num_drafts: list[int], device: torch.device) -> VerifyLayout:
    """Where a verify step's rows sample (``VerifyLayout``), each row with ``num_drafts`` of
    its drafts, on the device in one copy."""
    drafts = np.asarray(num_drafts, np.int64)
    num_positions = drafts + 1
    ends = np.cumsum(num_positions)
    starts = ends - num_positions
    total = int(ends[-1])
    # The positions before a row's last are its drafts', in order.
    before_last = np.ones(total, bool)
    before_last[ends - 1] = False
    next_drafts = np.full(total, -1, np.int64)
    next_drafts[before_last] = np.fromiter(
        chain.from_iterable(r.draft_token_ids for r in rows), np.int64, int(drafts.sum())
    )
    is_drafted = np.repeat(drafts > 0, num_positions)
    row_starts, plain_index, drafted_index, next_drafts_on_device = to_device(
        [starts, starts[drafts == 0], np.flatnonzero(is_drafted), next_drafts], device
    )
    return VerifyLayout(
        starts.tolist(),
        row_starts,
        plain_index,
        drafted_index,
        next_drafts_on_device,
        int(num_positions.max()),
    )


def sampling_tensors(
    rows: list[Request],
    device: torch.device,
    last_sampled: torch.Tensor,
    eos_token_ids: list[int],
    seen_tokens: SeenTokens,
) -> SamplingTensors | None:
    """The sampling parameters of the requests sampled in a step, on the device; None when
    every one is greedy with nothing to apply to its logits, which needs none (no tensors, no
    copies). A request's pending token (see ``pack``) is counted where the parameters look
    at the output so far, taken from ``last_sampled`` on the device: no step waits for it.
    ``seen_tokens``: the penalized requests' counts and prompts, kept from step to step."""
    params = [r.sampling for r in rows]
    shaping = [r for r in rows if r.shapes_logits]
    if not shaping and all(p.temperature == 0 for p in params):
        return None
    penalized = any(r.penalized for r in shaping)
    biased = any(r.sampling.logit_bias_token_ids for r in shaping)
    restricted = any(r.sampling.allowed_token_ids is not None for r in shaping)
    banning = any(
        r.sampling.bad_words_token_ids or r.num_output_tokens < r.sampling.min_tokens
        for r in shaping
    )
    min_p = any(r.sampling.min_p > 0 and r.sampling.temperature > 0 for r in shaping)
    floats = torch.tensor(
        [
            (
                p.temperature,
                p.top_p,
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
                p.min_p,
            )
            for p in params
        ],
        dtype=torch.float32,
    ).to(device, non_blocking=True)
    ints = torch.tensor(
        [(p.top_k, r.seed, r.num_output_tokens) for p, r in zip(params, rows, strict=True)],
        dtype=torch.int64,
    ).to(device, non_blocking=True)
    penalties = None
    if penalized:
        slots = seen_tokens.slots_of(rows, last_sampled)
        assert seen_tokens.counts is not None
        penalties = Penalties(seen_tokens.counts, floats[:, 2], floats[:, 3], slots=slots)
        if any(p.repetition_penalty != 1 for p in params):
            penalties.repetition = floats[:, 4]
            penalties.prompt_tokens = seen_tokens.prompt_tokens
    return SamplingTensors(
        temperature=floats[:, 0],
        top_p=floats[:, 1],
        top_k=ints[:, 0],
        seed=ints[:, 1],
        step=ints[:, 2],
        any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
        penalties=penalties,
        logit_bias=_logit_bias(rows, device) if biased else None,
        min_p=floats[:, 5] if min_p else None,
        allowed=_allowed_tokens(rows, device) if restricted else None,
        banned=_banned_tokens(rows, eos_token_ids, device, last_sampled) if banning else None,
    )


def _logit_bias(rows: list[Request], device: torch.device) -> LogitBias:
    row_ids, token_ids = _ragged_to_device([r.logit_bias_token_array for r in rows], device)
    values = np.concatenate([r.logit_bias_value_array for r in rows])
    values_t = torch.from_numpy(values).to(device, non_blocking=True)
    return LogitBias(row_ids, token_ids, values_t)


def _allowed_tokens(rows: list[Request], device: torch.device) -> AllowedTokens:
    arrays = [r.allowed_token_array for r in rows]
    restricted = torch.tensor([array is not None for array in arrays])
    row_ids, token_ids = _ragged_to_device([_NO_TOKENS if a is None else a for a in arrays], device)
    return AllowedTokens(restricted.to(device, non_blocking=True), row_ids, token_ids)


def _banned_tokens(
    rows: list[Request], eos_token_ids: list[int], device: torch.device, last_sampled: torch.Tensor
) -> BannedTokens:
    """The tokens each row may not sample now: EOS and its stop tokens while it has fewer
    than min_tokens output tokens, and the last token of each of its bad words, where the
    word's other tokens are its last output tokens."""
    eos = np.asarray(eos_token_ids, np.int64)
    stops = [
        np.concatenate([r.stop_token_array, eos])
        if r.num_output_tokens < r.sampling.min_tokens
        else _NO_TOKENS
        for r in rows
    ]
    words = [(row, word) for row, r in enumerate(rows) for word in r.sampling.bad_words_token_ids]
    prefix_lengths = np.fromiter((len(word) - 1 for _, word in words), np.int64, len(words))
    num_prefix_tokens = int(prefix_lengths.sum())
    width = int(prefix_lengths.max(initial=0))
    # A prefix is right-aligned in ``recent``: its token i of L at column width - L + i.
    ends = np.cumsum(prefix_lengths)
    prefix_columns = np.arange(num_prefix_tokens) + np.repeat(width - ends, prefix_lengths)
    recent = np.full((len(rows), width), -2, np.int64)
    if width:
        for row, request in enumerate(rows):
            # A pending last token is filled in on the device.
            known = width - request.num_pending_tokens
            tail = request.output_token_ids[-known:] if known else []
            recent[row, known - len(tail) : known] = tail
    # The stops first, then the words.
    stop_rows = np.repeat(np.arange(len(rows)), [stop.size for stop in stops])
    pending_rows, sources = pending_rows_and_sources(rows)
    # BannedTokens' rows, token ids, prefix tokens, words and columns, in its fields' order.
    *entries, recent_t, pending_t, sources_t = to_device(
        [
            np.concatenate([stop_rows, np.fromiter((row for row, _ in words), np.int64)]),
            np.concatenate([*stops, np.fromiter((word[-1] for _, word in words), np.int64)]),
            np.fromiter(chain.from_iterable(w[:-1] for _, w in words), np.int64, num_prefix_tokens),
            np.repeat(np.arange(len(words)), prefix_lengths),
            prefix_columns,
            recent.ravel(),
            pending_rows,
            sources,
        ],
        device,
    )
    recent_t = recent_t.view(len(rows), width)
    if width and pending_rows.size:
        recent_t[:, -1].index_copy_(0, pending_t, last_sampled[sources_t])
    return BannedTokens(*entries, recent_t, stop_rows.size)


def _ragged_to_device(
    arrays: list[np.ndarray], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 arrays, one per row, as two flat int64 tensors on the device, moved in one
    copy: each item's row, and the items."""
    lengths = [array.size for array in arrays]
    rows, items = to_device(
        [np.repeat(np.arange(len(arrays)), lengths), np.concatenate(arrays)], device
    )
    return rows, items
