"""Draft-model speculative decoding on the CPU: greedy output equals transformers' token for
token in every family, with the target as its own draft (every draft accepted) and with
another random model as the draft (almost none accepted); a mixed batch (seeded sampling,
chunked prefill, cached prefixes, preemption) gives what it gives without speculation;
sampled output follows the target's distribution; a draft of another vocabulary, or under
tensor parallelism, is refused; requests whose drafts keep being rejected are paused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.scheduling.draft_pause import FIRST_PAUSE, DraftPause
from engine.speculative.draft_model import DraftModelProposer, DraftVocabularyError
from protocol import SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama, save_word_tokenizer
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_logprobs import generate
from tests.engine.test_model_families import FAMILIES, saved_tiny_model
from tests.engine.test_speculative import (
    REPETITIVE,
    assert_all_blocks_free,
    assert_follows_the_model,
    mixed_requests,
)

# Drafts every step, however few are accepted: the mechanism at work throughout.
NEVER_PAUSED = {"speculative_adaptive": False, "speculative_pause_acceptance": 0}


def make_engine(directory: Path, draft: Path | None, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    if draft is not None:
        settings = {"speculative_model": str(draft), "num_speculative_tokens": 3, **settings}
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_transformers_in_every_family(
    name: str, tmp_path: Path, other_draft: Path
) -> None:
    hf_model = saved_tiny_model(name, tmp_path)
    prompts = [*random_prompts(6), REPETITIVE]
    expected = [hf_greedy(hf_model, p, 20) for p in prompts]
    # The target as its own draft: every draft is the target's greedy token.
    engine = make_engine(tmp_path, tmp_path, **NEVER_PAUSED)
    assert run_engine(engine, prompts, max_tokens=20) == expected
    assert engine.num_draft_tokens > 0
    assert engine.num_accepted_tokens == engine.num_draft_tokens
    assert_all_blocks_free(engine)
    # Another model's drafts: nearly all rejected, the output the same.
    engine = make_engine(tmp_path, other_draft, **NEVER_PAUSED)
    assert run_engine(engine, prompts, max_tokens=20) == expected
    assert engine.num_draft_tokens > 100
    assert engine.num_accepted_tokens < 0.1 * engine.num_draft_tokens
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("draft", ["itself", "other"])
@pytest.mark.parametrize("overlap_steps", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_mixed_batch_gives_what_it_gives_without_speculation(
    tiny: tuple[Path, HFLlama], other_draft: Path, draft: str, overlap_steps: bool
) -> None:
    """Seeded and greedy requests, a prompt prefilled in chunks (and the draft's catch-up of
    it too), one with a cached prefix, and too few blocks for all: some are preempted."""
    directory, _ = tiny
    prompts = random_prompts(6)
    shared = prompts[4][:40]
    requests = {
        **mixed_requests(prompts, shared, prompts[3]),
        "short": (prompts[0], SamplingParams(max_tokens=3, ignore_eos=True)),
    }
    settings = dict(max_num_batched_tokens=24, max_num_seqs=8, num_kv_blocks=40, max_model_len=160)
    draft_directory = directory if draft == "itself" else other_draft
    results = []
    for speculative in (False, True):
        engine = make_engine(
            directory,
            draft_directory if speculative else None,
            overlap_steps=overlap_steps,
            speculative_adaptive=False,  # drafts every step: the mechanism throughout
            **settings,
        )
        if speculative:  # as on CUDA: what it writes in block 0 is never read
            assert isinstance(engine.proposer, DraftModelProposer)
            engine.proposer.warm_up()
        run_engine(engine, [[*shared, 3]], max_tokens=2)  # the prefix is cached now
        results.append(generate(engine, requests))
        assert engine.block_manager.num_hit_tokens > 0
        assert engine.scheduler.num_preemptions > 0
        assert_all_blocks_free(engine)
    assert engine.num_draft_tokens > 0
    if draft == "itself":
        assert engine.num_accepted_tokens > 0.5 * engine.num_draft_tokens
    plain, speculated = results
    for request_id in requests:
        ours, theirs = speculated[request_id], plain[request_id]
        assert [t for o in ours for t in o.new_token_ids] == [
            t for o in theirs for t in o.new_token_ids
        ], request_id
        assert ours[-1].finish_reason == theirs[-1].finish_reason


def test_the_draft_catches_up_after_steps_without_drafts(
    tiny: tuple[Path, HFLlama],
) -> None:
    """Steps draft nothing while 3 requests or more run; once the short ones finish, the
    draft catches up on the tokens it missed in one pass and, being the target, still has
    every draft accepted."""
    directory, hf_model = tiny
    prompts = random_prompts(4)
    engine = make_engine(directory, directory, speculative_disable_by_batch_size=3, **NEVER_PAUSED)
    sampling = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 8, 30, 30)]
    requests = {str(i): (p, s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))}
    outputs = generate(engine, requests)
    for i, prompt in enumerate(prompts):
        tokens = [t for o in outputs[str(i)] for t in o.new_token_ids]
        assert tokens == hf_greedy(hf_model, prompt, sampling[i].max_tokens)
    assert engine.num_draft_tokens > 0
    assert engine.num_accepted_tokens == engine.num_draft_tokens


def test_a_cached_prefix_brings_the_drafts_cache_with_it(
    tiny: tuple[Path, HFLlama], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose prompt starts with a prefix that an earlier, drafted request computed
    takes the draft's K/V of it with the target's: the draft computes only the rest, and,
    being the target, still has every draft accepted (its K/V of the prefix are right). One
    whose prefix was cached while nothing drafted (penalties) has the draft compute it all,
    though its blocks (22 in all, so they are reused) held the draft's K/V of other tokens."""
    directory, hf_model = tiny
    engine = make_engine(directory, directory, num_kv_blocks=22, max_model_len=88, **NEVER_PAUSED)
    proposer = engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    computed: list[int] = []  # each pass's catch-up lengths
    run = proposer._run

    def counting_run(rows: list, counts: list[int]) -> list[list[int]]:
        computed.extend(end - start for _, start, end in rows)
        return run(rows, counts)

    monkeypatch.setattr(proposer, "_run", counting_run)
    prefix = random_prompts(5)[4]  # 64 tokens: 16 blocks of 4
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    first = [*prefix, 7]
    assert run_engine(engine, [first], max_tokens=12) == [hf_greedy(hf_model, first, 12)]
    # Drafting starts after the prompt's step: the prompt and its first token.
    assert computed[0] == 66  # the first request: all of it
    computed.clear()
    drafts_before = engine.num_draft_tokens
    outputs = generate(engine, {"again": ([*prefix, 9, 3], greedy)})
    assert [t for o in outputs["again"] for t in o.new_token_ids] == hf_greedy(
        hf_model, [*prefix, 9, 3], 12
    )
    assert computed[0] == 67 - 64  # the prefix's 64 tokens were in the draft's cache
    assert engine.num_draft_tokens > drafts_before
    assert engine.num_accepted_tokens == engine.num_draft_tokens
    # A prefix computed without drafting (penalties: no drafts) is not the draft's to reuse.
    other = random_prompts(8, seed=2)[6]  # 40 tokens
    penalized = SamplingParams(max_tokens=4, ignore_eos=True, repetition_penalty=1.2)
    generate(engine, {"penalized": ([*other, 5], penalized)})
    computed.clear()
    generate(engine, {"after": ([*other, 6], greedy)})
    assert engine.block_manager.num_hit_tokens >= 64 + 40
    assert computed[0] == 42
    assert engine.num_accepted_tokens == engine.num_draft_tokens
    assert_all_blocks_free(engine)


