"""The engine proper: requests in, one batched step at a time, tokens out. No sockets here.

``EngineService`` wraps it with the ZeroMQ socket; tests and benchmarks can drive it
directly in-process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.checkpoint import Checkpoint
from engine.checkpoint.generation_config import read_sampling_defaults
from engine.config import EngineConfig
from engine.execution.model_runner import LaunchedStep, ModelRunner
from engine.execution.pooling import Pooler
from engine.execution.warm_up import freeze_start_up_objects, warm_up
from engine.models import load_checkpoint
from engine.roofline import StepShape
from engine.sampling.prompt_logprobs import take_scored, take_unsent
from engine.sampling.structured_output import (
    CompilingRequests,
    GrammarCompiler,
    allows_no_token,
)
from engine.sampling.token_restrictions import breaks_restrictions, dead_end_message, may_dead_end
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.request import Request, RequestStatus
from engine.scheduling.scheduler import Scheduler
from engine.speculative import DraftingPolicy, Proposer
from engine.speculative.adaptive import AdaptiveDrafting
from engine.speculative.draft_model import DraftModelProposer
from engine.speculative.fixed import FixedDrafting
from engine.speculative.ngram import NgramProposer
from engine.speculative.step_costs import PROPOSED_NOTHING, StepCosts
from engine.tensor_parallel import WorkerGroup
from protocol import (
    PROTOCOL_VERSION,
    Embedding,
    EngineStats,
    ErrorCode,
    ErrorReply,
    FinishReason,
    HandshakeReply,
    RequestOutput,
    SamplingDefaults,
    SamplingParams,
    Scheduling,
    StructuredOutput,
    TokenLogprobs,
    context_length_problem,
    prompt_logprobs_problem,
    quoted,
)

logger = logging.getLogger(__name__)

# A request that says nothing of its place in the queue: priority 0, the anonymous user.
_NO_SCHEDULING = Scheduling()


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
        if config.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be 1 or more, not {config.tensor_parallel_size}"
            )
        self.started_at = time.time()
        checkpoint = load_checkpoint(config.model)
        self.model_name = config.served_model_name or checkpoint.name
        self.tokenizer = checkpoint.tokenizer
        self.vocab_size = checkpoint.config.vocab_size
        self.proposer: Proposer | None = None
        draft: DraftModelProposer | None = None
        method = config.speculation
        if method == "ngram":
            if config.speculative_model is not None:
                raise ValueError("--speculative-model goes with --speculative-method draft_model")
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        elif method == "draft_model":
            if config.speculative_model is None:
                raise ValueError("--speculative-method draft_model needs --speculative-model")
            # Loaded first: its weights count as used when the target sizes the two caches.
            model_len = config.max_model_len or checkpoint.config.max_position_embeddings
            draft = DraftModelProposer(
                config, load_checkpoint(config.speculative_model), checkpoint, model_len
            )
            self.proposer = draft
        # Tensor parallelism: this process is rank 0 and drives the workers it starts here.
        self.workers = WorkerGroup(config, checkpoint) if config.tensor_parallel_size > 1 else None
        try:
            if self.workers is None:
                self.runner = ModelRunner(
                    config,
                    checkpoint,
                    extra_kv_bytes_per_token=0 if draft is None else draft.kv_bytes_per_token,
                )
            else:
                send_step = self.workers.sender.send
                self.runner = ModelRunner(config, checkpoint, self.workers.tp, send_step)
            # Where kernels compile or load on first use. Rank 0's steps reach the other
            # ranks, which run them too.
            if self.runner.device.type == "cuda":
                warm_up(self.runner, config.max_num_seqs, config.max_num_batched_tokens)
        except BaseException:
            self.close()
            raise
        self.device = self.runner.device
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            config.block_size,
            prefix_caching=config.enable_prefix_caching,
        )
        if draft is not None:
            draft.bind(self.block_manager)
            if self.device.type == "cuda":
                draft.warm_up()
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            config.separate_prefill_steps,
        )
        self.requests: dict[tuple[bytes, str], Request] = {}
        # Embeddings: prompts pooled in steps of their own (engine/execution/pooling.py).
        self.pooler = Pooler(
            self.runner,
            self.block_manager,
            checkpoint.pooling,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        self.overlap_steps = (
            config.overlap_steps if config.overlap_steps is not None else self.device.type == "cuda"
        )
        self.speculative_disable_by_batch_size = config.speculative_disable_by_batch_size
        # With speculation: the steps' measured costs, and the policy that decides who is
        # drafted for and how many tokens.
        self.step_costs: StepCosts | None = None
        self.drafting: DraftingPolicy | None = None
        if self.proposer is not None:
            self.step_costs = StepCosts(draft_pass_prior=0.0 if draft is None else 1.0)
            self.drafting = self._drafting_policy(config, draft)
        self.in_flight: LaunchedStep | None = None  # launched, results not yet read
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.sampling_defaults = _sampling_defaults(config.generation_config, checkpoint)
        # Structured outputs: grammars compile on these threads while the steps run on.
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.compiling = CompilingRequests(
            GrammarCompiler(self.tokenizer, self.vocab_size, self.grammar_pool)
        )
        self.num_constrained = 0  # requests in the scheduler with a grammar
        # Requests refused after add_request returned (their grammar failed to compile, or
        # they reached a dead end), for the service to send (take_errors).
        self.errors: list[tuple[bytes, ErrorReply]] = []
        self.num_finished = 0
        self.num_generated_tokens = 0  # sampled, one per request per step
        # Speculative decoding: drafts verified, and those accepted.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Each step's shape, for a benchmark's roofline (engine/roofline.py): kept only when
        # one sets a list here.
        self.step_shapes: list[StepShape] | None = None
        freeze_start_up_objects()

    def _drafting_policy(
        self, config: EngineConfig, draft: DraftModelProposer | None
    ) -> DraftingPolicy:
        if not config.speculative_adaptive:
            return FixedDrafting(config.num_speculative_tokens, config.speculative_pause_acceptance)
        costs = self.step_costs
        assert costs is not None
        runner = self.runner
        verify_graphs = runner.verify_graphs
        if verify_graphs is not None and self.workers is None:
            # The device's times of the decode and draft graphs: the first estimates.
            # (Not under tensor parallelism: a graph replayed on rank 0 alone would wait
            # forever for the other ranks' collectives.)
            draft_graphs = None
            if draft is not None:
                draft_graphs = draft.decode_graphs or draft.catch_up_graphs
            costs.seed(runner.decode_graphs, draft_graphs)
        max_batch = None if verify_graphs is None else verify_graphs.batch_sizes[-1]
        assert self.proposer is not None
        return AdaptiveDrafting(
            config.num_speculative_tokens, costs, max_batch, self.proposer.preview
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine serves no more)."""
        if self.workers is not None:
            self.runner.release_graphs()  # each rank's, before the group closes
            self.workers.close()
            self.workers = None

    @property
    def has_work(self) -> bool:
        """Whether any request is unfinished: steps have work to run or to read, or requests
        wait for their grammars (a step schedules those that are ready)."""
        return self._has_device_work or len(self.compiling) > 0

    @property
    def only_compiling(self) -> bool:
        """Whether all the work is waiting for grammars: nothing for the device yet."""
        return not self._has_device_work and len(self.compiling) > 0

    @property
    def _has_device_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or self.pooler.has_work

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
            sampling_defaults=self.sampling_defaults,
        )

    def num_waiting_for_a_place(self, arriving: int = 0) -> int:
        """Requests that wait for a place in the batch, with ``arriving`` more: those not
        running (grammars compiling included) beyond the places free now, which the next
        step admits."""
        free = self.scheduler.max_num_seqs - len(self.scheduler.running)
        return max(0, len(self.scheduler.waiting) + len(self.compiling) + arriving - free)

    def num_embeddings_waiting(self, arriving: int = 0) -> int:
        """Embedding requests that wait for a pooling step, with ``arriving`` more: those
        queued beyond the next step's sequences."""
        return max(0, len(self.pooler.waiting) + arriving - self.pooler.max_num_seqs)

    def num_grammar_compiles(self, arriving: StructuredOutput | None = None) -> int:
        """Grammars compiling (queued on the grammar threads, or running), with the compile a
        request of constraint ``arriving`` would start: none if its grammar is cached or
        compiling already."""
        compiler = self.compiling.compiler
        starts_one = arriving is not None and compiler.would_compile(arriving)
        return compiler.num_compiling + int(starts_one)

    def num_prompt_tokens_to_compute(self) -> int:
        """Tokens that requests not yet decoding must compute before their next token: the
        prompts (with a preempted request, its output so far too) of those waiting for a
        place, grammars compiling included, and what is left of the prompts being
        prefilled."""
        waiting = sum(r.num_tokens for r in self.scheduler.waiting) + sum(
            r.num_tokens for r in self.compiling
        )
        left = (r.num_tokens - r.num_cached_tokens for r in self.scheduler.running)
        return waiting + sum(n for n in left if n > 1)  # 1: a decode

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
            num_waiting=(
                len(self.scheduler.waiting) + len(self.compiling) + len(self.pooler.waiting)
            ),
            num_finished=self.num_finished,
            num_prompt_tokens=self.scheduler.num_prefill_tokens,
            num_cached_prompt_tokens=self.block_manager.num_hit_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    def add_request(
        self,
        client: bytes,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        scheduling: Scheduling = _NO_SCHEDULING,
    ) -> None:
        """Queue a request, or raise RequestRejected saying why it can never run."""
        problem = sampling.validate()
        if problem:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, problem)
        if scheduling.priority and not self.scheduler.waiting.by_priority:
            # As vLLM: a priority would be silently ignored.
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"priority {scheduling.priority} needs an engine started with "
                "--scheduling-policy priority",
            )
        self._check_new(client, request_id, prompt, sampling.token_ids())
        problem = context_length_problem(len(prompt), sampling.max_tokens, self.max_model_len)
        if problem:
            raise RequestRejected(ErrorCode.PROMPT_TOO_LONG, problem)
        problem = prompt_logprobs_problem(len(prompt), sampling.prompt_logprobs)
        if problem:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, problem)
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        request = Request(client, request_id, list(prompt), sampling, seed, scheduling)
        if not sampling.ignore_eos:
            request.finish_token_set = request.stop_token_set | self.eos_token_ids
        if sampling.structured_output is not None:
            # Scheduled once its grammar is compiled; refused (take_errors) if it fails.
            self.compiling.add(request)
        else:
            self.scheduler.add(request)
        self.requests[request.key] = request

    def add_embed_request(self, client: bytes, request_id: str, prompt: list[int]) -> None:
        """Queue a prompt to embed (``pool`` answers it), or raise RequestRejected."""
        self._check_new(client, request_id, prompt, [])
        if len(prompt) > self.max_model_len:
            raise RequestRejected(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {len(prompt)} tokens, more than the model's context of "
                f"{self.max_model_len}",
            )
        self.pooler.add(client, request_id, prompt)

    def _check_new(
        self, client: bytes, request_id: str, prompt: list[int], other_ids: list[list[int]]
    ) -> None:
        """Raise RequestRejected for a request id in use, an empty prompt, or token ids
        (the prompt's, ``other_ids``) out of the vocabulary."""
        key = (client, request_id)
        if key in self.requests or self.pooler.has(key):
            raise RequestRejected(ErrorCode.INVALID_REQUEST, f"duplicate request id {request_id}")
        if not prompt:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "the prompt has no tokens")
        # Token ids index the logits: out of range they would fail the whole step.
        for token_ids in (prompt, *other_ids):
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
                raise RequestRejected(
                    ErrorCode.INVALID_REQUEST, f"token ids must be in [0, {self.vocab_size})"
                )

    def pool(self) -> list[tuple[bytes, Embedding]]:
        """Run a pooling step if prompts wait to be embedded (beside ``step``: the generation
        steps are not changed by them); the embeddings done, each with its client."""
        return self.pooler.step() if self.pooler.has_work else []

    def take_errors(self) -> list[tuple[bytes, ErrorReply]]:
        """The refusals since the last call of requests whose grammars failed to compile or
        that reached a dead end (engine/sampling/token_restrictions.py), each with its client; the
        requests are gone."""
        errors, self.errors = self.errors, []
        return errors

    def abort(self, client: bytes, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks now; its final output, or None if unknown."""
        request = self.requests.get((client, request_id))
        if request is None:
            self.pooler.abort((client, request_id))  # an embedding's, if any: no output
            return None
        return self._finish(request, FinishReason.ABORT, [])

    def abort_client(self, client: bytes) -> int:
        """Abort every request of a server that went away; how many there were."""
        mine = [r for r in self.requests.values() if r.client == client]
        for request in mine:
            self._finish(request, FinishReason.ABORT, [])
        return len(mine) + self.pooler.abort_client(client)

    def abort_all(self) -> list[tuple[bytes, RequestOutput]]:
        """Abort every request (the engine is stopping): their final outputs, each with its
        client."""
        return [
            (request.client, self._finish(request, FinishReason.ABORT, []))
            for request in list(self.requests.values())
        ]

    def step(self) -> list[tuple[bytes, RequestOutput]]:
        """Launch the next forward pass and read a step's results: with overlapped steps, those
        of the step launched before it, which ran on the device while this one was scheduled
        and packed. The outputs, each with its client."""
        started = time.perf_counter()
        if self.compiling:
            self._schedule_compiled()
        outputs = []
        if self.in_flight is not None and self.in_flight.verifies_drafts:
            # Scheduling after a verify step: how many tokens each request has is known only
            # once it is read.
            outputs = self.sync()
        drafting, width = self._plan_drafts()
        propose_seconds = 0.0
        if drafting:
            # Proposing reads every token, the last one too: the step in flight first.
            outputs += self.sync()
            propose_seconds = self._propose(drafting, width)
        batch = self.scheduler.schedule()
        if not batch:
            self._observe_step(started, 0, 0, 0.0, 0)
            return outputs + self.sync()
        forwarded = self.runner.forward(batch)
        # A step that read the last one early and verifies nothing is no plain step.
        kind = forwarded.uniform_query_len
        if drafting and forwarded.num_drafts is None:
            kind = PROPOSED_NOTHING
        self._observe_step(started, kind, len(batch), propose_seconds, width)
        if self.step_shapes is not None:
            self.step_shapes.append(StepShape.of(batch, forwarded.logits.shape[0]))
        if self.in_flight is not None and self._samples_after_read(batch):
            # Read the pending tokens before sampling, while the device runs the forward pass.
            outputs += self.sync()
        # Only when a request has a grammar: the unconstrained steps pay nothing for them.
        grammars = [r.grammar for r in forwarded.rows] if self.num_constrained else None
        launched = self.runner.sample(forwarded, grammars)
        if not self.overlap_steps:
            return outputs + self.sync() + self._read_results(launched)
        outputs += self.sync()
        # A verify step too is left in flight: the caller's work until the next step (the
        # service's sends and receives) overlaps it, and that step reads it first.
        self.in_flight = launched
        return outputs

    def _observe_step(
        self, started: float, kind: int, batch_size: int, propose_seconds: float, width: int
    ) -> None:
        if self.step_costs is not None:
            self.step_costs.observe(started, kind, batch_size, propose_seconds, width)

    def _plan_drafts(self) -> tuple[list[Request], int]:
        """Whom this step drafts for, and the most drafts a request, before the step in flight
        is read (none: it is not read early, and the steps overlap as without speculation).
        Not while --speculative-disable-by-batch-size requests or more run (0 for no limit);
        not for requests whose logits a step shapes (penalties, bans, logit bias, min_p,
        grammars): what those do at a draft's position depends on the drafts before it; the
        policy decides for the others (``engine/speculative/adaptive.py``)."""
        policy = self.drafting
        running = self.scheduler.running
        limit = self.speculative_disable_by_batch_size
        if policy is None or not running or (limit and len(running) >= limit):
            return [], 0
        if self.scheduler.computes_prompts_alone_next():
            return [], 0  # its decodes wait a step: drafts for it would be dropped
        candidates = [
            request
            for request in running
            if request.num_tokens - request.num_cached_tokens == 1
            and not request.shapes_logits
            and request.grammar is None
        ]
        return policy.plan(candidates, len(running))

    def _propose(self, drafting: list[Request], width: int) -> float:
        """Draft up to ``width`` tokens after the last one of each of ``drafting`` still
        running, for the step to verify: one proposer call for them all, then the policy's
        choice. The seconds the proposer took."""
        proposer, policy = self.proposer, self.drafting
        assert proposer is not None and policy is not None
        running = RequestStatus.RUNNING
        drafting = [request for request in drafting if request.status is running]
        if not drafting:
            return 0.0
        # Every token it emits must fit its max_tokens and the context.
        max_drafts = [
            min(
                width,
                request.sampling.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            for request in drafting
        ]
        started = time.perf_counter()
        drafts, keys = proposer.propose(drafting, max_drafts)
        seconds = time.perf_counter() - started
        batch_size = len(self.scheduler.running)
        chosen = policy.choose(drafting, drafts, keys, batch_size, width)
        for request, tokens in zip(drafting, chosen, strict=True):
            request.draft_token_ids = tokens
        return seconds

    def _samples_after_read(self, batch: list[Request]) -> bool:
        """Whether sampling ``batch`` needs its pending tokens read first: a grammar advances
        on each one. (Penalties and bans take a pending token from the device.)"""
        return bool(self.num_constrained) and any(
            r.num_pending_tokens and r.grammar is not None for r in batch
        )

    def _schedule_compiled(self) -> None:
        """Schedule the requests whose grammars are ready; refuse those whose compile failed."""
        ready, failed = self.compiling.take_done()
        for request in ready:
            self.num_constrained += 1
            self.scheduler.add(request)
        for request, message in failed:  # never scheduled: they hold nothing
            request.status = RequestStatus.FINISHED
            del self.requests[request.key]
            reply = ErrorReply(request.request_id, ErrorCode.INVALID_REQUEST, message)
            self.errors.append((request.client, reply))

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
        finished = RequestStatus.FINISHED
        # Before the tokens: a prompt's last chunk also samples its first token, whose output
        # carries them.
        scoring = []
        for chunk, entries in sampled.prompt_logprobs:
            if chunk.request.status is not finished:
                take_scored(chunk.request, chunk.first_token, entries)
                scoring.append(chunk.request)
        logprobs = sampled.logprobs or [None] * len(sampled.requests)
        outputs = []
        num_read = 0  # tokens of requests still running (not those finished since the launch)
        for request, tokens, token_logprobs in zip(
            sampled.requests, sampled.token_ids, logprobs, strict=True
        ):
            if request.status is not finished:
                request.read_pending_token()
                num_read += len(tokens)
                if request.draft_token_ids:
                    self._take_verified(request, len(tokens) - 1)
                output = self._append_tokens(request, tokens, token_logprobs)
                if output is not None:  # None: refused, its error is in self.errors
                    outputs.append((request.client, output))
        self.num_generated_tokens += num_read
        # The chunks short of their prompts' ends sampled nothing: their outputs carry only
        # their prompt log-probabilities.
        for request in scoring:
            if request.status is not finished and request.unsent_prompt_logprobs:
                outputs.append((request.client, self._output(request, [], None)))
        return outputs

    def _take_verified(self, request: Request, num_accepted: int) -> None:
        """Count a request's verified drafts and forget the K/V of those rejected."""
        num_drafts = len(request.draft_token_ids)
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        assert self.drafting is not None
        self.drafting.record(request, num_drafts, num_accepted)
        self.block_manager.roll_back(request, num_drafts - num_accepted)
        request.draft_token_ids = []

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput | None:
        """Append a step's new tokens to the request, up to the one that finishes it; its
        output (None: refused, its error is in self.errors). A verify step's tokens are
        looked at a few at once (set lookups, one slice), not in a Python loop a token."""
        sampling = request.sampling
        first = not request.output_token_ids
        grammar = request.grammar
        stop_at = None  # the index of the token that finishes it, if one does
        if may_dead_end(request):
            # Its grammar or allowed tokens shape its logits, so it gets no drafts: this is
            # its step's one token.
            (token,) = tokens
            if breaks_restrictions(request, token, self.eos_token_ids) or (
                grammar is not None and not grammar.accept_token(token)
            ):
                return self._refuse_dead_end(request, token)
            if grammar is not None and grammar.is_terminated():
                stop_at = 0
        finish_tokens = request.finish_token_set
        if stop_at is None and not finish_tokens.isdisjoint(tokens):
            stop_at = next(i for i, token in enumerate(tokens) if token in finish_tokens)
        # The token that reaches max_tokens or the context's end finishes it (the first one
        # whatever the bound): tokens known, not num_tokens, since with overlapped steps that
        # counts the next token too, sampled by the step in flight.
        room = sampling.max_tokens - len(request.output_token_ids)
        room_in_context = self.max_model_len - request.num_known_tokens
        if room_in_context < room:
            room = room_in_context
        if room < 1:
            room = 1
        if stop_at is not None and stop_at < room:
            new_tokens, new_logprobs = _first(stop_at, tokens, logprobs)
            request.append_output_tokens(new_tokens)
            output = self._finish(
                request,
                FinishReason.STOP,
                new_tokens,
                new_logprobs,
                stop_token_id=tokens[stop_at],
            )
        elif room <= len(tokens):
            new_tokens, new_logprobs = _first(room, tokens, logprobs)
            request.append_output_tokens(new_tokens)
            output = self._finish(request, FinishReason.LENGTH, new_tokens, new_logprobs)
        else:
            request.append_output_tokens(tokens)
            output = self._output(request, tokens, None, logprobs)
        if first and request.first_scheduled_time is not None:
            output.queue_time = request.first_scheduled_time - request.arrival_time
            output.prefill_time = time.monotonic() - request.first_scheduled_time
        return output

    def _refuse_dead_end(self, request: Request, token: int) -> RequestOutput | None:
        """End a request the sampler found no token for (engine/sampling/token_restrictions.py): its
        user gets an error, not the token it never allowed. Without restrictions of its own,
        its grammar's mask alone decided: a grammar that allows no token is the user's (it
        matches no text), one that allowed the token is a bug, not the user's doing."""
        sampling = request.sampling
        if sampling.allowed_token_ids is None and not (
            sampling.bad_words_token_ids or sampling.min_tokens
        ):
            assert request.grammar is not None  # may_dead_end: no allowed tokens, a grammar
            if not allows_no_token(request.grammar, self.vocab_size):
                logger.error(
                    "request %s: token %d breaks its grammar", quoted(request.request_id), token
                )
                return self._finish(request, FinishReason.ABORT, [])
        reply = ErrorReply(request.request_id, ErrorCode.INVALID_REQUEST, dead_end_message(request))
        self._finish(request, FinishReason.ABORT, [])  # its output is not sent: the error is
        self.errors.append((request.client, reply))
        return None

    def _finish(
        self,
        request: Request,
        reason: str,
        new_tokens: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        *,
        stop_token_id: int | None = None,
    ) -> RequestOutput:
        if request.status is not RequestStatus.FINISHED:
            if request.status is RequestStatus.COMPILING:
                self.compiling.remove(request)
            elif request.grammar is not None:
                self.num_constrained -= 1
            self.scheduler.remove(request)
            del self.requests[request.key]
            self.num_finished += 1
        output = self._output(request, new_tokens, reason, logprobs)
        output.stop_token_id = stop_token_id
        return output

    @staticmethod
    def _output(
        request: Request,
        new_tokens: list[int],
        reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """The request's output: ``new_tokens`` and the prompt log-probabilities read since
        its last one."""
        # By position (request_id, new_token_ids, finish_reason, num_prompt_tokens,
        # num_output_tokens, ...): one per request each step, and keywords cost more.
        return RequestOutput(
            request.request_id,
            new_tokens,
            reason,
            len(request.prompt_token_ids),
            len(request.output_token_ids),
            logprobs,
            take_unsent(request),
        )


def _first(
    count: int, tokens: list[int], logprobs: list[TokenLogprobs] | None
) -> tuple[list[int], list[TokenLogprobs] | None]:
    """The first ``count`` of a step's new tokens, and their log-probabilities (None for
    none)."""
    return tokens[:count], None if logprobs is None or not count else logprobs[:count]


def _sampling_defaults(generation_config: str, checkpoint: Checkpoint) -> SamplingDefaults:
    """The sampling defaults servers apply, as ``--generation-config`` says."""
    if generation_config == "vllm":
        return SamplingDefaults()
    if generation_config == "auto":
        defaults = checkpoint.sampling_defaults
    else:
        directory = Path(generation_config).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: no generation_config.json in {directory}")
        defaults = read_sampling_defaults(directory)
    recommended = {k: v for k, v in dataclasses.asdict(defaults).items() if v is not None}
    if recommended:
        logger.info(
            "sampling defaults from the generation config: %s (--generation-config vllm "
            "turns them off)",
            ", ".join(f"{name} {value}" for name, value in recommended.items()),
        )
    return defaults
