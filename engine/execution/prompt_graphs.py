"""CUDA graphs of one sequence's prompt chunk, captured at start-up at a ladder of lengths.

An idle engine's first token waits for its prompt's forward pass, which launched op by op
is well over a hundred kernels from Python; for a short prompt their launches take the host
longer than the kernels take the device, so the time to first token of a short prompt is
the host's (``scripts/profile_step.py --model DIR --prefill --context 128 --enforce-eager``
prints device kernel time against the wall time). A step that computes the tokens of one
sequence alone (a whole prompt, or a chunk of one after a cached prefix), at most
``PROMPT_GRAPH_TOKENS[-1]`` of them, and samples at most its last one, replays a graph
instead:

- its tokens are padded up to the next captured length; the padding writes no cache slot
  (slot -1) and the prefill kernel, which reads the real length from the device, masks
  it out of attention;
- the graph computes the logits of one row, at an index read from a buffer.

Steps of several sequences, or with decodes mixed in, stay op by op: their host time
overlaps the device's work, and they would need a graph per mix. The graphs share the
decode graphs' memory pool (steps run one at a time).
"""

from __future__ import annotations

import logging
import time

import torch

from engine.backends.attention import AttentionBackend, AttentionMetadata
from engine.execution.batch import StepInputs, StepShape
from engine.execution.cuda_graphs import capture_forward, replay_once
from engine.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)

PROMPT_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)


class PromptGraphs:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        max_tokens: int,
        max_blocks: int,
        device: torch.device,
        pool: tuple[int, int] | None,
    ) -> None:
        """Capture graphs of one sequence's steps of up to ``max_tokens`` tokens (the
        lengths of the ladder up to it) in ``pool``."""
        started = time.perf_counter()
        self.lengths = [n for n in PROMPT_GRAPH_TOKENS if n <= max_tokens]
        self.max_blocks = max_blocks
        self.num_replays = 0  # how many steps ran as a replay (tests count them)
        largest = self.lengths[-1]

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.input_ids = buffer(largest)
        self.positions = buffer(largest)
        self.slot_mapping = buffer(largest)
        self.seq_index = buffer(largest)  # one sequence: all 0
        self.block_tables = buffer(1, max_blocks)
        self.context_lens = buffer(1)
        self.query_lens = buffer(1)
        self.query_starts = buffer(1)  # 0
        self.logits_index = buffer(1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        with attention.graph_capture(1):
            for length in reversed(self.lengths):  # largest first: the others fit its pool
                metadata = AttentionMetadata(
                    positions=self.positions[:length],
                    slot_mapping=self.slot_mapping[:length],
                    token_seq_index=self.seq_index[:length],
                    block_tables=self.block_tables,
                    context_lens=self.context_lens,
                    query_lens=self.query_lens,
                    query_starts=self.query_starts,
                    max_query_len=length,  # the prefill kernel's grid; the real length is read
                )
                self._pad(0, length)  # captured over padding alone: nothing written
                self.context_lens.fill_(length)
                self.query_lens.fill_(length)
                args = (self.input_ids[:length], metadata, self.logits_index)
                graph, self.logits[length] = capture_forward(model, attention, args, pool)
                pool = graph.pool()
                self.graphs[length] = graph
            replay_once(self.graphs)
        torch.cuda.synchronize(device)
        logger.info(
            "captured CUDA graphs of one sequence's prompt steps of %s tokens in %.1f s",
            self.lengths,
            time.perf_counter() - started,
        )

    def fits(self, shape: StepShape) -> bool:
        """One sequence's tokens (not a uniform decode or verify step), at most the largest
        length, at most one logits row."""
        return (
            shape.num_seqs == 1
            and not shape.uniform_query_len
            and shape.num_tokens <= self.lengths[-1]
            and shape.num_logits <= 1
            and shape.max_blocks <= self.max_blocks
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits (its one sampled row, or none), by graph replay."""
        shape = inputs.shape
        assert self.fits(shape)
        count = shape.num_tokens
        length = next(n for n in self.lengths if n >= count)
        metadata = inputs.metadata
        self.input_ids[:count].copy_(inputs.input_ids)
        self.positions[:count].copy_(metadata.positions)
        self.slot_mapping[:count].copy_(metadata.slot_mapping)
        self.block_tables[:, : shape.max_blocks].copy_(metadata.block_tables)
        self.context_lens.copy_(metadata.context_lens)
        self.query_lens.copy_(metadata.query_lens)
        if shape.num_logits:
            self.logits_index.copy_(inputs.logits_index)
        if count < length:
            self._pad(count, length)
        self.graphs[length].replay()
        self.num_replays += 1
        return self.logits[length][: shape.num_logits]

    def release(self) -> None:
        """Free the graphs (see ``StepGraphs.release``)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()

    def _pad(self, start: int, end: int) -> None:
        """Padding tokens: no cache slot, position 0, token 0."""
        self.slot_mapping[start:end].fill_(-1)
        self.positions[start:end].zero_()
        self.input_ids[start:end].zero_()
