"""Draft-model proposals: a smaller model of the same tokenizer, in the engine's process,
guesses each request's next k tokens greedily; the target verifies them in one step
(``rejection_sampler.py``), so the output is the target's whatever the draft guesses.

The draft has its own paged KV cache with as many blocks as the target's, addressed by the
same block tables: a request's block holds the target's K/V in the target's cache and the
draft's in the draft's, so the block manager hands out one set of blocks for both (the
engine sizes the memory for the two caches together). A request's
``num_draft_cached_tokens`` says how many of its first tokens the draft's cache holds:
only tokens the request has, never drafts, so rejected drafts need no roll-back here (their
slots are written again before anything reads them), and a preemption, which frees the
blocks, starts it over at 0 (``BlockManager.release``). A block the draft has filled stays
marked so in the block manager until it is handed out for other tokens, so a request that
takes a cached prefix starts the draft after the part of it the draft holds.

Proposing for a batch is k forward passes of the draft over every drafting request at once:
one over the tokens its cache lacks (after a verify step, the accepted drafts and the token
after them; a request's prompt the first time, past what a cached prefix brings, chunked by
the step's token budget; its last token again when its drafts were dropped unverified),
whose last logits give the first draft, then k - 1 one-token decode steps, each taking the
last step's argmax on the device. The attention metadata of all k passes is packed on the
host in numpy and moved in one copy; the drafts come back in one copy at the end.

On CUDA the passes replay CUDA graphs (``engine/execution/cuda_graphs.py``), captured at start-up
up to the batch the target's verify graphs reach: a draft of 30 layers launched op by op
took longer than the target's whole step. The decode passes are uniform (one token a row).
The catch-up is made uniform too: after a verify step a row lacks 1 to k + 1 tokens, so it
starts k + 1 tokens before its end, recomputing the K/V of tokens its cache holds (the
same values written again); a batch with a longer catch-up (a prompt) runs op by op.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.backends.attention import AttentionMetadata
from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.distributed.parallel import SINGLE
from engine.execution.batch import block_tables
from engine.execution.cuda_graphs import StepGraphs
from engine.execution.host_to_device import to_device
from engine.execution.model_runner import (
    allocate_kv_cache,
    kv_bytes_per_token,
    load_model,
    max_speculative_batch,
    quantized_config,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from engine.execution.warm_up import compile_eager_attention
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.request import Request
from protocol import SamplingParams


class DraftVocabularyError(ValueError):
    """The draft's tokens are not the target's: its drafts would mean other text."""


def check_same_vocabulary(draft: Checkpoint, target: Checkpoint) -> None:
    """Refuse a draft whose vocabulary (size or tokenizer's tokens) differs from the target's."""
    sizes = (draft.config.vocab_size, target.config.vocab_size)
    if sizes[0] != sizes[1]:
        raise DraftVocabularyError(
            f"the draft model {draft.name} has a vocabulary of {sizes[0]} tokens and the target "
            f"{target.name} {sizes[1]}: a draft model must share the target's tokenizer"
        )
    vocabularies = [
        Tokenizer.from_str(c.tokenizer.tokenizer_json).get_vocab(with_added_tokens=True)
        for c in (draft, target)
    ]
    if vocabularies[0] != vocabularies[1]:
        different = sorted(set(vocabularies[0].items()) ^ set(vocabularies[1].items()))[:3]
        raise DraftVocabularyError(
            f"the draft model {draft.name}'s tokenizer differs from the target {target.name}'s "
            f"(e.g. {different}): a draft model must share the target's tokenizer"
        )


class DraftModelProposer:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        target: Checkpoint,
        max_model_len: int,
    ) -> None:
        """Load the draft from ``checkpoint`` on the configured device and dtype (before the
        target's cache is sized, so that its weights count as used); ``bind`` then gives it
        its cache."""
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "a draft model runs on the engine's own GPU only: --speculative-model needs "
                f"--tensor-parallel-size 1 (not {config.tensor_parallel_size})"
            )
        if config.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        check_same_vocabulary(checkpoint, target)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.device = torch.device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.dtype = dtype
        self.max_num_seqs = config.max_num_seqs
        # A backend of its own, the configured one, as the target's runner has: its passes
        # and graphs run that backend's kernels only.
        self.model, self.backend, _ = load_model(
            config,
            quantized_config(config, checkpoint, self.device),
            checkpoint,
            self.device,
            dtype,
            max_model_len,
        )
        self.kv_bytes_per_token = kv_bytes_per_token(checkpoint.config, self.kv_dtype, SINGLE)
        self.block_manager: BlockManager | None = None
        self.max_model_len = max_model_len
        self.graphed = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.backend.attention.supports_cuda_graphs
        )
        self.max_graph_batch = max_speculative_batch(config)
        # Captured by warm_up: the catch-up (1 + k tokens a row) and decode passes' graphs.
        self.catch_up_graphs: StepGraphs | None = None
        self.decode_graphs: StepGraphs | None = None

    def bind(self, block_manager: BlockManager) -> None:
        """Allocate the draft's cache: as many blocks as ``block_manager`` hands out."""
        allocate_kv_cache(
            self.model,
            block_manager.num_blocks,
            block_manager.block_size,
            self.kv_dtype,
            self.device,
        )
        self.block_manager = block_manager

    def warm_up(self) -> None:
        """Run each kind of draft pass once, a catch-up over a prompt and the decode passes,
        so that no request waits for their kernels to compile or load. Its one fake request's
        every block is block 0, as in ``engine/execution/warm_up.py``: what it writes there is
        overwritten before it is read (the draft reads only the tokens it cached itself)."""
        assert self.block_manager is not None, "bind() first"
        prompt_len = 37  # beyond a block, as the engine's warm-up
        request = Request(b"", "draft-warm-up", [1] * prompt_len, SamplingParams(), seed=0)
        positions = prompt_len + self.num_speculative_tokens
        request.block_ids = array("q", [0]) * self.block_manager.blocks_for(positions)
        self._run([(request, 0, prompt_len)], [self.num_speculative_tokens])
        # Its eager passes (past the graphs, or all where there are none) attend as a mixed
        # step's decodes: one query a sequence, of any batch.
        compile_eager_attention(
            self.model,
            self.backend.attention,
            self.dtype,
            [1],
            self.max_num_seqs,
            self.max_model_len,
        )
        if self.graphed and self.max_graph_batch >= 1:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The passes' graphs, in one memory pool of their own (the target's graphs' logits
        are still being read when the draft runs next)."""
        assert self.block_manager is not None
        max_blocks = -(-self.max_model_len // self.block_manager.block_size)
        args = (self.model, self.backend, self.max_graph_batch, max_blocks, self.device)
        self.catch_up_graphs = StepGraphs(*args, query_len=1 + self.num_speculative_tokens)
        if self.num_speculative_tokens > 1:
            self.decode_graphs = StepGraphs(*args, pool=self.catch_up_graphs.pool)

    @torch.inference_mode()
    def propose(
        self, requests: list[Request], max_drafts: list[int]
    ) -> tuple[list[list[int]], list[int]]:
        """Up to ``min(num_speculative_tokens, max_drafts[i])`` greedy draft tokens after each
        request's tokens (all read by the host); none for a request whose catch-up the
        step's token budget cut short (it goes on next step) or whose drafts find no free
        block. The drafts' keys are all 0: one source."""
        manager = self.block_manager
        assert manager is not None, "bind() first"
        # Each drafting row: its request, the tokens its cache lacks [start, end), its drafts.
        rows: list[tuple[Request, int, int]] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        for request, limit in zip(requests, max_drafts, strict=True):
            count = min(self.num_speculative_tokens, limit)
            if count < 1 or not budget or not manager.reserve(request, request.num_tokens):
                continue
            # A request new to the draft may hold a cached prefix the draft computed before.
            # Its last token is computed again if the draft holds it already: its logits give
            # the first draft, and drafts dropped unverified (a step of prompts alone skipped
            # its decode) leave a request with no token since its last proposal.
            start = min(
                request.num_draft_cached_tokens or manager.draft_filled_tokens(request),
                request.num_tokens - 1,
            )
            end = min(request.num_tokens, start + budget)
            budget -= end - start
            if end < request.num_tokens:
                count = 0  # a chunk of its catch-up only
            elif count > 1 and not manager.reserve(request, end + count - 1):
                count = 1  # the first draft needs no new slot
            rows.append((request, start, end))
            counts.append(count)
        drafts: dict[int, list[int]] = {}
        if rows:
            for row, tokens in zip(rows, self._run(rows, counts), strict=True):
                request, start, end = row
                drafts[id(request)] = tokens
                request.num_draft_cached_tokens = end
                manager.mark_draft_filled(request, start, end)
        return [drafts.get(id(request), []) for request in requests], [0] * len(requests)

    def preview(self, request: Request) -> None:
        """Unknown until the draft runs: whether it guesses right is the target's to say."""
        return None

    def _run(self, rows: list[tuple[Request, int, int]], counts: list[int]) -> list[list[int]]:
        """The draft passes over ``rows``; each row's first ``counts[i]`` drafts."""
        assert self.block_manager is not None
        block_size = self.block_manager.block_size
        starts = np.fromiter((start for _, start, _ in rows), np.int64, len(rows))
        ends = np.fromiter((end for _, _, end in rows), np.int64, len(rows))
        num_drafts = np.asarray(counts, np.int64)
        drafting = num_drafts > 0
        width = max(int(num_drafts.max()), 1)
        # After verify steps, every row's catch-up fits the graph's 1 + k tokens.
        catch_up_len = 1 + self.num_speculative_tokens
        catch_up_graphs = self.catch_up_graphs
        if catch_up_graphs is not None and not (
            catch_up_graphs.fits(len(rows))
            and (ends - starts <= catch_up_len).all()
            and (ends >= catch_up_len).all()
        ):
            catch_up_graphs = None
        if catch_up_graphs is not None:
            starts = ends - catch_up_len
        tables = block_tables([request for request, _, _ in rows])
        # The catch-up pass: each row's missing tokens, prefill-shaped.
        query_lens = ends - starts
        query_ends = np.cumsum(query_lens)
        query_starts = query_ends - query_lens
        num_tokens = int(query_ends[-1])
        seq_index = np.repeat(np.arange(len(rows)), query_lens)
        positions = np.arange(num_tokens) - np.repeat(query_starts - starts, query_lens)
        token_ids = np.concatenate(
            [
                np.asarray(request.token_ids_between(start, end), np.int64)
                for (request, _, _), start, end in zip(
                    rows, starts.tolist(), ends.tolist(), strict=True
                )
            ]
        )
        slots = _slots(tables, seq_index, positions, block_size)
        logits_index = (query_ends - 1)[drafting]
        parts = [
            token_ids,
            positions,
            slots,
            seq_index,
            ends,
            query_lens,
            query_starts,
            tables.ravel(),
            logits_index,
            np.flatnonzero(drafting),
        ]
        # The decode passes: the drafting rows, draft j at position end - 1 + j. A row with
        # fewer drafts (room, blocks) idles past them: it computes its last token's position
        # again and stores nothing (slot -1); what it drafts there is dropped.
        decode_tables = tables[drafting]
        decode_ends = ends[drafting]
        decode_counts = num_drafts[drafting]
        num_decoding = decode_ends.size
        decode_rows = np.arange(num_decoding)
        for j in range(1, width):
            kept = j < decode_counts
            decode_positions = np.where(kept, decode_ends - 1 + j, decode_ends - 1)
            decode_slots = _slots(decode_tables, decode_rows, decode_positions, block_size)
            decode_slots[~kept] = -1
            parts += [decode_positions, decode_slots, decode_positions + 1]
        device_parts = to_device(parts, self.device)
        (
            token_ids_t,
            positions_t,
            slots_t,
            seq_index_t,
            ends_t,
            query_lens_t,
            query_starts_t,
            tables_t,
            logits_index_t,
            drafting_t,
        ) = device_parts[:10]
        tables_t = tables_t.view(tables.shape)
        metadata = AttentionMetadata(
            positions=positions_t,
            slot_mapping=slots_t,
            token_seq_index=seq_index_t,
            block_tables=tables_t,
            context_lens=ends_t,
            query_lens=query_lens_t,
            query_starts=query_starts_t,
            max_query_len=int(query_lens.max()),
            uniform_queries=catch_up_graphs is not None,
        )
        draft_tokens = torch.empty(num_decoding, width, dtype=torch.int64, device=self.device)
        draft_tokens[:, 0] = self._greedy(token_ids_t, metadata, logits_index_t, catch_up_graphs)
        decode_graphs = self.decode_graphs
        if decode_graphs is not None and not decode_graphs.fits(num_decoding):
            decode_graphs = None
        decode_tables_t = tables_t[drafting_t]
        ones = torch.ones(num_decoding, dtype=torch.int64, device=self.device)
        decode_rows_t = torch.arange(num_decoding, device=self.device)
        for j in range(1, width):
            decode_parts = device_parts[7 + 3 * j : 10 + 3 * j]
            decode_positions_t, decode_slots_t, context_lens_t = decode_parts
            metadata = AttentionMetadata(
                positions=decode_positions_t,
                slot_mapping=decode_slots_t,
                token_seq_index=decode_rows_t,
                block_tables=decode_tables_t,
                context_lens=context_lens_t,
                query_lens=ones,
                query_starts=decode_rows_t,
                max_query_len=1,
                uniform_queries=True,
            )
            draft_tokens[:, j] = self._greedy(
                draft_tokens[:, j - 1], metadata, decode_rows_t, decode_graphs
            )
        tokens = iter(draft_tokens.tolist())  # the one synchronization
        return [next(tokens)[:count] if count else [] for count in counts]

    def _greedy(
        self,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        logits_index: torch.Tensor,
        graphs: StepGraphs | None,
    ) -> torch.Tensor:
        """The draft's likeliest next token after each of ``logits_index``'s positions, by
        replaying ``graphs`` (None: op by op)."""
        if graphs is not None:
            return graphs.replay(input_ids, metadata, logits_index).argmax(dim=-1)
        self.backend.attention.prepare(metadata)
        return self.model(input_ids, metadata, logits_index).argmax(dim=-1)


def _slots(
    tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Each token's flat cache slot: its row's block for its position, and the offset."""
    return tables[rows, positions // block_size] * block_size + positions % block_size
