"""Speculative verify steps on the CPU. Their uniform layout
(``engine.execution.batch.pad_verify``), what a verify CUDA graph replays: every sequence padded to
1 + k query tokens at its last positions, the padding in front writing no cache slot and never
sampled; checked against the packed layout, through the model (the same logits), and in the engine.
And overlapped: a verify step is left in flight like any other, and the next step reads it before
scheduling, drafting or not."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.backends.pytorch import TorchStepOps
from engine.execution.batch import StepInputs, pack
from engine.execution.model_runner import ModelRunner
from engine.scheduling.request import Request, RequestStatus
from protocol import RequestOutput, SamplingParams
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_speculative import REPETITIVE, assert_all_blocks_free, make_engine

BLOCK_SIZE = 4
WIDTH = 4  # 1 + k, k = 3
STEP_OPS = TorchStepOps()  # the CPU's (the torch backend's) pending-token fill


def verifying(index: int, prompt_len: int, drafts: list[int], first_block: int) -> Request:
    """A request whose prompt is cached but its last token, scheduled with ``drafts`` after
    it, in consecutive blocks from ``first_block``."""
    prompt = [(7 * index + 3 * i) % 50 + 1 for i in range(prompt_len)]
    request = Request(b"t", str(index), prompt, SamplingParams(max_tokens=8), seed=index)
    request.status = RequestStatus.RUNNING
    request.draft_token_ids = drafts
    request.num_cached_tokens = prompt_len - 1
    request.num_scheduled_tokens = 1 + len(drafts)
    num_blocks = -(-(prompt_len + len(drafts)) // BLOCK_SIZE)
    request.block_ids = array("q", range(first_block, first_block + num_blocks))
    return request


def verify_batch() -> list[Request]:
    """All draft counts 0 to k, and a context shorter than the layout's width."""
    return [
        verifying(0, 10, [1, 2, 3], 1),
        verifying(1, 2, [7], 5),
        verifying(2, 6, [], 7),
        verifying(3, 9, [4, 4], 9),
    ]


def both_layouts(batch: list[Request]) -> tuple[StepInputs, StepInputs]:
    last_sampled = torch.empty(0, dtype=torch.int64)
    packed = pack(batch, BLOCK_SIZE, torch.device("cpu"), last_sampled, STEP_OPS)
    uniform = pack(batch, BLOCK_SIZE, torch.device("cpu"), last_sampled, STEP_OPS, WIDTH)
    return packed, uniform


def test_verify_step_layout() -> None:
    packed, uniform = both_layouts(verify_batch())
    assert packed.uniform_query_len == 0 and packed.metadata.max_query_len == WIDTH
    assert uniform.uniform_query_len == WIDTH and uniform.metadata.uniform_queries
    m, index = uniform.metadata, uniform.logits_index
    assert uniform.shape.num_tokens == 4 * WIDTH and uniform.shape.num_rows == 4 + 6
    # The real tokens end each row of WIDTH, in the packed order; they alone are sampled.
    assert index.tolist() == [0, 1, 2, 3, 6, 7, 11, 13, 14, 15]
    for name in ("positions", "slot_mapping"):
        assert getattr(m, name)[index].tolist() == getattr(packed.metadata, name).tolist()
    assert uniform.input_ids[index].tolist() == packed.input_ids.tolist()
    # Padding: no cache slot, token 0, the positions before the row's real ones (at least 0).
    padding = torch.ones(4 * WIDTH, dtype=torch.bool)
    padding[index] = False
    assert m.slot_mapping[padding].tolist() == [-1] * 6
    assert uniform.input_ids[padding].tolist() == [0] * 6
    assert m.positions.view(4, WIDTH).tolist() == [
        [9, 10, 11, 12],
        [0, 0, 1, 2],
        [2, 3, 4, 5],
        [7, 8, 9, 10],
    ]
    assert m.query_lens.tolist() == [WIDTH] * 4
    assert m.query_starts.tolist() == [0, 4, 8, 12]
    assert m.token_seq_index.tolist() == [b for b in range(4) for _ in range(WIDTH)]
    assert m.context_lens.tolist() == packed.metadata.context_lens.tolist() == [13, 3, 6, 11]
    assert uniform.num_drafts == packed.num_drafts == [3, 1, 0, 2]
    # The verify step's sampler reads the same rows either way.
    assert uniform.rows == packed.rows


def test_steps_with_prefills_or_without_drafts_stay_packed() -> None:
    batch = verify_batch()
    batch[2].num_cached_tokens = 2  # a prefill chunk of four prompt tokens
    batch[2].num_scheduled_tokens = 4
    assert pack(batch, BLOCK_SIZE, torch.device("cpu"), torch.empty(0), STEP_OPS, WIDTH).shape == (
        pack(batch, BLOCK_SIZE, torch.device("cpu"), torch.empty(0), STEP_OPS).shape
    )
    decodes = verify_batch()
    for request in decodes:
        request.num_scheduled_tokens = 1
        request.draft_token_ids = []
    inputs = pack(decodes, BLOCK_SIZE, torch.device("cpu"), torch.empty(0), STEP_OPS, WIDTH)
    assert inputs.uniform_query_len == 1 and inputs.metadata.max_query_len == 1


