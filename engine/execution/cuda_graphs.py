"""CUDA graphs of uniform steps, captured at start-up at a ladder of batch sizes.

A decode step of a small model is hundreds of short kernels; launching them one by one
from Python costs more than running them. A graph replays the whole forward pass in
one launch. A uniform step has the same number of query tokens in every sequence: one for
a decode step, 1 + k for a speculative verify step (each request's last token and its
drafts, padded at the front to k drafts: ``engine.execution.batch.pad_verify``), so one graph per
batch size serves every mix of draft counts. Inputs live in static buffers that each step
fills by the backend's ``StepOps.fill_graph_inputs`` (the Triton backend's, one kernel:
between two graphs each launch leaves the device a gap); a batch is padded up to the next
captured size, its padding rows writing nowhere (slot -1) and reading one cached key. Each
graph records the attention backend's ``prepare`` with the forward pass, all of them
captured inside its ``graph_capture``. The decode and verify graphs share one memory pool:
steps run one at a time.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.backends import Backend
from engine.backends.attention import AttentionBackend, AttentionMetadata
from engine.execution.batch import StepInputs
from engine.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)

# Every 16 from 128 on: there a step's products are compute-bound, so each row of padding
# costs as much as a real one; smaller batches' steps are bound by the weights' bytes.
CAPTURE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, *range(144, 257, 16))
# Past one GPU's batch (tensor parallelism's larger max_num_seqs), coarser steps: each graph
# costs start-up time, and a step padded by up to 1/8 costs less than an eager one's launches.
CAPTURE_BATCH_SIZES += (320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def capture_forward(
    model: CausalLM,
    attention: AttentionBackend,
    args: tuple[torch.Tensor, AttentionMetadata, torch.Tensor],
    pool: tuple[int, int] | None,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of the backend's ``prepare`` and the model's forward pass over ``args``, in
    ``pool`` (None: a new one), and the logits it leaves. Run once first: Triton compiles
    outside the capture."""
    metadata = args[1]
    attention.prepare(metadata)
    model(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        attention.prepare(metadata)
        logits = model(*args)
    return graph, logits


def replay_once(graphs: dict[int, torch.cuda.CUDAGraph]) -> None:
    """Replay each graph (over its capture's padding, which writes nothing): the first
    replay uploads a graph to the device, which a request should not wait for."""
    for graph in graphs.values():
        graph.replay()


class StepGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: Backend,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        query_len: int = 1,
        pool: tuple[int, int] | None = None,
    ) -> None:
        """Capture graphs of steps of ``query_len`` tokens a sequence, in ``pool`` (another
        ``StepGraphs``' ``pool``; None: a new one), with ``backend``'s attention and input
        fills (the model's own)."""
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(device)
        self.query_len = q = query_len
        self.batch_sizes = [b for b in CAPTURE_BATCH_SIZES if b <= max_batch]
        self.num_replays = 0  # how many steps ran as a replay (tests count them)
        self.step_ops = backend.step_ops
        attention = backend.attention
        largest = self.batch_sizes[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.input_ids = buffer(largest * q)
        self.positions = buffer(largest * q)
        self.slot_mapping = buffer(largest * q)
        self.context_lens = buffer(largest)
        self.block_tables = buffer(largest, max_blocks)
        # What each replay fills, in ``fill_graph_inputs``' order.
        self.buffers = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.context_lens,
            self.block_tables,
        )
        # Read by every replay, so held here: a graph keeps addresses, not tensors alive.
        self.tokens = tokens = torch.arange(largest * q, device=device)
        self.seq_index = seq_index = tokens // q
        self.query_starts = query_starts = tokens[:largest] * q
        self.query_lens = query_lens = torch.full((largest,), q, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        with attention.graph_capture(largest):
            # Largest first, so the smaller graphs fit in the memory pool the largest made.
            for size in reversed(self.batch_sizes):
                num_tokens = size * q
                metadata = AttentionMetadata(
                    positions=self.positions[:num_tokens],
                    slot_mapping=self.slot_mapping[:num_tokens],
                    token_seq_index=seq_index[:num_tokens],
                    block_tables=self.block_tables[:size],
                    context_lens=self.context_lens[:size],
                    query_lens=query_lens[:size],
                    query_starts=query_starts[:size],
                    max_query_len=q,
                    uniform_queries=True,
                )
                # Every row padding: the capture writes nothing, and compiles the one
                # variant of the kernel that every replay launches.
                self.step_ops.fill_graph_inputs(self.buffers, size, q)
                # Logits at every token: the caller picks the real ones.
                args = (self.input_ids[:num_tokens], metadata, tokens[:num_tokens])
                graph, self.logits[size] = capture_forward(model, attention, args, pool)
                pool = graph.pool()
                self.graphs[size] = graph
            replay_once(self.graphs)
        self.pool = pool
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - started
        # What the graphs' pool (and buffers) took from the device, beyond what was reserved.
        self.reserved_bytes = torch.cuda.memory_reserved(device) - reserved
        logger.info(
            "captured CUDA graphs of %s for batch sizes %s in %.1f s (%.2f GiB more reserved)",
            "decode steps" if q == 1 else f"verify steps ({q} tokens a sequence)",
            self.batch_sizes,
            self.capture_seconds,
            self.reserved_bytes / 1024**3,
        )

    def replay_seconds(self, repeats: int = 5) -> dict[int, float]:
        """The device's seconds for one replay of each captured batch size, its rows all
        padding (which writes nothing, as at capture): what a step of that shape costs the
        device, for the speculation policy's first estimates (engine/speculative/step_costs.py).
        Synchronizes: at start-up only."""
        seconds = {}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for size, graph in self.graphs.items():
            self.step_ops.fill_graph_inputs(self.buffers, size, self.query_len)
            graph.replay()
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            end.synchronize()
            seconds[size] = start.elapsed_time(end) / 1000 / repeats
        return seconds

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.batch_sizes[-1]

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of a uniform step of ``query_len`` tokens a sequence, at its sampled
        tokens (``inputs.logits_index``), by graph replay."""
        assert inputs.uniform_query_len == self.query_len
        return self.replay(inputs.input_ids, inputs.metadata, inputs.logits_index)

    def replay(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata, logits_index: torch.Tensor
    ) -> torch.Tensor:
        """``run`` for a pass given by its parts (a draft model's passes build no
        ``StepInputs``): ``query_len`` tokens a sequence, logits at ``logits_index``."""
        count = metadata.context_lens.shape[0]
        num_tokens = count * self.query_len
        assert self.fits(count)
        size = next(b for b in self.batch_sizes if b >= count)
        step = (
            input_ids,
            metadata.positions,
            metadata.slot_mapping,
            metadata.context_lens,
            metadata.block_tables,
        )
        self.step_ops.fill_graph_inputs(self.buffers, size, self.query_len, step)
        self.graphs[size].replay()
        self.num_replays += 1
        logits = self.logits[size]
        if logits_index.shape[0] == num_tokens:  # every token sampled: a decode step
            return logits[:num_tokens]
        return logits[logits_index]

    def release(self) -> None:
        """Free the graphs. A graph that captured NCCL collectives must be gone before its
        process group closes: NCCL's teardown waits for it forever (pytorch#115388)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
