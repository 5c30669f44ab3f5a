"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): which positions of a step score
prompt tokens, and their results taken into the requests.

The logits at position j score prompt token j + 1, so a prefill chunk over positions
[s, e) of a P-token prompt scores tokens s + 1 to min(e, P - 1); the last position's logits
are the first output token's. Those positions' logits come out of the same forward pass as
the sampled rows' (their packed indices follow the sampled ones). A request wanting them
takes no cached prefix (engine/scheduling/block_manager.py) and prefills at most max_num_seqs of
them a step (engine/scheduling/scheduler.py); its chunks are read in order, and what a chunk
computed again after a preemption repeats is dropped, so each token's entry reaches the request
once. A request's output of each step sends the entries read in it: a chunk short of the
prompt's end, which samples no token, has an output with no new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.scheduling.request import Request
from protocol import PromptTokenLogprobs


@dataclass
class ScoredChunk:
    """The prompt tokens one request's chunk of a step scores."""

    request: Request
    first_token: int  # index in the prompt of the first token scored
    count: int


@dataclass
class ScoredPositions:
    """A step's scored prompt positions: their chunks, in the order of their logits rows
    (after the sampled rows), the tokens they score on the device, and how many likeliest
    alternatives the step reads (the most any of its requests asked)."""

    chunks: list[ScoredChunk]
    target_ids: torch.Tensor  # [C] int64
    num_top: int


def scored_chunks(
    batch: list[Request], starts: np.ndarray, query_starts: np.ndarray
) -> tuple[list[ScoredChunk], np.ndarray, np.ndarray]:
    """The chunks of ``batch`` that score prompt tokens, the packed indices of their
    positions, and the tokens those score (both int64, in the chunks' order)."""
    chunks: list[ScoredChunk] = []
    indices: list[np.ndarray] = []
    targets: list[list[int]] = []
    for i, request in enumerate(batch):
        if request.sampling.prompt_logprobs is None or not request.needs_prompt_logprobs:
            continue
        start = int(starts[i])
        end = min(start + request.num_scheduled_tokens, len(request.prompt_token_ids) - 1)
        if end <= start:
            continue
        chunks.append(ScoredChunk(request, start + 1, end - start))
        indices.append(query_starts[i] + np.arange(end - start))
        targets.append(request.prompt_token_ids[start + 1 : end + 1])
    if not chunks:
        return [], np.empty(0, np.int64), np.empty(0, np.int64)
    flat_targets = np.fromiter((t for chunk in targets for t in chunk), np.int64)
    return chunks, np.concatenate(indices), flat_targets


def read_scored(
    chunks: list[ScoredChunk], values: list[list[float]], ids: list[list[int]]
) -> list[tuple[ScoredChunk, list[PromptTokenLogprobs]]]:
    """Each chunk's entries from the host rows of ``prompt_token_logprobs``: ``values`` holds
    each position's log-probability then the likeliest ones', ``ids`` its rank then theirs;
    each request gets as many alternatives as it asked."""
    results = []
    row = 0
    for chunk in chunks:
        k = chunk.request.sampling.prompt_logprobs or 0
        rows = zip(values[row : row + chunk.count], ids[row : row + chunk.count], strict=True)
        entries = [PromptTokenLogprobs(v[0], i[0], i[1 : k + 1], v[1 : k + 1]) for v, i in rows]
        results.append((chunk, entries))
        row += chunk.count
    return results


def take_scored(request: Request, first_token: int, entries: list[PromptTokenLogprobs]) -> None:
    """Add to the request's unsent prompt log-probabilities what ``entries``, from
    ``first_token`` on, adds to those read so far (of tokens 1, 2, ...)."""
    skip = request.num_scored_prompt_tokens + 1 - first_token
    assert skip >= 0, "a chunk of prompt log-probabilities was skipped"
    new_entries = entries[skip:]
    request.unsent_prompt_logprobs.extend(new_entries)
    request.num_scored_prompt_tokens += len(new_entries)


def take_unsent(request: Request) -> list[PromptTokenLogprobs] | None:
    """The prompt log-probabilities the request's next output carries (None: none)."""
    unsent = request.unsent_prompt_logprobs
    if not unsent:
        return None
    request.unsent_prompt_logprobs = []
    return unsent
