"""Start-up warm-up: each kind of step the engine can run, run once before the first request;
then what start-up made is frozen out of Python's full collections (``freeze_start_up_objects``).

The first use of a kernel compiles it (Triton) or loads it (CUDA's lazy module loading), which
costs a first request hundreds of milliseconds. The Triton kernels take every argument that
changes from step to step (packed-input views, block-table widths, split counts) without
specializing on it (engine/backends/triton/), so their variants are few and fixed by the
model: one per layer kind (sliding window or not) and per decode path (split or not), but
the split merge's tiles (below). These steps reach all of them, and every sampling path:

- a prefill step of two prompts, one sampled greedily and one with temperature, top-k,
  top-p and log-probabilities (the prefill kernel serves mixed steps and every chunk size:
  nothing in its variants depends on them);
- a decode step of the two, its inputs the pending tokens on the device, as overlapped
  steps take them (filled in by a kernel of their own, ``pending_tokens``): a replayed CUDA
  graph (captured before, which compiled the decode kernels of each graph's batch size and
  the kernel that fills a graph's inputs, ``graph_inputs``) or the eager decode;
- a prefill step of one prompt run op by op (longer than the prompt graphs take, where they
  are captured and a step may be longer; where a small model's graphs take a step's whole
  budget, its forward pass alone, op by op): its last token's row, gathered from the packed
  batch with its residual, reaches the LM head as one row whose norm adds a residual, which
  batch-1 decode steps no longer do (their o and down projections add the stream
  themselves), and a prompt graph never does (its LM head computes its padded rows);
- the draws the steps did not make, a kernel variant each, over logits of zeros (``sample``:
  nothing but the draw): an all-greedy step's argmax (a small model's one-prompt step is its
  prompt graph's), the uncut race, the races within min-p alone and with top-p (the steps
  drew within top-k and top-p), and the penalties with a repetition penalty and without;
- where decode may run eagerly (no graphs, or batches beyond the largest one), eager decodes
  of one sequence at the longest context (split-K), of two (a split step of one sequence
  takes a variant of its own: ``decode_num_warps``) and of max_num_seqs at one token; where
  verify steps may (speculative decoding), the same two as verify steps (the decode
  kernel's variant of 1 + k queries a sequence; the verify graphs' capture compiled it for
  the graphs);
- what eager steps' attention takes by their shape where a backend's variants follow it
  (``AttentionBackend.compile_eager_variants``): the Triton backend's split merge, whose tile
  follows a step's split count and rows, where a step's splits are merged by it (the fp8
  decode kernel's, a verify step's), for a mixed step's decodes and verify steps past the
  graphs of any batch up to max_num_seqs (``compile_eager_attention``; a draft model's warm-up
  calls it for its own eager passes).

The steps use fake requests whose every block is block 0: what they write there is finite
and later overwritten by the requests that own those slots, and nothing reads a slot before
its owner writes it (the torch backend reads whole blocks but masks what lies beyond).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.execution.batch import sampling_tensors
from engine.execution.seen_tokens import SeenTokens
from engine.models.layers import Attention
from engine.sampling.sampler import sample
from engine.scheduling.request import Request, RequestStatus
from protocol import SamplingParams

if TYPE_CHECKING:
    from engine.backends.attention import AttentionBackend
    from engine.execution.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PROMPT_LEN = 37  # odd, and beyond a block: nothing in the variants depends on it anyway
_GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
_SAMPLED = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, logprobs=2)
# The draws the steps above need not make (the module's docstring).
_OTHER_DRAWS = [
    _GREEDY,
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, min_p=0.1),
    SamplingParams(temperature=0.8, min_p=0.1, top_p=0.9),
    SamplingParams(temperature=0.8, frequency_penalty=0.5),  # penalties' two variants
    SamplingParams(temperature=0.8, repetition_penalty=1.1),
]


def _request(
    index: int, num_tokens: int, sampling: SamplingParams, block_size: int, cached: int = 0
) -> Request:
    """A request of ``num_tokens`` prompt tokens, ``cached`` of them already in the cache,
    the rest scheduled, with room for one more; every block is block 0."""
    request = Request(b"", f"warm-up-{index}", [1] * num_tokens, sampling, seed=index)
    request.block_ids = array("q", [0]) * (num_tokens // block_size + 1)
    request.num_cached_tokens = cached
    request.num_scheduled_tokens = num_tokens - cached
    request.status = RequestStatus.RUNNING
    return request


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Run each kind of step once on ``runner``, whose cache is allocated and graphs
    captured; it is left as it was."""
    started = time.perf_counter()
    block_size = runner.block_size
    batch = [
        _request(0, _PROMPT_LEN, _GREEDY, block_size),
        _request(1, 3, _SAMPLED, block_size),
    ]
    runner.sample(runner.forward(batch), None).result()  # prefill
    for request in batch:
        request.num_scheduled_tokens = 1
    runner.sample(runner.forward(batch), None).result()  # decode of the pending tokens
    alone_len = _PROMPT_LEN
    if runner.prompt_graphs is not None:  # one past them, if a step can be that long
        step_limit = min(max_num_batched_tokens, runner.max_model_len - 1)
        alone_len = min(runner.prompt_graphs.lengths[-1] + 1, step_limit)
    if runner.prompt_graphs is None or alone_len > runner.prompt_graphs.lengths[-1]:
        alone = [_request(2, alone_len, _GREEDY, block_size)]
        runner.sample(runner.forward(alone), None).result()  # one prompt's prefill
    elif runner.send_step is None:  # (not sent: as the eager decodes below)
        # A small model's graphs take a step's whole budget: its prompt run op by op alone.
        runner.forward_eager(runner.step_inputs([_request(2, _PROMPT_LEN, _GREEDY, block_size)]))
    num_steps = 3
    vocab_size = runner.model_config.vocab_size
    logits = torch.zeros(1, vocab_size, device=runner.device)
    no_pending = torch.empty(0, dtype=torch.int64, device=runner.device)
    # Tables of one slot: the runner's are made by the first penalized request, if any comes.
    seen_tokens = SeenTokens(1, vocab_size, runner.device)
    for index, sampling in enumerate(_OTHER_DRAWS):
        row = [_request(3 + index, 1, sampling, block_size)]
        params = sampling_tensors(row, runner.device, no_pending, runner.eos_token_ids, seen_tokens)
        sample(logits, params, runner.backend.step_ops)
    decode_graphs, verify_graphs = runner.decode_graphs, runner.verify_graphs
    eager_decodes = decode_graphs is None or not decode_graphs.fits(max_num_seqs)
    num_drafts = max(runner.verify_query_len - 1, 0)
    eager_verifies = num_drafts > 0 and (
        verify_graphs is None or not verify_graphs.fits(max_num_seqs)
    )
    # Under tensor parallelism the other ranks run each step rank 0 sends them, and these
    # eager steps are not sent: they are left to the first steps that need them.
    if runner.send_step is None and (eager_decodes or eager_verifies):
        length = runner.max_model_len - num_drafts
        longest = [_request(i, length, _GREEDY, block_size, length - 1) for i in (3, 4, 5)]
        widest = [_request(6 + i, 1, _GREEDY, block_size) for i in range(max_num_seqs)]
        for decode in (longest[:1], longest[1:], widest):  # one sequence, two, the most
            if eager_decodes:
                runner.forward_eager(runner.step_inputs(decode))
                num_steps += 1
            if eager_verifies:
                for request in decode:
                    request.draft_token_ids = [1] * num_drafts
                    request.num_scheduled_tokens = 1 + num_drafts
                    request.block_ids = array("q", [0]) * (-(-runner.max_model_len // block_size))
                runner.forward_eager(runner.step_inputs(decode))
                num_steps += 1
    # What eager steps' attention takes by their shape (a mixed step's decodes, and verify
    # steps past the graphs): the steps above reach a few shapes of the many.
    compile_eager_attention(
        runner.model,
        runner.backend.attention,
        runner.dtype,
        [1, 1 + num_drafts] if eager_verifies else [1],
        max_num_seqs,
        runner.max_model_len,
    )
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("warm-up: %d steps in %.2f s", num_steps, time.perf_counter() - started)


def compile_eager_attention(
    model: torch.nn.Module,
    attention_backend: AttentionBackend,
    dtype: torch.dtype,
    query_lens: Sequence[int],
    max_batch: int,
    max_context_len: int,
) -> None:
    """Compile what ``model``'s eager steps of 1 to ``max_batch`` sequences of each of
    ``query_lens`` queries take by their shape (``AttentionBackend.compile_eager_variants``),
    for the heads, cache and sinks of its attention layers (the same in every layer)."""
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    assert attention.cache is not None, "the cache is bound first"
    device = attention.cache.key.device
    q = torch.empty(1, attention.num_heads, attention.head_dim, dtype=dtype, device=device)
    for query_len in query_lens:
        attention_backend.compile_eager_variants(
            q, attention.cache, query_len, max_batch, max_context_len, attention.sink_logits()
        )


def freeze_start_up_objects() -> None:
    """Put what start-up made (modules, the model's and tokenizer's Python objects), which
    lives as long as the process, out of the sight of Python's full collections, which then
    walk only what requests made since. Not frozen, the first full collection after start,
    while the first few hundred requests were admitted, walked all of it and stalled one step
    of a fresh engine for as long. Thawed at exit, so that the interpreter's last collection
    frees it (nanobind's extensions, Triton's among them, report objects left alive then as
    leaks)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once a process, however many engines it starts
    atexit.register(gc.unfreeze)
