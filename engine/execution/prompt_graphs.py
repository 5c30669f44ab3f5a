"""CUDA graphs of steps that compute prompts: the chunks of a few sequences (``graph_seqs``),
captured at start-up at a ladder of token counts (``prompt_graph_lengths``).

A prompt step launched op by op is well over a hundred kernels from Python; for short
prompts their launches take the host longer than the kernels take the device, so an idle
engine's time to first token is the host's (``scripts/profile_step.py --model DIR --prefill
--context 128 --enforce-eager`` prints device kernel time against the wall time), and so is
a busy engine's step that admits prompts. A step that is not a uniform decode or verify
step (whole prompts, chunks after a cached prefix, a verify step's drafted rows, a few
decodes beside them: one-token sequences to the prefill kernel) replays the graph of the
least captured count that holds its tokens and whose sequences (``graph_seqs``) hold its
sequences and the positions it samples or scores:

- its tokens are padded up to the graph's count; the padding writes no cache slot
  (slot -1), belongs to no sequence, and nothing reads its rows;
- its sequences are padded up to the graph's with sequences of no tokens: the prefill
  kernel reads each one's length and start from the device (its grid covers every sequence
  and the captured token count), so a padding sequence's programs return at once;
- the graph computes the logits of as many rows as it has sequences, at indices read from a
  buffer.

A step of more decodes with prompts mixed in replays the decode graph for its decodes and
one of these for its prompts, where that pays (``engine.execution.mixed_steps``): one graph
per mix of decode rows and prompt tokens would multiply the graphs (and their logits
buffers) by the decode ladder's length. The graphs
share the decode graphs' memory pool (steps run one at a time).

Past ``ALWAYS_CAPTURED_TOKENS`` the ladder goes on only for a small model: one whose step of
that many tokens the device computes sooner than the host launches it op by op. A busy
engine's steps that admit prompts fill the step's token budget (8,192 by default); op by op
such a step is a few hundred launches from Python whatever its tokens, which for a model of
a few hundred million parameters takes the host well over the device's time for the step,
so every step that admits prompts waited on the host. For a larger model the device's time
hides the launches, and a graph would only add its padding tokens' products.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.backends.attention import AttentionBackend, AttentionMetadata
from engine.execution.batch import StepInputs, StepShape
from engine.execution.cuda_graphs import capture_forward, replay_once
from engine.models.causal_lm import CausalLM
from engine.roofline import ModelCost

logger = logging.getLogger(__name__)

# Doubling: a step pads to the next count. Past 512 a count is captured only where its step
# takes the device less time than the host's eager launches (``PROMPT_GRAPH_MAX_FLOPS``), so
# padding up to it still beats running op by op, and each graph costs start-up time.
PROMPT_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Counts captured for every model: a step this short takes the device less than its eager
# launches take the host, whatever the model.
ALWAYS_CAPTURED_TOKENS = 512
# Past them, a count is captured while a step of it computes at most this many FLOPs in its
# products: about 10 ms at an H100's or H200's bf16 product rate, under the host's time to
# launch a small model's prompt step op by op (``scripts/profile_step.py --prefill
# --enforce-eager`` prints the device's kernel time against the wall). On a GPU several
# times slower a step padded up to a count would take longer than those launches.
PROMPT_GRAPH_MAX_FLOPS = 8e12
# Sequences a graph computes at most, and logits rows: up to ALWAYS_CAPTURED_TOKENS, an
# idle engine's prompt or a busy one's prompt or two among a few decodes; past them, a step
# that fills the token budget, a dozen prompts or more (plus a chunk). Each padding sequence
# costs its programs' launch in the prefill kernel's grid (they return at once) and a
# logits row, which a short prompt's first token would wait for.
PROMPT_GRAPH_SEQS = 8
LARGE_PROMPT_GRAPH_SEQS = 32


def graph_seqs(length: int) -> int:
    """The sequences (and logits rows) the graph of ``length`` tokens computes at most."""
    return PROMPT_GRAPH_SEQS if length <= ALWAYS_CAPTURED_TOKENS else LARGE_PROMPT_GRAPH_SEQS


def least_graph(lengths: list[int], num_tokens: int, rows: int) -> int | None:
    """The least of the captured ``lengths`` whose graph holds ``num_tokens`` tokens and
    ``rows`` sequences and logits rows; None if none does."""
    return next((n for n in lengths if n >= num_tokens and graph_seqs(n) >= rows), None)


def prompt_graph_lengths(max_tokens: int, cost: ModelCost) -> list[int]:
    """The token counts whose prompt steps are captured: the ladder up to ``max_tokens`` (a
    step's budget), past ``ALWAYS_CAPTURED_TOKENS`` only while a step of the count stays
    within ``PROMPT_GRAPH_MAX_FLOPS`` (the layers' products and the experts' a token uses;
    under tensor parallelism a rank's share, which its device computes while its host
    launches as many kernels)."""

    def flops(tokens: int) -> int:
        return 2 * tokens * cost.layer_matmul_params + sum(cost.expert_flops(tokens))

    return [
        n
        for n in PROMPT_GRAPH_TOKENS
        if n <= max_tokens and (n <= ALWAYS_CAPTURED_TOKENS or flops(n) <= PROMPT_GRAPH_MAX_FLOPS)
    ]


class PromptGraphs:
    def __init__(
        self,
        model: CausalLM,
        attention: AttentionBackend,
        lengths: list[int],
        max_blocks: int,
        device: torch.device,
        pool: tuple[int, int] | None,
    ) -> None:
        """Capture graphs of prompt steps of each of ``lengths`` tokens (``prompt_graph_lengths``)
        in ``pool``."""
        started = time.perf_counter()
        self.lengths = lengths
        self.max_blocks = max_blocks
        self.num_replays = 0  # how many steps ran as a replay (tests count them)
        largest = self.lengths[-1]
        most_seqs = max(graph_seqs(length) for length in self.lengths)

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.input_ids = buffer(largest)
        self.positions = buffer(largest)
        self.slot_mapping = buffer(largest)
        self.seq_index = buffer(largest)
        self.block_tables = buffer(most_seqs, max_blocks)
        self.context_lens = buffer(most_seqs)
        self.query_lens = buffer(most_seqs)
        self.query_starts = buffer(most_seqs)
        self.logits_index = buffer(most_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        with attention.graph_capture(most_seqs):
            for length in reversed(self.lengths):  # largest first: the others fit its pool
                seqs = graph_seqs(length)
                metadata = AttentionMetadata(
                    positions=self.positions[:length],
                    slot_mapping=self.slot_mapping[:length],
                    token_seq_index=self.seq_index[:length],
                    block_tables=self.block_tables[:seqs],
                    context_lens=self.context_lens[:seqs],
                    query_lens=self.query_lens[:seqs],
                    query_starts=self.query_starts[:seqs],
                    max_query_len=length,  # the prefill kernel's grid; the real lengths are read
                )
                # Captured over one sequence of padding alone: nothing written.
                self._pad(0, length)
                self.query_lens.zero_()
                self.query_lens[0] = length
                self.context_lens.copy_(self.query_lens)
                args = (self.input_ids[:length], metadata, self.logits_index[:seqs])
                graph, self.logits[length] = capture_forward(model, attention, args, pool)
                pool = graph.pool()
                self.graphs[length] = graph
            replay_once(self.graphs)
        torch.cuda.synchronize(device)
        logger.info(
            "captured CUDA graphs of prompt steps of %s tokens (up to %d sequences, %d past %d "
            "tokens) in %.1f s",
            self.lengths,
            PROMPT_GRAPH_SEQS,
            LARGE_PROMPT_GRAPH_SEQS,
            ALWAYS_CAPTURED_TOKENS,
            time.perf_counter() - started,
        )

    def graph_for(self, shape: StepShape) -> int | None:
        """The token count of the graph that replays a step of ``shape``: the least that
        holds its tokens, sequences and logits rows (a decode among them is a one-token
        sequence to the prefill kernel); None for a uniform decode or verify step, or where
        none holds it."""
        if shape.uniform_query_len or shape.max_blocks > self.max_blocks:
            return None
        return least_graph(self.lengths, shape.num_tokens, max(shape.num_seqs, shape.num_logits))

    def fits(self, shape: StepShape) -> bool:
        """Whether a graph replays a step of ``shape`` (``graph_for``)."""
        return self.graph_for(shape) is not None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits (its sampled rows and scored positions), by graph replay."""
        shape = inputs.shape
        length = self.graph_for(shape)
        assert length is not None
        count, seqs = shape.num_tokens, shape.num_seqs
        metadata = inputs.metadata
        self.input_ids[:count].copy_(inputs.input_ids)
        self.positions[:count].copy_(metadata.positions)
        self.slot_mapping[:count].copy_(metadata.slot_mapping)
        self.seq_index[:count].copy_(metadata.token_seq_index)
        self.block_tables[:seqs, : shape.max_blocks].copy_(metadata.block_tables)
        self.context_lens[:seqs].copy_(metadata.context_lens)
        self.query_lens[:seqs].copy_(metadata.query_lens)
        self.query_starts[:seqs].copy_(metadata.query_starts)
        if seqs < graph_seqs(length):
            self.query_lens[seqs:].zero_()  # padding sequences: no tokens
        # Rows past the step's logits index token 0: a stale index could lie past this
        # graph's tokens.
        self.logits_index[: shape.num_logits].copy_(inputs.logits_index)
        self.logits_index[shape.num_logits :].zero_()
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
