"""Owns one device: the model on it, its KV cache and the CUDA graphs of decode and verify
steps; turns each scheduled batch into next tokens.

Built from the engine's config and a checkpoint, it sizes everything device-bound itself
(the memory left for the cache, the cache, the graphs) and reports the result: how many KV
blocks there are and the context length they allow. Under tensor parallelism every rank
runs one (``engine.tensor_parallel``): the engine's own, rank 0, packs each step, sends it
to the others (``send_step``) and samples; a worker's runs only the forward passes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.backends import Backend, create_backend
from engine.backends.attention import AttentionMetadata, LayerKVCache
from engine.checkpoint import Checkpoint
from engine.distributed.parallel import SINGLE, TensorParallel
from engine.execution.batch import StepInputs, pack, sampling_tensors, verify_layout
from engine.execution.cuda_graphs import CAPTURE_BATCH_SIZES, StepGraphs
from engine.execution.mixed_steps import is_mixed, split_mixed_step, splits_mixed_steps
from engine.execution.pinned_inputs import PinnedInputs
from engine.execution.prompt_graphs import PromptGraphs, prompt_graph_lengths
from engine.execution.seen_tokens import SeenTokens, seen_token_table_bytes
from engine.model_config import ModelConfig
from engine.models import build_model
from engine.models.causal_lm import CausalLM
from engine.models.gpt_oss import check_mxfp4_experts
from engine.quantization.linear_methods import resolve_quantization
from engine.roofline import ModelCost
from engine.sampling.prompt_logprobs import ScoredChunk, ScoredPositions, read_scored
from engine.sampling.rejection_sampler import (
    VerifyLayout,
    position_sampling_tensors,
)
from engine.sampling.sampler import prompt_token_logprobs, sample, token_logprobs
from engine.scheduling.request import Request
from protocol import PromptTokenLogprobs, TokenLogprobs

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.config import EngineConfig
    from engine.sampling.structured_output import GrammarBitmask

logger = logging.getLogger(__name__)


@dataclass
class SampledTokens:
    """A step's result: the requests whose prompts are now computed (all of the batch but
    those with only a chunk of their prompt done), each one's new tokens (its next one; with
    speculative decoding, its accepted drafts and one more) and, for those that asked, their
    log-probabilities (None for the others; None for all if none asked); and the prompt
    log-probabilities its chunks scored, per chunk."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None
    prompt_logprobs: list[tuple[ScoredChunk, list[PromptTokenLogprobs]]]


@dataclass
class ForwardedStep:
    """A step whose forward pass is queued on the device: the logits of its sampled rows,
    then those of its scored prompt positions."""

    batch: list[Request]
    rows: list[Request]  # the requests whose tokens are all computed after it, in batch order
    logits: torch.Tensor  # [len(rows) + D + C, V] float32
    scored: ScoredPositions | None  # the C prompt positions; None when none is scored
    num_drafts: list[int] | None  # per row, the drafts it verifies (D in all); None: none
    uniform_query_len: int  # StepShape's: 1 a decode step, 1 + k a verify step, 0 other


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; its results reach host memory by an
    asynchronous copy that ``copied`` marks done (None: the copy was synchronous)."""

    batch: list[Request]
    rows: list[Request]  # the sampled ones, in the order of the results
    # Token ids [P], one per sampled position; when drafts were verified, how many of its
    # positions' tokens each row emits [R]; with logprobs, the positions' values and ids
    # [P, 1 + k]; with scored prompt positions, their values and ranks-and-ids [C, 1 + k].
    host_results: list[torch.Tensor]
    logprobs_asked: list[int | None] | None  # per row; None when no row asked
    scored: list[ScoredChunk]
    copied: torch.cuda.Event | None
    # Each row's first position when drafts were verified; None: one position a row.
    row_starts: list[int] | None = None

    @property
    def verifies_drafts(self) -> bool:
        """Whether its rows emit 1 to 1 + k tokens each, known only once it is read."""
        return self.row_starts is not None

    def result(self) -> SampledTokens:
        """Wait for the results and read them: the step's one synchronization."""
        if self.copied is not None:
            self.copied.synchronize()
        token_ids, *rest = (t.tolist() for t in self.host_results)
        if self.row_starts is None:  # one position a row
            spans = None
            tokens = [[token] for token in token_ids]
        else:
            counts, *rest = rest
            spans = [(start, start + n) for start, n in zip(self.row_starts, counts, strict=True)]
            tokens = [token_ids[start:end] for start, end in spans]
        logprobs = None
        if self.logprobs_asked is not None:
            values, ids, *rest = rest

            def at(position: int, k: int) -> TokenLogprobs:
                top = slice(1, k + 1)
                return TokenLogprobs(values[position][0], ids[position][top], values[position][top])

            if spans is None:
                logprobs = [
                    None if k is None else [at(row, k)] for row, k in enumerate(self.logprobs_asked)
                ]
            else:
                logprobs = [
                    None if k is None else [at(p, k) for p in range(start, end)]
                    for k, (start, end) in zip(self.logprobs_asked, spans, strict=True)
                ]
        prompt_logprobs = read_scored(self.scored, *rest) if self.scored else []
        return SampledTokens(self.rows, tokens, logprobs, prompt_logprobs)


