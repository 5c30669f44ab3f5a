"""CUDA graphs of the decode step, captured at start-up at a ladder of batch sizes.

A decode step of a small model is hundreds of short kernels; launching them one by one
from Python costs more than running them. A graph replays the whole forward pass in
one launch. Inputs live in static buffers that each step fills; a batch is padded up
to the next captured size, its padding rows writing nowhere (slot -1) and reading one
cached key. Each graph records the attention backend's ``prepare`` with the forward pass,
all of them captured inside its ``graph_capture``.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)

CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
    ) -> None:
        started = time.perf_counter()
        self.batch_sizes = [b for b in CAPTURE_BATCH_SIZES if b <= max_batch]
        largest = self.batch_sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.input_ids = buffer(largest)
        self.positions = buffer(largest)
        self.slot_mapping = buffer(largest)
        self.context_lens = buffer(largest)
        self.block_tables = buffer(largest, max_blocks)
        # Read by every replay, so held here: a graph keeps addresses, not tensors alive.
        self.steps = steps = torch.arange(largest, device=device)
        self.ones = ones = torch.ones(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        with attention.graph_capture(largest):
            # Largest first, so the smaller graphs fit in the memory pool the largest made.
            for size in reversed(self.batch_sizes):
                metadata = AttentionMetadata(
                    positions=self.positions[:size],
                    slot_mapping=self.slot_mapping[:size],
                    token_seq_index=steps[:size],
                    block_tables=self.block_tables[:size],
                    context_lens=self.context_lens[:size],
                    query_lens=ones[:size],
                    query_starts=steps[:size],
                    max_query_len=1,
                )
                self._pad(0, size)
                args = (self.input_ids[:size], metadata, steps[:size])
                # Warm-up: Triton compiles and autotunes outside the capture.
                attention.prepare(metadata)
                model(*args)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    attention.prepare(metadata)
                    self.logits[size] = model(*args)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.batch_sizes,
            time.perf_counter() - started,
        )

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits of a decode step (one new token per sequence) by graph replay."""
        count = input_ids.shape[0]
        size = next(b for b in self.batch_sizes if b >= count)
        width = metadata.block_tables.shape[1]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(metadata.positions)
        self.slot_mapping[:count].copy_(metadata.slot_mapping)
        self.context_lens[:count].copy_(metadata.context_lens)
        self.block_tables[:count, :width].copy_(metadata.block_tables)
        self._pad(count, size)
        self.graphs[size].replay()
        return self.logits[size][:count]

    def _pad(self, start: int, end: int) -> None:
        """Padding rows: write no cache slot, attend to one key of block 0."""
        self.slot_mapping[start:end].fill_(-1)
        self.context_lens[start:end].fill_(1)
        self.positions[start:end].zero_()
        self.input_ids[start:end].zero_()
        self.block_tables[start:end, 0].zero_()