def test_a_mixed_steps_leading_decodes_are_counted() -> None:
    """The decodes in front of a prompt's chunk: the attention backend's decode-kernel rows
    (``num_leading_decodes``). A one-token sequence after the chunk is not among them, and
    a step of decodes alone or in the uniform layout has none."""
    batch = verify_batch()
    for request in batch:
        request.num_scheduled_tokens = 1
        request.draft_token_ids = []
    batch[2].num_cached_tokens = 2  # a prefill chunk of four prompt tokens
    batch[2].num_scheduled_tokens = 4
    inputs = pack(batch, BLOCK_SIZE, torch.device("cpu"), torch.empty(0), STEP_OPS)
    assert inputs.metadata.num_leading_decodes == inputs.shape.num_leading_decodes == 2
    assert inputs.metadata.query_lens.tolist() == [1, 1, 4, 1]
    packed, uniform = both_layouts(verify_batch())  # verify steps: 4 tokens first
    assert packed.metadata.num_leading_decodes == uniform.metadata.num_leading_decodes == 0


@pytest.fixture(scope="module")
def runner(tiny: tuple[Path, HFLlama]) -> ModelRunner:
    directory, _ = tiny
    return make_engine(directory, block_size=BLOCK_SIZE, num_speculative_tokens=3).runner


def test_uniform_layout_gives_the_packed_layouts_logits(runner: ModelRunner) -> None:
    """Through the model (torch backend, float32): the padding changes no real token's
    logits, and writes nothing into the cache."""
    assert runner.verify_query_len == WIDTH
    batch = verify_batch()
    prompts = [(r.num_cached_tokens, r.num_scheduled_tokens) for r in batch]
    with torch.inference_mode():
        for request in batch:  # the prompts' K/V, but the last token's
            request.num_scheduled_tokens, request.num_cached_tokens = request.num_cached_tokens, 0
            request.draft_token_ids, drafts = [], request.draft_token_ids
            runner.forward_eager(runner.step_inputs([request]))
            request.draft_token_ids = drafts
        for request, (cached, scheduled) in zip(batch, prompts, strict=True):
            request.num_cached_tokens, request.num_scheduled_tokens = cached, scheduled
        packed, uniform = both_layouts(batch)
        expected = runner.forward_eager(packed)
        layers = runner.model.layers
        cache = [layer.self_attn.cache.key.clone() for layer in layers]
        logits = runner.forward_eager(uniform)
        for layer, before in zip(layers, cache, strict=True):  # rewritten alike, no more
            torch.testing.assert_close(layer.self_attn.cache.key, before, rtol=1e-5, atol=1e-6)
    assert logits.shape == expected.shape == (10, runner.model_config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_engine_verifies_in_the_uniform_layout(tiny: tuple[Path, HFLlama]) -> None:
    """Greedy output equals transformers' while verify steps take the uniform layout (and
    steps mixing prefills the packed one)."""
    directory, hf_model = tiny
    engine = make_engine(directory, prompt_lookup_min=1, max_num_batched_tokens=24, max_num_seqs=8)
    shapes = []
    forward = engine.runner.run_model
    engine.runner.run_model = lambda inputs: shapes.append(inputs.shape) or forward(inputs)
    prompts = [*random_prompts(5), REPETITIVE]
    assert run_engine(engine, prompts, max_tokens=16) == [
        hf_greedy(hf_model, p, 16) for p in prompts
    ]
    assert any(s.uniform_query_len == 4 for s in shapes)
    assert any(s.uniform_query_len == 0 and s.num_rows > s.num_seqs for s in shapes)
    assert_all_blocks_free(engine)


def test_verify_step_left_in_flight_is_read_before_a_step_without_drafts(
    tiny: tuple[Path, HFLlama],
) -> None:
    """Overlapped steps: one request drafts alone, its verify step left in flight; a second
    request arriving stops the drafting (--speculative-disable-by-batch-size 2), and the
    step after must still read the verify step before it schedules. Both requests get
    transformers' greedy tokens."""
    directory, hf_model = tiny
    engine = make_engine(
        directory, prompt_lookup_min=1, overlap_steps=True, speculative_disable_by_batch_size=2
    )
    prompts = [REPETITIVE, random_prompts(1)[0]]
    outputs: dict[str, list[RequestOutput]] = {"0": [], "1": []}
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.add_request(b"t", "0", prompts[0], sampling)
    verified_in_flight = False
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].append(output)
        in_flight = engine.in_flight
        if in_flight is not None and in_flight.verifies_drafts and not verified_in_flight:
            verified_in_flight = True
            engine.add_request(b"t", "1", prompts[1], sampling)
    assert verified_in_flight
    tokens = [[t for o in outputs[i] for t in o.new_token_ids] for i in ("0", "1")]
    assert tokens == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert_all_blocks_free(engine)
