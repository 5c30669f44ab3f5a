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
from engine.speculative.step_costs import DRAFT_PASS, PLAIN, PROPOSED_NOTHING, StepCosts
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
    tokens, steps, _ = generate_alone(engine, prompt, 96, **sampling)
    assert tokens == plain
    drafted = sum(step.drafts for step in steps)
    assert drafted > 0 and sum(step.accepted for step in steps) < 0.3 * drafted
    second_half = steps[len(steps) // 2 :]
    # Most steps overlapped, not all: the costs the policy weighs are the engine's clock's,
    # so on a busy machine a probe now and then finds drafting paying and drafts again.
    assert sum(step.overlapped for step in second_half) > 0.6 * len(second_half)
    assert sum(bool(step.drafts) for step in steps) < 0.25 * len(steps)


def test_a_draft_that_is_never_right_is_paused(
    tiny: tuple[Path, HFLlama], other_draft: Path
) -> None:
    """Another model drafting (nearly every draft rejected) drafts a few times or none, then
    is paused: far fewer drafts than at a fixed k; the tokens are the target's. The target as
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
    # Drafting not at all is as good: a draft pass as costly as the target's own pays only
    # if nearly every draft is accepted, which the CPU's measured costs may show at once.
    assert drafted[True] < drafted[False] / 4


def measured_costs(plain: float, verify: float, draft_pass: float) -> StepCosts:
    """Step costs as the engine's clock would measure them: plain steps, then verify steps of
    one draft (a draft model's prior: a pass as a plain step)."""
    costs = StepCosts(draft_pass_prior=1.0)
    clock = 0.0
    for _ in range(6):
        costs.observe(clock, 1, 1, 0.0, 0)
        clock += plain
    for _ in range(6):
        costs.observe(clock, 2, 1, draft_pass, 1)
        clock += verify + draft_pass
    return costs


def test_k_follows_the_measured_acceptance() -> None:
    """The policy alone, at costs as measured on a GPU for a small draft model (a verify step
    1.2 plain steps, a draft pass 0.2): a request whose drafts are all accepted starts at a
    small k (acceptance unknown: an even chance) and reaches the most as its acceptance is
    measured; one whose drafts are all rejected gets k = 0, paused."""
    costs = measured_costs(1.0, 1.2, 0.2)
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


def test_text_that_starts_copying_is_drafted_for_at_once() -> None:
    """Prompt lookup (its preview on the host's tokens) finding nothing for 40 steps, then an
    earlier copy of the latest tokens: the request drafts within two steps of it, and its
    back-off never grew (a request that found nothing waited a step or two between lookups;
    it used to pause 4, 8, 16, 32 steps and found the copy 24 steps late)."""
    costs = measured_costs(1.0, 1.2, 0.0)
    step = 0
    policy = AdaptiveDrafting(MAX_DRAFTS, costs, None, preview=lambda request: 4 * (step >= 40))
    request = Request(b"t", "r", [1, 2, 3], SamplingParams(), seed=0)
    drafted = []
    for step in range(60):
        drafting, k = policy.plan([request], 1)
        if drafting:
            found = [[7] * k] if step >= 40 else [[]]
            drafts = policy.choose([request], found, [4 if found[0] else 0], 1, k)
            if drafts[0]:
                drafted.append(step)
                policy.record(request, k, k)
    assert drafted and 40 <= drafted[0] <= 42, drafted
    assert drafted == list(range(drafted[0], 60))
    assert request.draft_pause.next_pause == FIRST_PAUSE


@dataclass
class AsyncDevice:
    """An engine's steps on a simulated asynchronous device, for the policy and the step
    costs alone: a step's host work takes its seconds, then the device runs the step while
    the next step's host work goes on, and that step waits for it only when it must (a verify
    step's tokens; a plain step reads the one before it). A draft model's passes are
    launches the host does not wait for: their time shows in the next step's time only
    (``propose_seconds`` is 0). Every draft is accepted (the target as its own draft) or
    none (a draft that guesses nothing); a draft more tokens behind than a graph's catch-up
    takes (after a pause) catches up op by op (``catch_up`` seconds). The defaults are
    SmolLM2-135M's as bench_speculative measured them on an H200: a plain step 0.54 ms of
    host work, a verify step 1.47 ms with nothing to overlap, and the graphs' device times
    the seeds, which make a draft pass look cheaper than it is."""

    draft_pass: float  # one draft pass, on the device
    plain_host: float = 0.54
    plain_device: float = 0.25
    verify_host: float = 1.17
    verify_device: float = 0.3
    accepted: bool = True
    # From this step on every draft is accepted, whatever ``accepted`` says.
    right_from_step: int | None = None
    # The draft graph's device time, timed at start-up (the policy's seed for a pass). None:
    # the pass's, at most the target's own step's (as for the target as its own draft).
    draft_device: float | None = None
    catch_up: float = 0.0
    # The engine's first steps, while it warms, take this many times the host's work.
    warm_up_steps: int = 0
    warm_up_factor: float = 1.0

    def run(self, steps: int) -> tuple[float, int, int]:
        """Decode one request ``steps`` steps as the engine does; the seconds, tokens and
        verify steps."""
        seconds, tokens, verify_steps = self.run_steps(steps)
        return seconds, tokens, len(verify_steps)

    def run_steps(self, steps: int) -> tuple[float, int, list[int]]:
        """``run``, with the steps that verified drafts."""
        costs = StepCosts(draft_pass_prior=1.0)
        costs.seeded[PLAIN] = [self.plain_device] * len(CAPTURE_BATCH_SIZES)
        draft_seed = self.draft_device
        if draft_seed is None:
            draft_seed = min(self.draft_pass, self.plain_device)
        costs.seeded[DRAFT_PASS] = [draft_seed] * len(CAPTURE_BATCH_SIZES)
        policy = AdaptiveDrafting(MAX_DRAFTS, costs, max_batch=None)
        request = Request(b"t", "r", [1, 2, 3], SamplingParams(), seed=0)
        clock, done, previous_done, tokens = 0.0, 0.0, 0.0, 0
        verify_steps: list[int] = []
        behind = 0  # tokens the draft has not seen
        for step in range(steps):
            started = clock
            drafting, width = policy.plan([request], 1)
            drafts = [[]]
            if drafting:
                clock = max(clock, done)  # proposing reads the step in flight
                drafts = policy.choose([request], [[7] * width], [0], 1, width)
            k = len(drafts[0])
            if k:
                clock += self.verify_host
                drafting_seconds = width * self.draft_pass
                if behind > 1 + MAX_DRAFTS:
                    drafting_seconds += self.catch_up
                done = max(clock, done) + self.verify_device + drafting_seconds
                verify_steps.append(step)
                right = self.accepted or (
                    self.right_from_step is not None and step >= self.right_from_step
                )
                accepted = k if right else 0
                policy.record(request, k, accepted)
                tokens += 1 + accepted
                behind = 0
            else:
                warming = step < self.warm_up_steps
                clock += self.plain_host * (self.warm_up_factor if warming else 1.0)
                done = max(clock, done) + self.plain_device
                tokens += 1
                behind += 1
                clock = max(clock, previous_done)  # a plain step reads the one before it
            previous_done = done
            if k:
                clock = done  # the next step reads it first
            costs.observe(started, 1 + k if k else (0 if drafting else 1), 1, 0.0, width)
        return max(clock, done), tokens, verify_steps


def test_a_draft_whose_cost_only_the_next_step_shows_is_paused() -> None:
    """A draft whose pass costs 0.64 ms, more than the target's plain step, on a device whose
    passes the host does not wait for, while its graph's device time (0.1 ms, the policy's
    seed even scaled by the host's share) makes it look cheap: every draft is accepted, but
    k + 1 tokens cost a verify step and k passes, more than k + 1 plain steps. The policy must
    find that from the steps' times alone and pause: at least 97% of plain decoding's tokens a
    second. A draft pass cheap enough pays, by the same mechanism."""
    plain_rate = 1 / AsyncDevice.plain_host
    seconds, tokens, verify_steps = AsyncDevice(draft_pass=0.64, draft_device=0.1).run(2000)
    assert tokens / seconds > 0.97 * plain_rate, (tokens / seconds / plain_rate, verify_steps)
    assert verify_steps < 2000 * 0.02
    seconds, tokens, verify_steps = AsyncDevice(draft_pass=0.05).run(2000)
    assert tokens / seconds > 2 * plain_rate and verify_steps > 1000


def test_a_plain_step_measured_while_the_engine_warms_is_measured_again_soon() -> None:
    """The costly draft of the test above on an engine whose first 8 steps take 1.4 times a
    plain step's host work: the plain step measured then is too high, and drafting seems to pay.
    The plain step is measured again after 16 verify steps (not 512), found faster, and
    drafting stops: at least 97% of plain decoding's tokens a second over 3,000 steps (its
    first steps as slow)."""
    device = AsyncDevice(draft_pass=0.64, draft_device=0.1, warm_up_steps=8, warm_up_factor=1.4)
    seconds, tokens, verify_steps = device.run(3000)
    plain_seconds = (3000 + 8 * (device.warm_up_factor - 1)) * device.plain_host
    assert tokens / seconds > 0.97 * 3000 / plain_seconds, tokens / seconds * plain_seconds / 3000
    assert verify_steps < 32


def test_a_draft_that_never_pays_costs_at_most_its_probes_share() -> None:
    """A draft that guesses nothing, whose probes after a pause catch up op by op on the
    tokens it missed, costing 5 plain steps (shown in the step after the probe): the probes
    wait until plain steps earned them, each found nothing and the next waited twice as long,
    so over 6,000 steps it costs less than 1% of plain decoding's speed, its first steps'
    drafts included. (Probes at a fixed 2% of the time cost 2%; every 64 steps, 13%.)"""
    device = AsyncDevice(draft_pass=0.2, accepted=False, catch_up=2.7)
    seconds, tokens, verify_steps = device.run(6000)
    plain_rate = 1 / device.plain_host
    assert tokens / seconds > 0.99 * plain_rate, (tokens / seconds / plain_rate, verify_steps)


def test_a_draft_that_starts_guessing_is_found_by_a_later_probe() -> None:
    """The draft of the test above guesses nothing for 3,000 steps, by when its probes came
    at the least share, then guesses every token: the next probe finds it (at the least share,
    a probe's cost over 0.25% of a plain step: under 3,500 steps), and probes come at the full
    share again, each finding drafts accepted, so that 2,000 steps after the first the request
    drafts at more than 95% of its steps (all but the plain steps that measure a plain step
    again now and then). Probes left at the least share found it once in 6,000 steps."""
    device = AsyncDevice(draft_pass=0.2, accepted=False, catch_up=2.7, right_from_step=3000)
    _, _, verify_steps = device.run_steps(9000)
    found = [step for step in verify_steps if step >= 3000]
    assert found and found[0] < 6500, verify_steps
    window = range(found[0] + 2000, found[0] + 2500)
    drafted = len(set(window).intersection(found))
    assert drafted > 0.95 * len(window), (drafted, found[:20])


def test_a_draft_that_cannot_pay_is_not_probed() -> None:
    """The costly draft of the tests above, whose probe after a pause first catches up op by
    op (30 plain steps' time): once its costs are measured, not even every draft accepted
    would pay, so its requests are not probed again: 99% of plain decoding's tokens a second
    over 3,000 steps, all its verify steps in the first few (probed within the 2% budget, it
    fell short)."""
    device = AsyncDevice(draft_pass=0.64, draft_device=0.1, catch_up=30.0)
    seconds, tokens, verify_steps = device.run(3000)
    assert tokens / seconds > 0.99 / device.plain_host, tokens * device.plain_host / seconds
    assert verify_steps < 10


def test_the_target_as_its_own_draft_is_priced_as_a_plain_step() -> None:
    """The target as its own draft, on a host that sets a small model's pace (a plain step
    0.54 ms, its graph 0.25 ms on the device): its draft pass, until measured, is the same
    graph's device time scaled by the host's share, a plain step's cost. Not even every
    draft accepted would pay then, so nothing is drafted, not even once, and no probe is
    made: all of plain decoding's speed. (Priced at the graph's device time alone, the draft
    seemed to pay, and its first verify steps cost 0.8% here; on an H200 SmolLM2 as its own
    draft lost 14% in one of bench_speculative's batch-32 runs, likely so.)"""
    device = AsyncDevice(draft_pass=0.64, catch_up=30.0)
    seconds, tokens, verify_steps = device.run(3000)
    assert verify_steps == 0
    assert tokens / seconds > 0.999 / device.plain_host, tokens * device.plain_host / seconds


def test_a_probe_that_could_not_win_back_its_cost_is_not_made() -> None:
    """The target as its own draft on a large model at batch 1, bound by the device (the
    8B shape's as bench_speculative measured it on an H200: a plain step 4 ms, a verify step
    about as much, a draft pass 3.87 ms, a probe's catch-up 30 ms): every draft is accepted,
    but drafting at best gains 5% a step, which in a longest pause's 64 steps does not win a
    probe's cost back. After its first probe it is not probed again (probed at 2% of the time,
    every draft accepted restoring the share, it cost 1.5%): over 3,000 steps, more than
    99.5% of plain decoding's tokens a second."""
    device = AsyncDevice(
        draft_pass=3.87,
        plain_host=0.3,
        plain_device=4.0,
        verify_host=0.3,
        verify_device=4.1,
        catch_up=30.0,
    )
    seconds, tokens, verify_steps = device.run(3000)
    assert tokens / seconds > 0.995 / device.plain_device, (tokens * 4.0 / seconds, verify_steps)
    assert verify_steps <= 2


def test_costs_not_measured_at_a_batch_size_follow_the_nearest_measured() -> None:
    """A verify step and a draft pass measured at batch 1 only: at batch 8, where only plain
    steps were measured, they cost as at batch 1 in proportion to the plain steps (not as a
    plain step and the graphs' device time, which made every batch size learn them again
    with verify steps of its own)."""
    costs = StepCosts(draft_pass_prior=1.0)
    clock = 0.0
    # (kind, batch size, seconds, the proposer's): plain and verify steps at 1, plain at 8.
    steps = [(1, 1, 1.0, 0.0)] * 6 + [(2, 1, 1.4, 0.2)] * 6 + [(1, 8, 1.5, 0.0)] * 5
    for kind, batch_size, seconds, propose_seconds in steps:
        costs.observe(clock, kind, batch_size, propose_seconds, kind - 1)
        clock += seconds
    at_eight = costs.costs(8)
    assert at_eight.plain == pytest.approx(1.5)
    assert at_eight.verify == pytest.approx(1.2 * 1.5) and at_eight.draft_pass == pytest.approx(0.3)


def test_the_plain_step_is_measured_again_after_long_drafting() -> None:
    """Drafting that pays runs no plain steps: after 16 verify steps at a batch size, then 32,
    64 and so on up to 512, the plain step there counts as unknown until two plain steps in a
    row measure it again (a faster one brings the estimate down at once), or, where prompts
    keep coming (no such pair), for 8 steps at most."""
    costs = measured_costs(1.0, 1.2, 0.2)
    clock = 100.0
    for kind in (1, 1, 1):  # plain steps after the verify steps there: none since
        costs.observe(clock, kind, 1, 0.0, 0)
        clock += 1.0
    for interval in (16, 32, 64, 128, 256, 512, 512):
        for _ in range(interval - 1):
            costs.observe(clock, 2, 1, 0.2, 1)
            clock += 1.4
            assert costs.knows_plain(1)
        costs.observe(clock, 2, 1, 0.2, 1)
        clock += 1.4
        assert not costs.knows_plain(1), interval
        for kind in (1, 1, 1):  # the second's period measures the plain step
            costs.observe(clock, kind, 1, 0.0, 0)
            clock += 0.8
        assert costs.knows_plain(1)
    assert costs.costs(1).plain < 0.85
    for _ in range(512):
        costs.observe(clock, 2, 1, 0.2, 1)
        clock += 1.4
    steps = 0
    while not costs.knows_plain(1) and steps < 100:  # steps with prompts: no plain pair
        costs.observe(clock, 0, 1, 0.0, 0)
        clock += 2.0
        steps += 1
    assert steps == 8


def test_a_probe_that_verifies_nothing_is_charged_too() -> None:
    """A probe whose proposer found nothing (or only caught a draft up) still read the step
    before it early and ran: from its start to the end of the step after it, beyond two plain
    steps, is its cost."""
    costs = measured_costs(1.0, 1.2, 0.2)
    clock = 100.0
    for kind, seconds in ((1, 1.0), (1, 1.0), (PROPOSED_NOTHING, 2.0), (1, 1.5), (1, 1.0)):
        costs.observe(clock, kind, 1, 0.0, 0)
        clock += seconds
    assert costs.take_probe_seconds() == pytest.approx(1.5)