def test_sampled_output_follows_the_target_distribution(tmp_path: Path) -> None:
    """Many seeds of a tiny vocabulary, another random model drafting: the first two
    tokens' joint frequencies against transformers' probabilities (chi-squared)."""
    vocab = 6
    target, draft = tmp_path / "target", tmp_path / "draft"
    overrides = dict(vocab_size=vocab, eos_token_id=vocab - 1)
    hf_model = save_tiny_llama(target, initializer_range=0.5, **overrides)
    save_tiny_llama(draft, initializer_range=0.5, num_hidden_layers=1, **overrides)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    engine = make_engine(
        target,
        draft,
        max_num_seqs=256,
        num_kv_blocks=3000,
        speculative_disable_by_batch_size=0,  # hundreds of requests at once: drafted for all
        **NEVER_PAUSED,
    )
    num_samples = 2000
    for seed in range(num_samples):
        sampling = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=seed)
        engine.add_request(b"t", str(seed), prompt, sampling)
    tokens: dict[str, list[int]] = {str(s): [] for s in range(num_samples)}
    while engine.has_work:
        for _, output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
    assert_follows_the_model(hf_model, prompt, vocab, list(tokens.values()))


def test_a_draft_of_another_vocabulary_is_refused(
    tiny: tuple[Path, HFLlama], tmp_path: Path
) -> None:
    directory, _ = tiny
    smaller = tmp_path / "smaller"
    save_tiny_llama(smaller, vocab_size=128, eos_token_id=127)
    with pytest.raises(DraftVocabularyError, match=r"vocabulary of 128 tokens .* 256"):
        make_engine(directory, smaller)
    worded = tmp_path / "worded"
    save_tiny_llama(worded)
    save_word_tokenizer(worded, 256)  # the same size, other tokens
    with pytest.raises(DraftVocabularyError, match="tokenizer differs"):
        make_engine(directory, worded)


