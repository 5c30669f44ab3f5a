"""Embeddings (vLLM's pooling runner): a prompt run through the model, prefill only, its last
hidden states pooled (the last token's, the mean of all, or the first's: the checkpoint's
pooling, engine/checkpoint/pooling_config.py) and L2-normalized.

Pooling requests wait in a queue of their own, never in the scheduler: the decode steps pack,
sample and read exactly as they did. The engine runs a pooling step beside each generation
step while any wait (``LLMEngine.pool``): one eager forward pass over as many of their prompt
tokens as a step's token budget holds (a prompt longer than it goes in chunks, the way a
prefill does), through the same step packing and paged attention, into KV blocks taken from
the free ones for the prompt and given back once it is pooled. It takes no cached prefix and
keys none: a mean needs every position's hidden state, and nothing will decode after it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.checkpoint.pooling_config import CLS, LAST, MEAN
from engine.execution.model_runner import ModelRunner
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.request import Request
from protocol import Embedding, SamplingParams

# A pooling request's sampling parameters: it samples nothing, and the step packing reads
# only the prompt and the blocks of the request.
_NO_SAMPLING = SamplingParams(max_tokens=1)


@dataclass(eq=False)
class PoolingRequest:
    """One prompt to embed. ``sequence`` is its prompt as the step packing reads a request
    (its blocks, how much of it is computed); ``pooled`` what its chunks pooled so far: the
    sum of their hidden states (mean), or the first token's (cls)."""

    sequence: Request
    pooled: torch.Tensor | None = None

    @property
    def key(self) -> tuple[bytes, str]:
        return self.sequence.key


class Pooler:
    def __init__(
        self,
        runner: ModelRunner,
        block_manager: BlockManager,
        pooling: str,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        assert pooling in (LAST, MEAN, CLS)
        self.runner = runner
        self.block_manager = block_manager
        self.pooling = pooling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[PoolingRequest] = deque()  # oldest first, under way ones too

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add(self, client: bytes, request_id: str, prompt: list[int]) -> None:
        """Queue a prompt, checked by the engine (its tokens, its length)."""
        sequence = Request(client, request_id, list(prompt), _NO_SAMPLING, seed=0)
        self.waiting.append(PoolingRequest(sequence))

    def has(self, key: tuple[bytes, str]) -> bool:
        return any(request.key == key for request in self.waiting)

    def abort(self, key: tuple[bytes, str]) -> bool:
        """Drop a request and free its blocks; whether it was here."""
        for request in self.waiting:
            if request.key == key:
                self._remove(request)
                return True
        return False

    def abort_client(self, client: bytes) -> int:
        """Drop every request of ``client`` (a server that went away); how many."""
        dropped = [r for r in self.waiting if r.sequence.client == client]
        for request in dropped:
            self._remove(request)
        return len(dropped)

    def abort_all(self) -> list[tuple[bytes, str]]:
        """Drop every request (the engine stops); each one's client and id."""
        dropped = list(self.waiting)
        for request in dropped:
            self._remove(request)
        return [request.key for request in dropped]

    def step(self) -> list[tuple[bytes, Embedding]]:
        """Run one pooling step: the waiting prompts' next tokens, within the token budget;
        the embeddings of the prompts it completed, each with its client."""
        batch = self._schedule()
        if not batch:
            return []
        sequences = [request.sequence for request in batch]
        inputs = self.runner.step_inputs(sequences)
        hidden = self.runner.last_hidden_states(inputs).float()
        outputs = []
        start = 0
        for request in batch:
            sequence = request.sequence
            rows = hidden[start : start + sequence.num_scheduled_tokens]
            start += sequence.num_scheduled_tokens
            self._pool_chunk(request, rows)
            sequence.num_cached_tokens += sequence.num_scheduled_tokens
            if sequence.num_cached_tokens == sequence.num_tokens:
                outputs.append((sequence.client, self._finish(request)))
        return outputs

    def _schedule(self) -> list[PoolingRequest]:
        """The oldest waiting requests whose next chunks fit the token budget, each with
        ``num_scheduled_tokens`` set; a request starting takes the blocks of its whole prompt
        first, and waits (with those after it) while the free blocks are too few."""
        budget = self.max_num_batched_tokens
        batch: list[PoolingRequest] = []
        for request in self.waiting:
            if not budget or len(batch) == self.max_num_seqs:
                break
            sequence = request.sequence
            if not sequence.block_ids and not self.block_manager.reserve(
                sequence, sequence.num_tokens
            ):
                break
            sequence.num_scheduled_tokens = min(
                sequence.num_tokens - sequence.num_cached_tokens, budget
            )
            budget -= sequence.num_scheduled_tokens
            batch.append(request)
        return batch

    def _pool_chunk(self, request: PoolingRequest, rows: torch.Tensor) -> None:
        """Fold a chunk's hidden states [n, hidden] into what the request pooled so far."""
        if self.pooling == MEAN:
            total = rows.sum(dim=0)
            request.pooled = total if request.pooled is None else request.pooled + total
        elif self.pooling == CLS:
            if request.pooled is None:
                request.pooled = rows[0]
        else:  # LAST: the final chunk's last row, kept until then
            request.pooled = rows[-1]

    def _finish(self, request: PoolingRequest) -> Embedding:
        sequence = request.sequence
        pooled = request.pooled
        assert pooled is not None
        if self.pooling == MEAN:
            pooled = pooled / sequence.num_tokens
        embedding = torch.nn.functional.normalize(pooled, dim=0)
        self._remove(request)
        return Embedding(sequence.request_id, embedding.tolist(), sequence.num_tokens)

    def _remove(self, request: PoolingRequest) -> None:
        self.waiting.remove(request)
        self.block_manager.release(request.sequence)