# The largest verify step captured as a CUDA graph (larger ones run eagerly), in requests and
# in tokens. Each graph keeps its own [batch * (1 + k), vocab] float32 logits in the graph
# pool, so the verify ladder's sum over batch sizes costs 1 + k times the decode graphs'
# (Gemma 3's 262k vocab, k = 4, the whole ladder up to 256: 6.6 GB; up to 64: 1 GB); and
# speculation pays at small batches, where a large one keeps the device busy anyway
# (--speculative-disable-by-batch-size). The tokens' limit, 64 requests at k = 8, keeps a
# larger k's graphs in that memory (k = 16: up to 32 requests).
MAX_VERIFY_GRAPH_BATCH = 64
MAX_VERIFY_GRAPH_TOKENS = 64 * 9


def max_speculative_batch(config: EngineConfig) -> int:
    """The most requests a step drafts for, as far as CUDA graphs go: steps verify drafts
    only while fewer requests run than --speculative-disable-by-batch-size."""
    limit = config.speculative_disable_by_batch_size
    if limit:
        return min(limit - 1, config.max_num_seqs)
    fits = MAX_VERIFY_GRAPH_TOKENS // (1 + config.num_speculative_tokens)
    largest = max((b for b in CAPTURE_BATCH_SIZES if b <= fits), default=1)
    return min(largest, MAX_VERIFY_GRAPH_BATCH, config.max_num_seqs)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` is the model's dtype; ``fp8`` float8 e4m3, which attention reads directly."""
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU, where bf16 matmuls are slow."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def rank_device(device: str, tp: TensorParallel) -> torch.device:
    """Rank r of a tensor-parallel group runs on GPU r (of those visible)."""
    if device == "cuda" and tp.size > 1:
        return torch.device("cuda", tp.rank)
    return torch.device(device)


def quantized_config(
    config: EngineConfig, checkpoint: Checkpoint, device: torch.device, tp_size: int = 1
) -> ModelConfig:
    """The checkpoint's model config with the quantization its linear layers will have:
    --quantization's, or the checkpoint's own (pre-quantized); --quantization mxfp4 refused
    where it cannot keep the experts as published over ``tp_size`` ranks."""
    check_mxfp4_experts(config.quantization, checkpoint, tp_size)
    quantization = resolve_quantization(config.quantization, checkpoint.config.quantization, device)
    return dataclasses.replace(checkpoint.config, quantization=quantization)


def load_model(
    config: EngineConfig,
    model_config: ModelConfig,
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    model_len: int,
    tp: TensorParallel = SINGLE,
) -> tuple[CausalLM, Backend, float]:
    """The checkpoint's model (rank ``tp.rank``'s part) on ``device`` with the configured
    backend (``--backend``; every device op of the model and of its steps is the backend's),
    as ``model_config`` describes it (the checkpoint's, with the quantization resolved), RoPE
    tables for ``model_len`` positions; the backend; the seconds it took."""
    backend = create_backend(config.backend, device)
    started = time.perf_counter()
    model = build_model(model_config, backend, model_len, device, dtype, tp)
    if config.load_format == "dummy":
        model.load_random_weights()
    else:
        model.load_weights(checkpoint.weight_slices())
    load_seconds = time.perf_counter() - started
    quantization = model_config.quantization
    logger.info(
        "loaded %s%s on %s (%s%s) in %.1f s",
        checkpoint.name,
        f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else "",
        device,
        str(dtype).removeprefix("torch."),
        "" if quantization is None else f", {quantization.method} linear layers",
        load_seconds,
    )
    return model.eval(), backend, load_seconds


def kv_bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype, tp: TensorParallel) -> int:
    """The bytes one token's K and V take in a rank's cache, over all layers."""
    num_kv_heads = tp.kv_heads(config.num_key_value_heads)[1]
    return 2 * config.num_hidden_layers * num_kv_heads * config.head_dim * kv_dtype.itemsize


def allocate_kv_cache(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
) -> None:
    """Give ``model`` a paged cache of ``num_blocks`` blocks (a rank's share of its heads)."""
    c = model.config
    num_kv_heads = tp.kv_heads(c.num_key_value_heads)[1]
    shape = (num_blocks, block_size, num_kv_heads, c.head_dim)
    # Zeroed, not empty: the reference attention reads whole blocks and masks what lies
    # past a sequence's end, and a masked NaN from uninitialized memory still poisons it.
    layers = [
        LayerKVCache(
            torch.zeros(shape, dtype=kv_dtype, device=device),
            torch.zeros(shape, dtype=kv_dtype, device=device),
        )
        for _ in range(c.num_hidden_layers)
    ]
    model.bind_kv_cache(layers)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        tp: TensorParallel = SINGLE,
        send_step: Callable[[StepInputs], None] | None = None,
        extra_kv_bytes_per_token: int = 0,
    ) -> None:
        """Load the model (rank ``tp.rank``'s part of it), size and allocate the KV cache,
        capture the decode graphs. ``send_step``, on rank 0 of several, hands each step's
        inputs to the other ranks before its forward pass.

        ``num_kv_blocks`` and ``max_model_len`` are then the cache's size and the longest
        sequence it serves: ``config.max_model_len``, which must fit in the cache, or else
        the model's own, capped by what the cache holds. Every rank comes to the same."""
        self.tp = tp
        self.send_step = send_step
        self.device = rank_device(config.device, tp)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.model_config = quantized_config(config, checkpoint, self.device, tp.size)
        self.num_kv_heads = tp.kv_heads(checkpoint.config.num_key_value_heads)[1]
        # Not to be sampled before a request's min_tokens, with its stop tokens.
        self.eos_token_ids = list(checkpoint.tokenizer.eos_token_ids)
        self.block_size = config.block_size
        # RoPE tables cover this length, the cap below being known only once the model
        # is loaded and measured.
        model_len = config.max_model_len or checkpoint.config.max_position_embeddings
        self.model, self.backend, self.load_seconds = load_model(
            config, self.model_config, checkpoint, self.device, self.dtype, model_len, tp
        )
        self.extra_kv_bytes_per_token = extra_kv_bytes_per_token
        self.captures_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.backend.attention.supports_cuda_graphs
        )
        # What a step of the model reads and computes (under tensor parallelism, a rank's
        # share): the prompt graphs' ladder and the mixed steps' split go by it.
        self.model_cost = ModelCost.of_model(self.model, self.kv_dtype)
        # Known before the cache is sized: the largest one's activations stay in the graphs'
        # pool.
        self.prompt_graph_lengths = (
            prompt_graph_lengths(config.max_num_batched_tokens, self.model_cost)
            if self.captures_graphs
            else []
        )
        self.num_kv_blocks = self._num_kv_blocks(config, model_len)
        capacity = self.num_kv_blocks * self.block_size
        if config.max_model_len is None:
            model_len = min(model_len, capacity)
        elif config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache's {capacity} tokens; "
                "give the cache more memory or lower max_model_len"
            )
        self.max_model_len = model_len
        allocate_kv_cache(
            self.model, self.num_kv_blocks, self.block_size, self.kv_dtype, self.device, tp
        )
        # With speculative decoding, a verify step of decodes alone has 1 + k tokens a
        # sequence, padded (engine.execution.batch.pad_verify): it may replay a graph too.
        speculative = config.speculation is not None
        self.verify_query_len = 1 + config.num_speculative_tokens if speculative else 0
        self.pinned_inputs = PinnedInputs(self.device) if self.device.type == "cuda" else None
        self.decode_graphs: StepGraphs | None = None
        self.verify_graphs: StepGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        if self.captures_graphs:
            self._capture_graphs(config.max_num_seqs, max_speculative_batch(config))
        elif self.device.type == "cuda" and not config.enforce_eager:
            logger.info(
                "decode steps run eagerly: the %s backend cannot run in CUDA graphs",
                self.backend.name,
            )
        self.split_mixed_steps = splits_mixed_steps(
            config.split_mixed_steps, self.decode_graphs is not None, self.model_cost
        )
        self.num_split_steps = 0  # mixed steps run as two passes (tests count them)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
            self.num_kv_blocks,
            self.block_size,
            capacity,
            self.max_model_len,
        )
        self._last_sampled = torch.empty(0, dtype=torch.int64, device=self.device)
        # The penalized requests' counts and prompts (made by the first penalized step).
        self.seen_tokens = SeenTokens(
            config.max_num_seqs, self.model_config.vocab_size, self.device
        )
        # Rank 0 samples; the other ranks' processes start faster without the grammar
        # library (and transformers, which it imports).
        self.grammar_bitmask: GrammarBitmask | None = None
        if tp.rank == 0:
            from engine.sampling.structured_output import GrammarBitmask

            self.grammar_bitmask = GrammarBitmask(
                config.max_num_seqs,
                checkpoint.config.vocab_size,
                self.device,
                self.backend.step_ops,
            )

    def _num_kv_blocks(self, config: EngineConfig, model_len: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        # The ranks' caches hold the same blocks: as many as the fullest GPU has room for.
        return self.tp.min_over_ranks(self._kv_blocks_that_fit(config, model_len), self.device)

    def _kv_blocks_that_fit(self, config: EngineConfig, model_len: int) -> int:
        kv_bytes = kv_bytes_per_token(self.model_config, self.kv_dtype, self.tp)
        per_block = (kv_bytes + self.extra_kv_bytes_per_token) * self.block_size
        if config.kv_cache_memory_gb is not None:
            budget = int(config.kv_cache_memory_gb * 1024**3)
        elif self.device.type == "cuda":
            # Leave room for the largest step's activations, measured by running one.
            step_tokens = min(config.max_num_batched_tokens, model_len)
            activations = self._measure_activation_bytes(step_tokens, config.max_logits_rows)
            if self.prompt_graph_lengths:
                # The prompt graphs' pool keeps their largest step's activations apart from
                # the eager steps' (the caching allocator's): about its share of those measured.
                graphed = min(self.prompt_graph_lengths[-1], step_tokens)
                activations += activations * graphed // step_tokens
            # And for the penalties' tables on rank 0, which samples: the first penalized
            # request makes them while the engine serves (Qwen2.5's generation config
            # penalizes every request).
            tables = 0
            if self.tp.rank == 0:
                tables = seen_token_table_bytes(config.max_num_seqs, self.model_config.vocab_size)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # our weights and anything else on the GPU
            budget = int(total * config.gpu_memory_utilization) - used - activations - tables
            logger.info(
                "warm-up step of %d tokens: %.2f GiB of activations, %.2f GiB of penalties' "
                "tables; %.2f GiB for the KV cache",
                step_tokens,
                activations / 1024**3,
                tables / 1024**3,
                budget / 1024**3,
            )
        else:
            budget = 1024**3
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes)")
        return num_blocks

    @torch.inference_mode()
    def _measure_activation_bytes(self, num_tokens: int, num_logits: int) -> int:
        """Peak memory a forward pass over ``num_tokens`` new tokens (one prefill, logits of
        the last ``num_logits``) allocates beyond the weights: what sizing the KV cache must
        leave free. CUDA only. The pass writes no cache slot and reads one scratch block,
        so it needs no real cache (the scratch block stays bound until the cache is
        allocated); it also compiles the prefill kernels."""
        c = self.model_config
        block_size = 16
        shape = (1, block_size, self.num_kv_heads, c.head_dim)
        scratch = LayerKVCache(
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
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
        self.backend.attention.prepare(metadata)
        self.model(zeros, metadata, logits_index)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # what the pass cached is free for the KV cache again
        return peak

    @torch.inference_mode()
    def _capture_graphs(self, max_batch: int, max_verify_batch: int) -> None:
        """Record the decode step, with speculative decoding the verify step (of up to
        ``max_verify_batch`` sequences), and the prompt steps of up to a few sequences
        (``prompt_graphs.py``), as CUDA graphs;
        the cache must be allocated. The verify graphs first: their steps are the larger,
        and the decode graphs fit in the memory pool they made. (Each graph keeps its
        logits in the pool: the verify graphs' take 1 + k times the decode graphs' memory
        at the same batch sizes.)"""
        max_blocks = -(-self.max_model_len // self.block_size)
        args = (self.model, self.backend)
        pool = None
        if self.verify_query_len and max_verify_batch >= 1:
            self.verify_graphs = StepGraphs(
                *args, max_verify_batch, max_blocks, self.device, self.verify_query_len
            )
            pool = self.verify_graphs.pool
        self.decode_graphs = StepGraphs(*args, max_batch, max_blocks, self.device, pool=pool)
        if self.prompt_graph_lengths:  # none under a step budget of fewer than 16 tokens
            self.prompt_graphs = PromptGraphs(
                self.model,
                self.backend.attention,
                self.prompt_graph_lengths,
                max_blocks,
                self.device,
                self.decode_graphs.pool,
            )

    def release_graphs(self) -> None:
        """Free the CUDA graphs (the runner steps eagerly after this): before a
        tensor-parallel group closes, which cannot while graphs of its collectives live."""
        if self.decode_graphs is not None:
            torch.cuda.synchronize(self.device)  # no step in flight replays one
        for graphs in (self.decode_graphs, self.verify_graphs, self.prompt_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.verify_graphs = self.prompt_graphs = None

    def step_inputs(self, batch: list[Request]) -> StepInputs:
        """``batch``'s scheduled tokens as a forward pass's inputs; the requests are left as
        they are."""
        return pack(
            batch,
            self.block_size,
            self.device,
            self._last_sampled,
            self.backend.step_ops,
            self.verify_query_len,
            self.pinned_inputs,
        )

    def forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        """The logits of the step's sampled rows and scored prompt positions, the model run
        op by op. (A decode step, which a graph may run, scores none: a one-token chunk that
        scores a prompt token leaves the rest of its prompt to compute, and samples nothing.)"""
        self.backend.attention.prepare(inputs.metadata)
        return self.model(inputs.input_ids, inputs.metadata, inputs.logits_index)

    @torch.inference_mode()
    def forward(self, batch: list[Request]) -> ForwardedStep:
        """Queue one forward pass over ``batch``, without waiting for the device; ``sample``
        then picks its rows' next tokens."""
        inputs = self.step_inputs(batch)
        if self.send_step is not None:
            self.send_step(inputs)
        for request in batch:
            request.num_cached_tokens += request.num_scheduled_tokens
        logits = self.run_model(inputs)
        return ForwardedStep(
            batch,
            inputs.rows,
            logits,
            inputs.scored,
            inputs.num_drafts,
            inputs.uniform_query_len,
        )

    def run_model(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits: a pure decode, a verify step of decodes alone, or a step of a
        few short prompts on CUDA by graph replay; a step of decodes with prompts mixed in as
        two passes, its decodes' and the rest's, where that is taken (``mixed_steps``); else
        op by op. (What a tensor-parallel worker runs for each step it receives.)"""
        graphs = None
        if inputs.uniform_query_len == 1:
            graphs = self.decode_graphs
        elif inputs.uniform_query_len:
            graphs = self.verify_graphs
        if graphs is not None and graphs.fits(inputs.num_seqs):
            return graphs.run(inputs)
        if self.prompt_graphs is not None and self.prompt_graphs.fits(inputs.shape):
            return self.prompt_graphs.run(inputs)
        if self.split_mixed_steps and is_mixed(inputs.shape):
            decodes, prompts = split_mixed_step(inputs)
            if self._replays(decodes) and self._replays(prompts):
                self.num_split_steps += 1
                return torch.cat([self.run_model(decodes), self.run_model(prompts)])
        return self.forward_eager(inputs)

    def _replays(self, part: StepInputs) -> bool:
        """Whether a mixed step's part replays a graph; on a device without graphs, (where
        --split-mixed-steps on splits) as good as: it runs op by op either way."""
        if self.decode_graphs is None:
            return True
        if part.uniform_query_len:
            return self.decode_graphs.fits(part.num_seqs)
        return self.prompt_graphs is not None and self.prompt_graphs.fits(part.shape)

    @torch.inference_mode()
    def last_hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """Every packed token's last hidden state [T, hidden], the model run op by op (a
        pooling step's: engine/execution/pooling.py). The other ranks of a tensor-parallel
        group run the step as any other: this rank computes the logits whose gather they
        join, and drops them."""
        if self.send_step is not None:
            self.send_step(inputs)
        self.backend.attention.prepare(inputs.metadata)
        hidden = self.model.last_hidden_states(inputs.input_ids, inputs.metadata)
        if self.tp.size > 1:
            self.model.compute_logits(hidden[inputs.logits_index])
        return hidden

    @torch.inference_mode()
    def sample(
        self, step: ForwardedStep, grammars: Sequence[xgr.GrammarMatcher | None] | None
    ) -> LaunchedStep:
        """Queue the sampling of each complete row's next token (and its log-probabilities
        where asked), and the scoring of its prompt positions, without waiting for the
        device. ``grammars``, one per row (None: no row is constrained), restrict each row to
        the tokens its grammar allows next; the log-probabilities are those of that
        restricted distribution, as vLLM's. The sampled tokens count as pending in their
        requests until the host reads them, and the next step may take them as its inputs on
        the device."""
        batch, rows, logits, scored = step.batch, step.rows, step.logits, step.scored
        results = [torch.empty(0, dtype=torch.int64, device=self.device)]
        logprobs_asked = None
        row_starts = None
        num_row_logits = len(rows) + sum(step.num_drafts or ())
        if step.num_drafts is not None:
            layout = verify_layout(rows, step.num_drafts, self.device)
            row_starts = layout.row_starts
            results, logprobs_asked = self._verify(rows, logits[:num_row_logits], grammars, layout)
        elif rows:  # else only prompt chunks: nothing to sample yet
            row_logits = logits[: len(rows)]
            if grammars is not None:
                assert self.grammar_bitmask is not None, "only rank 0 samples"
                self.grammar_bitmask.apply(row_logits, grammars)
            results, logprobs_asked = self._sample(rows, row_logits)
        if scored is not None:
            chosen, rank, top_logprobs, top_ids = prompt_token_logprobs(
                logits[num_row_logits:], scored.target_ids, scored.num_top
            )
            results.append(torch.cat([chosen.unsqueeze(1), top_logprobs], dim=1))
            results.append(torch.cat([rank.unsqueeze(1), top_ids], dim=1))
        host_results, copied = self._copy_to_host(results)
        chunks = [] if scored is None else scored.chunks
        return LaunchedStep(batch, rows, host_results, logprobs_asked, chunks, copied, row_starts)

    def _sample(
        self, rows: list[Request], logits: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[int | None] | None]:
        """Sample each row's next token and make it pending; the tokens and, if any row
        asked, the log-probabilities' values and ids, and what each row asked."""
        params = sampling_tensors(
            rows, self.device, self._last_sampled, self.eos_token_ids, self.seen_tokens
        )
        next_tokens = sample(logits, params, self.backend.step_ops)
        self._mark_pending(rows, next_tokens)
        return self._with_logprobs(rows, logits, next_tokens, [next_tokens])

    def _verify(
        self,
        rows: list[Request],
        logits: torch.Tensor,
        grammars: Sequence[xgr.GrammarMatcher | None] | None,
        layout: VerifyLayout,
    ) -> tuple[list[torch.Tensor], list[int | None] | None]:
        """Sample a token at every position of a step whose rows verify drafts (a row with
        none has one position), and how many each row emits
        (``engine/sampling/rejection_sampler.py``); the last one is pending. Rows with
        drafts have no grammar and shape no logits: the others are sampled as ``_sample``
        samples them."""
        plain = [r for r in rows if not r.draft_token_ids]
        drafted = [r for r in rows if r.draft_token_ids]
        params = position_sampling_tensors(drafted, self.device)
        if not plain:  # every position is a drafted row's, in order: sampled without a gather
            tokens = sample(logits, params, self.backend.step_ops)
        else:
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
            plain_logits = logits[layout.plain_index]
            if grammars is not None:
                masks = [g for g, r in zip(grammars, rows, strict=True) if not r.draft_token_ids]
                assert self.grammar_bitmask is not None, "only rank 0 samples"
                self.grammar_bitmask.apply(plain_logits, masks)
                logits[layout.plain_index] = plain_logits  # logprobs: the masked distribution's
            plain_params = sampling_tensors(
                plain, self.device, self._last_sampled, self.eos_token_ids, self.seen_tokens
            )
            tokens[layout.plain_index] = sample(plain_logits, plain_params, self.backend.step_ops)
            drafted_logits = logits[layout.drafted_index]
            tokens[layout.drafted_index] = sample(drafted_logits, params, self.backend.step_ops)
        num_emitted, last_tokens = self.backend.step_ops.emitted_tokens(
            tokens, layout.next_drafts, layout.row_starts_index, layout.width
        )
        self._mark_pending(rows, last_tokens)
        return self._with_logprobs(rows, logits, tokens, [tokens, num_emitted])

    def _mark_pending(self, rows: list[Request], last_tokens: torch.Tensor) -> None:
        """Each row's newest token [R] is sampled, not yet read: the next step may take it."""
        self._last_sampled = last_tokens
        for row, request in enumerate(rows):
            request.add_pending_token(row)

    @staticmethod
    def _with_logprobs(
        rows: list[Request],
        logits: torch.Tensor,
        tokens: torch.Tensor,
        results: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[int | None] | None]:
        """``results`` and, if any row asked, the log-probabilities' values and ids of the
        sampled ``tokens`` [P] at their positions' ``logits``; what each row asked."""
        asked = [r.sampling.logprobs for r in rows]
        if all(k is None for k in asked):
            return results, None
        num_top = max(k for k in asked if k is not None)
        chosen, top_logprobs, top_ids = token_logprobs(logits, tokens, num_top)
        values = torch.cat([chosen.unsqueeze(1), top_logprobs], dim=1)
        ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1)
        return [*results, values, ids], asked

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
