"""``--separate-prefill-steps``: a step that admits waiting requests computes prompts alone,
the running requests' decodes wait for the next step (never two), and every answer is what
the mixed steps give (engine/scheduling/scheduler.py): with speculative decoding (n-gram, a
draft model) and over tensor-parallel ranks too."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.scheduling.request import Request
from protocol import SamplingParams
from tandem.testing.reference import hf_greedy
from tests.engine.test_model_families import saved_tiny_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny: tuple[Path, LlamaForCausalLM]) -> Path:
    """The engine tests' tiny Llama (tests/engine/conftest.py)."""
    return tiny[0]


def _run(
    model_dir: Path, separate: bool, overlap: bool, speculation: str | None = None
) -> tuple[dict[str, list[int]], list[list[tuple[str, int, bool]]], LLMEngine]:
    """Greedy answers of requests arriving two a step while earlier ones decode, each step's
    batch: (request, tokens it computes, whether it decodes: its prompt computed), and the
    engine. ``speculation``: ngram, draft_model (the target as its own draft), or None."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cpu", max_num_seqs=8, max_model_len=128,
            max_num_batched_tokens=64, separate_prefill_steps=separate, overlap_steps=overlap,
            speculative_method=speculation, num_speculative_tokens=3, speculative_adaptive=False,
            speculative_model=str(model_dir) if speculation == "draft_model" else None,
        )
    )  # fmt: skip
    steps: list[list[tuple[str, int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recorded() -> list[Request]:
        batch = schedule()
        if batch:  # decoding: its prompt computed
            prompt = [r.num_cached_tokens >= len(r.prompt_token_ids) for r in batch]
            steps.append(
                [
                    (r.request_id, r.num_scheduled_tokens, p)
                    for r, p in zip(batch, prompt, strict=True)
                ]
            )
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    answers: dict[str, list[int]] = {}
    prompts = {f"r{i}": [3 + i, 9, 4 + 2 * i] * (2 + i % 3) for i in range(10)}
    arriving = list(prompts)
    while arriving or engine.has_work:
        for request_id in arriving[:2]:
            engine.add_request(b"c", request_id, prompts[request_id], sampling)
        arriving = arriving[2:]
        for _, output in engine.step():
            answers.setdefault(output.request_id, []).extend(output.new_token_ids)
    for _, output in engine.sync():
        answers.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return answers, steps, engine


@pytest.mark.parametrize(
    ("overlap", "speculation"),
    [(False, None), (True, None), (True, "ngram"), (False, "draft_model"), (True, "draft_model")],
    ids=["steps-in-turn", "overlapped", "ngram", "draft-model", "draft-model-overlapped"],
)
def test_prompts_run_alone_and_answers_equal_mixed_steps(
    model_dir: Path, overlap: bool, speculation: str | None
) -> None:
    """Speculative: n-gram drafts of the repeating prompts, or the target's own (a draft
    model), verified in the decode steps; a step of prompts alone drops the drafts made for
    it, and its decodes are drafted for again from the same tokens."""
    mixed_answers, mixed_steps, _ = _run(model_dir, False, overlap, speculation)
    answers, steps, engine = _run(model_dir, True, overlap, speculation)
    assert answers == mixed_answers
    if speculation == "draft_model":  # the target drafts its own tokens: none is rejected
        assert 0 < engine.num_accepted_tokens == engine.num_draft_tokens
    assert all(len(tokens) == MAX_TOKENS for tokens in answers.values())
    # Mixed: prompts and decodes share steps. Separate: no step admitting a prompt decodes.
    assert any(
        any(decoding for *_, decoding in step) and any(not d for *_, d in step)
        for step in mixed_steps
    )
    alone = [step for step in steps if not any(decoding for *_, decoding in step)]
    # A step of prompts alone, then one with the decodes (two arrive every step here).
    assert alone[0] == steps[0] and len(alone) > 1
    for before, after in itertools.pairwise(steps):
        assert not (before in alone and after in alone), "the decodes waited two steps"
    # Every other step that admits a prompt comes right after a step of prompts alone.
    for index, step in enumerate(steps[1:], start=1):
        if any(not decoding for *_, decoding in step) and step not in alone:
            assert steps[index - 1] in alone
    assert len(steps) > len(mixed_steps)  # admissions cost the running requests steps


def test_a_step_of_prompt_chunks_alone_under_tensor_parallelism(tmp_path: Path) -> None:
    """Over two ranks (gloo, tests/engine/test_tensor_parallel.py): a long prompt arriving
    while another request decodes is prefilled first in a step of its chunk alone, which
    samples nothing: each rank's logits are [0, n] and their gather [0, 2n] (the gather of
    no rows failed). Greedy tokens equal transformers'."""
    hf_model = saved_tiny_model("llama-llama3-rope-untied", tmp_path)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path), device="cpu", block_size=4, kv_cache_memory_gb=0.01,
            tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4,
            separate_prefill_steps=True,
        )
    )  # fmt: skip
    try:
        prompts = {"short": [3, 14, 15, 92, 65], "long": [(7 * i) % 250 + 3 for i in range(40)]}
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        outputs: dict[str, list[int]] = {"short": [], "long": []}
        engine.add_request(b"test", "short", prompts["short"], sampling)
        # Its prompt's step, then a step of its decode (the step after one of prompts alone
        # mixes): the long prompt then arrives, and the next step computes its first chunk.
        for _step in range(2):
            for _, output in engine.step():
                outputs[output.request_id].extend(output.new_token_ids)
        engine.add_request(b"test", "long", prompts["long"], sampling)
        while engine.has_work:
            for _, output in engine.step():
                outputs[output.request_id].extend(output.new_token_ids)
        assert outputs == {p: hf_greedy(hf_model, prompts[p], 6) for p in outputs}
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
