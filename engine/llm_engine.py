"""The engine proper: requests in, one batched step at a time, tokens out. No sockets here.

``EngineService`` wraps it with the ZeroMQ socket; tests and benchmarks can drive it
directly in-process.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.model_runner import CacheConfig, LaunchedStep, ModelRunner, resolve_dtype
from engine.models import load_checkpoint
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from protocol import (
    PROTOCOL_VERSION,
    EngineStats,
    ErrorCode,
    FinishReason,
    HandshakeReply,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "auto"  # or a name in model_runner.DTYPES
    max_model_len: int | None = None  # default: the model's, capped by what the cache holds
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # default: 1 GiB on CPU, by utilization on CUDA
    num_kv_blocks: int | None = None  # an exact block count; overrides the memory budget
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False  # CUDA: run decode steps op by op, without CUDA graphs
    enable_prefix_caching: bool = True  # reuse the cache of prompts' common prefixes
    served_model_name: str | None = None  # the name clients use; default: the checkpoint's
    # Launch each step before reading the last one's tokens, so the host's work overlaps the
    # device's. None: on for CUDA; off on CPU, whose ops run as they are called (it would
    # only delay each token by a step).
    overlap_steps: bool | None = None


class RequestRejected(Exception):
    """A request the engine will not run; the message is for the user."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.max_num_batched_tokens < config.max_num_seqs:
            # Each running request decodes a token a step: the step's budget must hold them.
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({config.max_num_seqs})"
            )
        self.started_at = time.time()
        self.device = torch.device(config.device)
        checkpoint = load_checkpoint(config.model)
        self.model_name = config.served_model_name or checkpoint.name
        self.tokenizer = checkpoint.tokenizer
        self.vocab_size = checkpoint.config.vocab_size
        model_len = config.max_model_len or checkpoint.config.max_position_embeddings
        dtype = resolve_dtype(config.dtype, self.device)
        self.runner = ModelRunner(checkpoint, self.device, dtype, model_len)

        num_blocks = self._num_kv_blocks(config)
        capacity = num_blocks * config.block_size
        if config.max_model_len is None:
            model_len = min(model_len, capacity)
        elif config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache's {capacity} tokens; "
                "give the cache more memory or lower max_model_len"
            )
        self.max_model_len = model_len
        self.runner.allocate_kv_cache(CacheConfig(config.block_size, num_blocks))
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
            num_blocks,
            config.block_size,
            capacity,
            model_len,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.requests: dict[tuple[bytes, str], Request] = {}
        self.overlap_steps = (
            config.overlap_steps if config.overlap_steps is not None else self.device.type == "cuda"
        )
        self.in_flight: LaunchedStep | None = None  # launched, results not yet read
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.num_finished = 0
        self.num_generated_tokens = 0  # sampled, one per request per step

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = self.runner.kv_bytes_per_token() * config.block_size
        if config.kv_cache_memory_gb is not None:
            budget = int(config.kv_cache_memory_gb * 1024**3)
        elif self.device.type == "cuda":
            # Leave room for the largest step's activations, measured by running one.
            step_tokens = min(config.max_num_batched_tokens, self.runner.max_model_len)
            activations = self.runner.measure_activation_bytes(step_tokens, config.max_num_seqs)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # our weights and anything else on the GPU
            budget = int(total * config.gpu_memory_utilization) - used - activations
            logger.info(
                "warm-up step of %d tokens: %.2f GiB of activations; %.2f GiB for the KV cache",
                step_tokens,
                activations / 1024**3,
                budget / 1024**3,
            )
        else:
            budget = 1024**3
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes)")
        return num_blocks

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    def handshake_reply(self) -> HandshakeReply:
        return HandshakeReply(
            protocol_version=PROTOCOL_VERSION,
            model_name=self.model_name,
            tokenizer_json=self.tokenizer.tokenizer_json,
            chat_template=self.tokenizer.chat_template,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            max_model_len=self.max_model_len,
            engine_pid=os.getpid(),
            engine_started_at=self.started_at,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            engine_pid=os.getpid(),
            engine_started_at=self.started_at,
            model_name=self.model_name,
            device=str(self.device),
            block_size=self.block_manager.block_size,
            num_total_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_finished=self.num_finished,
            num_prompt_tokens=self.scheduler.num_prefill_tokens,
            num_cached_prompt_tokens=self.block_manager.num_hit_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def add_request(
        self, client: bytes, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request, or raise RequestRejected saying why it can never run."""
        problem = sampling.validate()
        if problem:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, problem)
        if (client, request_id) in self.requests:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, f"duplicate request id {request_id}")
        if not prompt:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "the prompt has no tokens")
        # logit_bias ids index the logits: out of range they would fail the whole step.
        for token_ids in (prompt, sampling.logit_bias_token_ids):
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
                raise RequestRejected(
                    ErrorCode.INVALID_REQUEST, f"token ids must be in [0, {self.vocab_size})"
                )
        total = len(prompt) + sampling.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the maximum context length of {self.max_model_len} tokens",
            )
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        request = Request(client, request_id, list(prompt), sampling, seed)
        self.requests[request.key] = request
        self.scheduler.add(request)

    def abort(self, client: bytes, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; its final output, or None if unknown."""
        request = self.requests.get((client, request_id))
        if request is None:
            return None
        return self._finish(request, FinishReason.ABORT, [])

    def abort_client(self, client: bytes) -> int:
        """Abort every request of a server that went away; how many there were."""
        mine = [r for r in self.requests.values() if r.client == client]
        for request in mine:
            self._finish(request, FinishReason.ABORT, [])
        return len(mine)

    def step(self) -> list[tuple[bytes, RequestOutput]]:
        """Launch the next forward pass and read a step's results: with overlapped steps, those
        of the step launched before it, which ran on the device while this one was scheduled
        and packed. The outputs, each with its client."""
        batch = self.scheduler.schedule()
        outputs = []
        if self.in_flight is not None and any(_needs_read_history(r) for r in batch):
            # Penalties count the tokens generated so far: read the pending ones first.
            outputs = self.sync()
            batch = [r for r in batch if r.status is not RequestStatus.FINISHED]
        launched = self.runner.launch(batch) if batch else None
        if not self.overlap_steps:
            return self._read_results(launched) if launched else []
        outputs += self.sync()
        self.in_flight = launched
        return outputs

    def sync(self) -> list[tuple[bytes, RequestOutput]]:
        """Read the step in flight, if any: after it every sampled token is in host memory."""
        step, self.in_flight = self.in_flight, None
        return self._read_results(step) if step is not None else []

    def _read_results(self, step: LaunchedStep) -> list[tuple[bytes, RequestOutput]]:
        """Take in a step's results: key the newly computed cache blocks, append each sampled
        token, finish the requests that are done. Requests finished or aborted since the
        step was launched are skipped: their rows were computed for nothing."""
        sampled = step.result()
        for request in step.batch:
            if request.status is not RequestStatus.FINISHED:  # before a finish frees them
                self.block_manager.cache_computed_blocks(request)
        logprobs = sampled.logprobs or [None] * len(sampled.requests)
        outputs = []
        for request, token, token_logprobs in zip(
            sampled.requests, sampled.token_ids, logprobs, strict=True
        ):
            if request.status is not RequestStatus.FINISHED:
                request.num_pending_tokens -= 1
                self.num_generated_tokens += 1
                outputs.append((request.client, self._append_token(request, token, token_logprobs)))
        return outputs

    def _append_token(
        self, request: Request, token: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        sampling = request.sampling
        if token in sampling.stop_token_ids or (
            not sampling.ignore_eos and token in self.eos_token_ids
        ):
            return self._finish(request, FinishReason.STOP, [])
        request.output_token_ids.append(token)
        new_logprobs = None if logprobs is None else [logprobs]
        if (
            len(request.output_token_ids) >= sampling.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return self._finish(request, FinishReason.LENGTH, [token], new_logprobs)
        return self._output(request, [token], None, new_logprobs)

    def _finish(
        self,
        request: Request,
        reason: str,
        new_tokens: list[int],
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.remove(request)
            del self.requests[request.key]
            self.num_finished += 1
        return self._output(request, new_tokens, reason, logprobs)

    @staticmethod
    def _output(
        request: Request,
        new_tokens: list[int],
        reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
            logprobs=logprobs,
        )


def _needs_read_history(request: Request) -> bool:
    """Whether sampling the request's next token needs every earlier one in host memory."""
    return request.num_pending_tokens > 0 and bool(
        request.sampling.presence_penalty or request.sampling.frequency_penalty
    )
