"""Adaptive speculation (the default, ``engine/speculative/adaptive.py``) through a real engine
on the CPU, watched through its counters of drafted and accepted tokens step by step: a
request whose text repeats itself drafts all the lookup finds and emits several tokens a
step; text that does not repeat, or a draft that is never right, is paused (a few probes,
then plain overlapped steps); the tokens are those without speculation throughout. And the
policy alone at given costs: k grows as acceptance is measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.execution.cuda_graphs import CAPTURE_BATCH_SIZES
from engine.llm_engine import LLMEngine
from engine.scheduling.draft_pause import FIRST_PAUSE
from engine.scheduling.request import Request
from engine.speculative.adaptive import AdaptiveDrafting
from engine.speculative.step_costs import StepCosts
from protocol import SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy
from tests.engine.test_speculative import REPETITIVE, assert_all_blocks_free

MAX_DRAFTS = 8


@dataclass
class Step:
    """One step's verified drafts (read in it) and those accepted, from the engine's stats."""

    drafts: int
    accepted: int
    overlapped: bool  # it left a plain step in flight: no one was drafted for


def make_engine(directory: Path, **options: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "block_size": 4,
        "kv_cache_memory_gb": 0.01,
        "num_speculative_tokens": MAX_DRAFTS,
        "overlap_steps": True,  # as on CUDA: a step that drafts for no one overlaps
        **options,
    }
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


def generate_alone(
    engine: LLMEngine, prompt: list[int], max_tokens: int, **sampling: Any
) -> tuple[list[int], list[Step], Request]:
    """One request's tokens (greedy unless ``sampling`` says), each step's drafts, and the
    request."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    engine.add_request(b"t", "alone", prompt, params)
    (request,) = engine.requests.values()
    tokens: list[int] = []
    steps = []
    while engine.has_work:
        before = engine.stats()
        for _, output in engine.step():
            tokens += output.new_token_ids
        after = engine.stats()
        in_flight = engine.in_flight
        steps.append(
            Step(
                after.num_draft_tokens - before.num_draft_tokens,
                after.num_accepted_tokens - before.num_accepted_tokens,
                in_flight is not None and not in_flight.verifies_drafts,
            )
        )
    assert_all_blocks_free(engine)
    return tokens, steps, request


@pytest.fixture(scope="module")
def repeating(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    """A tiny Llama of transformers' default initialization: its greedy output soon repeats
    itself, so prompt lookup's drafts are accepted."""
    directory = tmp_path_factory.mktemp("repeating")
    return directory, save_tiny_llama(directory)


def test_repeating_text_drafts_the_most_tokens(repeating: tuple[Path, HFLlama]) -> None:
    """The model's answer to its own first 96 tokens goes on looping over five tokens."""
    directory, hf_model = repeating
    prompt = REPETITIVE + hf_greedy(hf_model, REPETITIVE, 96)
    engine = make_engine(directory, speculative_method="ngram")
    tokens, steps, request = generate_alone(engine, prompt, 48)
    assert tokens == hf_greedy(hf_model, prompt, 48)
    first = next(index for index, step in enumerate(steps) if step.drafts)
    verified = steps[first:-1]  # the last step reads what is left
    # Every step drafts all the lookup finds (the five tokens after the loop's latest
    # occurrence, fewer than k = 8), and all are accepted.
    assert [step.drafts for step in verified] == [5] * len(verified)
    assert all(step.accepted == step.drafts for step in verified)
    assert len(steps) < 48 / 3  # several tokens a step
    assert request.draft_pause.next_pause == FIRST_PAUSE  # never paused for long


def test_text_that_does_not_repeat_is_paused(tiny: tuple[Path, HFLlama]) -> None:
    """A random model's answer sampled at temperature 1: its n-grams seldom recur, and what
    followed them then does not come again, so the drafts are rejected; after a few probes
    the request decodes as without speculation, its steps overlapped. The tokens are those
    of the same seed without speculation."""
    directory, _ = tiny
    prompt = random_prompts(5)[4]  # 64 tokens
    sampling = {"temperature": 1.0, "seed": 7}
    plain, _, _ = generate_alone(make_engine(directory), prompt, 96, **sampling)
    engine = make_engine(directory, speculative_method="ngram", prompt_lookup_min=1)
    tokens, steps, request = generate_alone(engine, prompt, 96, **sampling)
    assert tokens == plain
    drafted = sum(step.drafts for step in steps)
    assert drafted > 0 and sum(step.accepted for step in steps) < 0.3 * drafted
    second_half = steps[len(steps) // 2 :]
    # Most steps overlapped, not all: the costs the policy weighs are the engine's clock's,
    # so on a busy machine a probe now and then finds drafting paying and drafts again.
    assert sum(step.overlapped for step in second_half) > 0.6 * len(second_half)
    assert sum(bool(step.drafts) for step in steps) < 0.25 * len(steps)
    assert request.draft_pause.next_pause > FIRST_PAUSE  # paused, and paused again longer


def test_a_draft_that_is_never_right_is_paused(
    tiny: tuple[Path, HFLlama], other_draft: Path
) -> None:
    """Another model drafting (nearly every draft rejected) drafts a few times, then is
    paused: far fewer drafts than at a fixed k; the tokens are the target's. The target as
    its own draft (every draft accepted) keeps its tokens too."""
    directory, hf_model = tiny
    prompt = random_prompts(2)[1]
    expected = hf_greedy(hf_model, prompt, 64)
    engine = make_engine(directory, speculative_model=str(directory))
    tokens, steps, _ = generate_alone(engine, prompt, 64)
    assert tokens == expected
    assert all(step.accepted == step.drafts for step in steps)
    drafted = {}
    for adaptive in (True, False):
        engine = make_engine(
            directory,
            speculative_model=str(other_draft),
            speculative_adaptive=adaptive,
            speculative_pause_acceptance=0,  # at a fixed k: never paused
        )
        tokens, steps, _ = generate_alone(engine, prompt, 64)
        assert tokens == expected
        drafted[adaptive] = sum(step.drafts for step in steps)
        if adaptive:  # paused: its steps overlap as without speculation
            second_half = steps[len(steps) // 2 :]
            assert sum(step.overlapped for step in second_half) > 0.8 * len(second_half)
    assert 0 < drafted[True] < drafted[False] / 4


def test_k_follows_the_measured_acceptance() -> None:
    """The policy alone, at costs as measured on a GPU for a small draft model (a verify step
    1.2 plain steps, a draft pass 0.2): a request whose drafts are all accepted starts at a
    small k (acceptance unknown: an even chance) and reaches the most as its acceptance is
    measured; one whose drafts are all rejected gets k = 0, paused."""
    costs = StepCosts(draft_pass_prior=1.0)
    costs.measured = [[1.0] * len(CAPTURE_BATCH_SIZES), [1.2] * len(CAPTURE_BATCH_SIZES)]
    costs.measured.append([0.2] * len(CAPTURE_BATCH_SIZES))
    for accepting in (True, False):
        policy = AdaptiveDrafting(MAX_DRAFTS, costs, max_batch=None)
        request = Request(b"t", "r", [1, 2, 3], SamplingParams(), seed=0)
        ks = []
        for _ in range(6):
            drafting, k = policy.plan([request], 1)
            if not drafting:
                break
            drafts = policy.choose([request], [[7] * k], [0], 1, k)
            ks.append(len(drafts[0]))
            policy.record(request, k, k if accepting else 0)
        if accepting:
            assert ks[0] < ks[-1] == MAX_DRAFTS, ks
            assert ks == sorted(ks)
        else:
            assert len(ks) < 3 and request.draft_pause.steps_left > 0, ks
