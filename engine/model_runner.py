"""Owns the model and its KV cache on one device; turns a scheduled batch into next tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import chain, compress, repeat

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache, TorchPagedAttention
from engine.checkpoint import Checkpoint
from engine.cuda_graphs import DecodeGraphs
from engine.layer_ops import LayerOps, TorchLayerOps
from engine.models import build_model
from engine.request import Request
from engine.sampler import LogitBias, Penalties, SamplingTensors, sample, token_logprobs
from protocol import SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class SampledTokens:
    """A step's result: the requests whose prompts are now computed (all of the batch but
    those with only a chunk of their prompt done), each one's next token and, for those
    that asked, its log-probabilities (None for the others; None for all if none asked)."""

    requests: list[Request]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; its results reach host memory by an
    asynchronous copy that ``copied`` marks done (None: the copy was synchronous)."""

    batch: list[Request]
    rows: list[Request]  # the sampled ones, in the order of the results
    host_results: list[torch.Tensor]  # token ids [B]; with logprobs, also values and ids
    logprobs_asked: list[int | None] | None  # per row; None when no row asked
    copied: torch.cuda.Event | None

    def result(self) -> SampledTokens:
        """Wait for the results and read them: the step's one synchronization."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.logprobs_asked is None:
            return SampledTokens(self.rows, self.host_results[0].tolist(), None)
        _, values, ids = (t.tolist() for t in self.host_results)
        logprobs = [
            None if k is None else TokenLogprobs(row[0], row_ids[1 : k + 1], row[1 : k + 1])
            for k, row, row_ids in zip(self.logprobs_asked, values, ids, strict=True)
        ]
        return SampledTokens(self.rows, [row_ids[0] for row_ids in ids], logprobs)


@dataclass
class CacheConfig:
    block_size: int
    num_blocks: int


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU, where bf16 matmuls are slow."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def select_backend(device: torch.device) -> tuple[AttentionBackend, LayerOps]:
    """The attention and layer implementations for a device; the only place that chooses."""
    if device.type == "cuda":
        # Imported here: importing the kernels without CUDA would select Triton's interpreter.
        from engine.triton_backend import TritonLayerOps, TritonPagedAttention

        return TritonPagedAttention(), TritonLayerOps()
    return TorchPagedAttention(), TorchLayerOps()


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.config = checkpoint.config
        started = time.perf_counter()
        model = build_model(
            checkpoint.config, *select_backend(device), max_model_len, device, dtype
        )
        model.load_weights(checkpoint.weights())
        self.model = model.eval()
        logger.info(
            "loaded %s on %s (%s) in %.1f s",
            checkpoint.name,
            device,
            str(dtype).removeprefix("torch."),
            time.perf_counter() - started,
        )
        self.block_size = 0
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None
        self._last_sampled = torch.empty(0, dtype=torch.int64, device=device)

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        c = self.config
        shape = (cache.num_blocks, cache.block_size, c.num_key_value_heads, c.head_dim)
        # Zeroed, not empty: the reference attention reads whole blocks and masks what lies
        # past a sequence's end, and a masked NaN from uninitialized memory still poisons it.
        layers = [
            LayerKVCache(
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.model.bind_kv_cache(layers)
        self.block_size = cache.block_size

    @torch.inference_mode()
    def measure_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        """Peak memory a forward pass over ``num_tokens`` new tokens (one prefill, logits of
        the last ``num_logits``) allocates beyond the weights: what sizing the KV cache must
        leave free. CUDA only. The pass writes no cache slot and reads one scratch block,
        so it needs no real cache (the scratch block stays bound until ``allocate_kv_cache``);
        it also compiles the prefill kernels."""
        c = self.config
        block_size = 16
        shape = (1, block_size, c.num_key_value_heads, c.head_dim)
        scratch = LayerKVCache(
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
        )
        self.model.bind_kv_cache([scratch] * c.num_hidden_layers)

        def ints(*values: int) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        zeros = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        metadata = AttentionMetadata(
            positions=torch.arange(num_tokens, device=self.device),
            slot_mapping=torch.full_like(zeros, -1),
            token_seq_index=zeros,
            block_tables=torch.zeros(
                1, -(-num_tokens // block_size), dtype=torch.int64, device=self.device
            ),
            context_lens=ints(num_tokens),
            query_lens=ints(num_tokens),
            query_starts=ints(0),
            max_query_len=num_tokens,
        )
        logits_index = torch.arange(max(num_tokens - num_logits, 0), num_tokens, device=self.device)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model(zeros, metadata, logits_index)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # what the pass cached is free for the KV cache again
        return peak

    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch: int) -> None:
        """Record the decode step as CUDA graphs; call once the cache is allocated."""
        max_blocks = -(-self.max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, max_batch, max_blocks, self.device)

    @torch.inference_mode()
    def launch(self, batch: list[Request]) -> LaunchedStep:
        """Queue one forward pass over ``batch`` and the sampling of each complete row's next
        token (and its log-probabilities where asked), without waiting for the device. The
        sampled tokens count as pending in their requests until the host reads them, and the
        next step may take them as its inputs on the device."""
        input_ids, metadata, logits_index, rows = self._prepare_inputs(batch)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and metadata.max_query_len == 1
            and len(rows) == len(batch)
            and graphs.fits(len(batch))
        ):
            logits = graphs.run(input_ids, metadata)
        else:
            logits = self.model(input_ids, metadata, logits_index)
        if not rows:  # only prompt chunks: nothing to sample yet
            return LaunchedStep(batch, [], [torch.empty(0, dtype=torch.int64)], None, None)
        next_tokens = sample(logits, self._prepare_sampling(rows))
        self._last_sampled = next_tokens
        for row, request in enumerate(rows):
            request.num_pending_tokens += 1
            request.pending_row = row
        asked = [r.sampling.logprobs for r in rows]
        results = [next_tokens]
        if any(k is not None for k in asked):
            num_top = max(k for k in asked if k is not None)
            chosen, top_logprobs, top_ids = token_logprobs(logits, next_tokens, num_top)
            results.append(torch.cat([chosen.unsqueeze(1), top_logprobs], dim=1))
            results.append(torch.cat([next_tokens.unsqueeze(1), top_ids], dim=1))
        host_results, copied = self._copy_to_host(results)
        logprobs_asked = asked if len(results) > 1 else None
        return LaunchedStep(batch, rows, host_results, logprobs_asked, copied)

    def _copy_to_host(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Start copying ``tensors`` into (pinned) host memory; the event marks them there."""
        if self.device.type != "cuda":
            return tensors, None
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        copied = torch.cuda.Event()
        copied.record()
        return host, copied

    def _prepare_inputs(
        self, batch: list[Request]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, list[Request]]:
        """Pack the scheduled tokens of the batch and its cache layout on the host, in numpy
        over the whole batch, and move them in one copy. Also returns the rows to sample:
        those whose every token is computed after this step (not a prompt's first chunks)."""
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
            block_tables[token_seq_index, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        logits_index = (query_ends - 1)[completes]
        # Decodes whose input is a token the step in flight sampled: where it goes in the
        # packed batch, and where it is in that step's sampled tokens.
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
        if self.device.type == "cuda":
            host_t = host_t.pin_memory()
        device = host_t.to(self.device, non_blocking=True)
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
        ) = device.split([*sizes, num_pending, num_pending])
        if num_pending:
            input_ids.index_copy_(0, pending_index, self._last_sampled[pending_source])
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
        for request in batch:
            request.num_cached_tokens += request.num_scheduled_tokens
        rows = batch if completes.all() else list(compress(batch, completes.tolist()))
        return input_ids, metadata, logits_index_t, rows

    def _prepare_sampling(self, batch: list[Request]) -> SamplingTensors | None:
        """The batch's sampling parameters on the device; None when every row is greedy
        without penalties, which needs none (no tensors built, no copies)."""
        params = [r.sampling for r in batch]
        penalized = any(p.presence_penalty or p.frequency_penalty for p in params)
        biased = any(p.logit_bias_token_ids for p in params)
        if not (penalized or biased) and all(p.temperature == 0 for p in params):
            return None
        floats = torch.tensor(
            [(p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty) for p in params],
            dtype=torch.float32,
        ).to(self.device, non_blocking=True)
        ints = torch.tensor(
            [(p.top_k, r.seed, r.num_output_tokens) for p, r in zip(params, batch, strict=True)],
            dtype=torch.int64,
        ).to(self.device, non_blocking=True)
        penalties = None
        if penalized:
            penalties = Penalties(self._output_token_counts(batch), floats[:, 2], floats[:, 3])
        return SamplingTensors(
            temperature=floats[:, 0],
            top_p=floats[:, 1],
            top_k=ints[:, 0],
            seed=ints[:, 1],
            step=ints[:, 2],
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            penalties=penalties,
            logit_bias=self._logit_bias(params) if biased else None,
        )

    def _logit_bias(self, params: list[SamplingParams]) -> LogitBias:
        rows, token_ids = self._ragged_to_device([p.logit_bias_token_ids for p in params])
        values = list(chain.from_iterable(p.logit_bias_values for p in params))
        values_t = torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)
        return LogitBias(rows, token_ids, values_t)

    def _output_token_counts(self, batch: list[Request]) -> torch.Tensor:
        """[B, V] float32: how often each request has generated each token."""
        rows, tokens = self._ragged_to_device([r.output_token_ids for r in batch])
        counts = torch.zeros(len(batch), self.config.vocab_size, device=self.device)
        return counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=counts.dtype), True)

    def _ragged_to_device(self, lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
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
        device = torch.from_numpy(host).to(self.device, non_blocking=True)
        rows, items = device.split([total, total])
        return rows, items