def test_a_draft_under_tensor_parallelism_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        make_engine(directory, directory, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs --speculative-model"):
        make_engine(directory, None, speculative_method="draft_model")


def test_requests_whose_drafts_are_rejected_are_paused(
    tiny: tuple[Path, HFLlama], other_draft: Path
) -> None:
    """At a fixed k, with another model drafting, pausing cuts the drafts several times over;
    the output is the same; a good draft (the target itself) is never paused."""
    directory, hf_model = tiny
    prompts = random_prompts(4)
    expected = [hf_greedy(hf_model, p, 32) for p in prompts]
    drafted = {}
    for threshold in (0.0, 0.25):
        engine = make_engine(
            directory,
            other_draft,
            speculative_adaptive=False,
            speculative_pause_acceptance=threshold,
        )
        tokens, paused = run_watching_pauses(engine, prompts, 32)
        assert tokens == expected
        assert paused == (threshold > 0)
        drafted[threshold] = engine.num_draft_tokens
    assert drafted[0.25] < drafted[0.0] / 3
    engine = make_engine(
        directory, directory, speculative_adaptive=False, speculative_pause_acceptance=0.25
    )
    assert run_watching_pauses(engine, prompts, 32) == (expected, False)
    assert engine.num_accepted_tokens == engine.num_draft_tokens > 0


def run_watching_pauses(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], bool]:
    """``run_engine``'s tokens, and whether any request was paused."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(b"test", str(i), prompt, sampling)
    requests = list(engine.requests.values())
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    paused = any(r.draft_pause.next_pause > FIRST_PAUSE for r in requests)
    return [outputs[str(i)] for i in range(len(prompts))], paused


def test_pause_backs_off_and_resets() -> None:
    pause = DraftPause()
    pause.record(4, 0, 0.25)
    assert pause.may_draft()  # one poor step is not enough
    pause.record(4, 0, 0.25)
    assert [pause.may_draft() for _ in range(5)] == [False] * 4 + [True]
    pause.record(4, 0, 0.25)
    pause.record(4, 0, 0.25)
    assert [pause.may_draft() for _ in range(9)] == [False] * 8 + [True]  # twice as long
    pause.record(4, 1, 0.25)  # a good step: the next pause is short again
    pause.record(4, 0, 0.25)
    pause.record(4, 0, 0.25)
    assert [pause.may_draft() for _ in range(5)] == [False] * 4 + [True]
