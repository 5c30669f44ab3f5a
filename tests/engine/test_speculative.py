"""N-gram (prompt-lookup) speculative decoding on the CPU: greedy output equals transformers'
token for token in every family, with drafts accepted and rejected; a mixed batch (sampled,
seeded, penalties, log-probabilities, stops, chunked prefill, cached prefixes, preemption)
gives what it gives without speculation; sampled output follows the target's distribution;
verify steps reach tensor-parallel workers."""

from __future__ import annotations

from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.speculative import ngram
from engine.speculative.ngram import find_continuation
from protocol import RequestOutput, SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_logprobs import generate
from tests.engine.test_model_families import FAMILIES, saved_tiny_model
from tests.engine.test_prompt_logprobs import prompt_logprobs_of

REPETITIVE = [5, 6, 7, 8, 9] * 6 + [5, 6]


def make_engine(directory: Path, speculative: bool = True, **overrides: Any) -> LLMEngine:
    """An engine of prompt lookup at a fixed k: the mechanism, every step that can draft does
    (whether drafting pays on this machine's clock is the adaptive policy's, tested in
    test_adaptive_speculation.py)."""
    settings: dict[str, Any] = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    if speculative:
        settings = {
            "speculative_method": "ngram",
            "num_speculative_tokens": 3,
            "speculative_adaptive": False,
            **settings,
        }
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def token_bytes(tokens: list[int]) -> bytearray:
    """Token ids as the n-gram lookup keeps them: int32 ids in one byte string."""
    return bytearray(array("i", tokens))


def test_find_continuation_takes_the_longest_then_latest_ngram() -> None:
    tokens = token_bytes([1, 2, 3, 9, 2, 3, 4, 7, 1, 2, 3])
    # "1 2 3" occurred once, followed by 9: the longest match wins over "2 3" -> 4.
    assert find_continuation(tokens, 1, 3, 2) == ([9, 2], 3)
    assert find_continuation(tokens, 1, 2, 2) == ([4, 7], 2)  # "2 3", latest first
    assert find_continuation(tokens, 4, 5, 2) == ([], 0)  # no 4-gram repeats
    assert find_continuation(token_bytes([5]), 1, 3, 2) == ([], 0)
    # The bytes of 2 << 24 then 0 hold those of 2 across the two tokens: the latest match of
    # the bytes is no occurrence of the token, the one before it is.
    assert find_continuation(token_bytes([2, 7, 2 << 24, 0, 2]), 1, 1, 1) == ([7], 1)


@pytest.mark.parametrize("search", ["bytes", "array"])
def test_find_continuation_equals_a_search_of_every_occurrence(
    search: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the rule checked one occurrence at a time (the longest suffix of min_n to max_n
    tokens that occurred before, of those the latest): sequences of a few distinct tokens, so
    that suffixes recur, some latest occurrences matching as far back as any can and some
    not; in a third of them ids of one nonzero byte each, at different places (2, 2 << 8,
    2 << 16, 2 << 24), whose bytes also match across two tokens, which must not count. Both
    searches: the byte string's (short sequences) and the array's (long ones, here every
    one)."""
    if search == "array":
        monkeypatch.setattr(ngram, "_LONGEST_BYTE_SEARCH", 0)

    def searched(tokens: list[int], min_n: int, max_n: int, count: int) -> tuple[list[int], int]:
        best, best_end = 0, -1
        for end in range(len(tokens) - 1):
            n = 0
            while (
                n < min(max_n, len(tokens) - 1)
                and n <= end
                and (tokens[end - n] == tokens[len(tokens) - 1 - n])
            ):
                n += 1
            if n >= min_n and n >= best:
                best, best_end = n, end
        return (tokens[best_end + 1 : best_end + 1 + count], best) if best else ([], 0)

    rng = np.random.default_rng(0)
    for trial in range(1200):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        if trial % 3 == 0:
            tokens = [0 if token == 0 else 2 << (8 * (token - 1)) for token in tokens]
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 5))
        found = find_continuation(token_bytes(tokens), min_n, max_n, 3)
        assert found == searched(tokens, min_n, max_n, 3), (tokens, min_n, max_n)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_transformers_in_every_family(name: str, tmp_path: Path) -> None:
    hf_model = saved_tiny_model(name, tmp_path)
    # One-token n-grams: drafts are proposed at most steps, and most are rejected.
    engine = make_engine(tmp_path, prompt_lookup_min=1)
    prompts = [*random_prompts(6), REPETITIVE]
    assert run_engine(engine, prompts, max_tokens=20) == [
        hf_greedy(hf_model, p, 20) for p in prompts
    ]
    assert engine.num_draft_tokens > engine.num_accepted_tokens
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    """A tiny Llama of transformers' default initialization, whose greedy output soon repeats
    itself: prompt lookup's drafts are then accepted."""
    directory = tmp_path_factory.mktemp("repeating")
    return directory, save_tiny_llama(directory)


def test_accepted_drafts_keep_greedy_output_and_roll_back_the_rest(
    repeating: tuple[Path, HFLlama],
) -> None:
    directory, hf_model = repeating
    engine = make_engine(directory, num_speculative_tokens=4)
    prompts = [REPETITIVE, *random_prompts(3)]
    expected = [hf_greedy(hf_model, p, 30) for p in prompts]
    # One request stops at a token that speculation finds among its accepted drafts.
    stop_at = expected[0][12]
    requests = {
        str(i): (p, SamplingParams(max_tokens=30, ignore_eos=True)) for i, p in enumerate(prompts)
    }
    first_stop = expected[0].index(stop_at)
    requests["stop"] = (REPETITIVE, SamplingParams(max_tokens=30, stop_token_ids=[stop_at]))
    # Its stop token the last that max_tokens allows: a stop, not a length (the token is not
    # output); and a length reached within a step's accepted drafts.
    requests["stop-last"] = (
        REPETITIVE,
        SamplingParams(max_tokens=first_stop + 1, stop_token_ids=[stop_at]),
    )
    requests["length"] = (REPETITIVE, SamplingParams(max_tokens=13, ignore_eos=True))
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(b"t", request_id, prompt, sampling)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    steps = 0
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].append(output)
        steps += 1
        for request in engine.scheduler.running:  # rejected drafts hold no K/V and no block
            assert request.num_cached_tokens == request.num_tokens - 1
            assert len(request.block_ids) <= engine.block_manager.blocks_for(request.num_tokens)
    tokens = {i: [t for o in out for t in o.new_token_ids] for i, out in outputs.items()}
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    for request_id in ("stop", "stop-last"):
        assert tokens[request_id] == expected[0][:first_stop]
        assert outputs[request_id][-1].finish_reason == "stop"
    assert tokens["length"] == expected[0][:13]
    assert outputs["length"][-1].finish_reason == "length"
    assert engine.num_accepted_tokens > 0
    assert steps < 30  # several tokens a step
    assert_all_blocks_free(engine)


def test_verify_steps_reach_tensor_parallel_workers(repeating: tuple[Path, HFLlama]) -> None:
    """A verify step is a forward pass like any other: rank 0 sends it to its worker (two
    ranks over gloo), whose collectives it would otherwise wait for, and greedy output still
    equals transformers' with drafts accepted."""
    directory, hf_model = repeating
    engine = make_engine(directory, num_speculative_tokens=4, tensor_parallel_size=2)
    try:
        prompts = [REPETITIVE, *random_prompts(3)]
        assert run_engine(engine, prompts, max_tokens=30) == [
            hf_greedy(hf_model, p, 30) for p in prompts
        ]
        assert engine.num_accepted_tokens > 0
        assert_all_blocks_free(engine)
    finally:
        engine.close()


def mixed_requests(
    prompts: list[list[int]], shared: list[int], logprobs_prompt: list[int]
) -> dict[str, tuple[list[int], SamplingParams]]:
    """A batch of what speculation must leave as it is: greedy and seeded requests, top-p,
    logprobs, a penalty (not drafted for), a prompt long enough to prefill in chunks, and one
    whose prefix ``shared`` is cached."""
    return {
        "greedy": (REPETITIVE, SamplingParams(max_tokens=24, ignore_eos=True)),
        "seeded": (
            REPETITIVE,
            SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_k=20, seed=3),
        ),
        "top-p": (prompts[1], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=4)),
        "logprobs": (logprobs_prompt, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)),
        "penalized": (
            REPETITIVE,
            SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=1.0, seed=1),
        ),
        "long": (prompts[4] * 2, SamplingParams(max_tokens=12, ignore_eos=True)),  # chunked
        "cached": (shared + REPETITIVE, SamplingParams(max_tokens=12, ignore_eos=True)),
    }


@pytest.mark.parametrize(
    "options",
    [
        {"overlap_steps": False},
        {"overlap_steps": True},
        # Steps draft only once fewer than 3 requests run; the others overlap.
        {"overlap_steps": True, "speculative_disable_by_batch_size": 3},
    ],
    ids=["one-step-at-a-time", "overlapped", "overlapped-large-batches-not-drafted"],
)
def test_mixed_batch_gives_what_it_gives_without_speculation(
    tiny: tuple[Path, HFLlama], options: dict[str, Any]
) -> None:
    directory, _ = tiny
    prompts = random_prompts(6)
    shared = prompts[4][:40]
    requests = {
        **mixed_requests(prompts, shared, REPETITIVE),
        "prompt-logprobs": (prompts[2], SamplingParams(max_tokens=8, prompt_logprobs=2)),
    }
    settings = dict(max_num_batched_tokens=24, max_num_seqs=8, prompt_lookup_min=1)
    results = []
    for speculative in (False, True):
        engine = make_engine(directory, speculative, **settings, **(options if speculative else {}))
        run_engine(engine, [[*shared, 3]], max_tokens=2)  # the prefix is cached now
        results.append(generate(engine, requests))
        assert engine.block_manager.num_hit_tokens > 0
        assert_all_blocks_free(engine)
    assert engine.num_accepted_tokens > 0
    assert engine.in_flight is None
    plain, speculated = results
    for request_id in requests:
        ours = speculated[request_id]
        theirs = plain[request_id]
        assert [t for o in ours for t in o.new_token_ids] == [
            t for o in theirs for t in o.new_token_ids
        ], request_id
        assert ours[-1].finish_reason == theirs[-1].finish_reason
    logprobs = [
        [lp for o in out[key] for lp in o.logprobs or []]
        for out, key in ((plain, "logprobs"), (speculated, "logprobs"))
    ]
    assert len(logprobs[0]) == len(logprobs[1]) == 16
    for ours, theirs in zip(logprobs[1], logprobs[0], strict=True):
        assert ours.top_token_ids == theirs.top_token_ids
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    prompt_logprobs = [prompt_logprobs_of(out["prompt-logprobs"]) for out in (plain, speculated)]
    assert len(prompt_logprobs[0]) == len(prompts[2]) - 1
    for ours, theirs in zip(prompt_logprobs[1], prompt_logprobs[0], strict=True):
        assert (ours.rank, ours.top_token_ids) == (theirs.rank, theirs.top_token_ids)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_preempted_requests_keep_exact_output(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory, num_kv_blocks=40, max_model_len=160, prompt_lookup_min=1)
    prompts = [*random_prompts(7), REPETITIVE]
    assert run_engine(engine, prompts, max_tokens=24) == [
        hf_greedy(hf_model, p, 24) for p in prompts
    ]
    assert engine.scheduler.num_preemptions > 0 and engine.num_draft_tokens > 0
    assert_all_blocks_free(engine)


def test_sampled_output_follows_the_target_distribution(tmp_path: Path) -> None:
    """Many seeds of a tiny vocabulary: the first two tokens' joint frequencies against
    transformers' probabilities (chi-squared), drafts accepted and rejected on the way."""
    vocab = 6
    hf_model = save_tiny_llama(
        tmp_path, vocab_size=vocab, eos_token_id=vocab - 1, initializer_range=0.5
    )
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    engine = make_engine(  # hundreds of requests at once: drafted for all the same
        tmp_path,
        max_num_seqs=256,
        prompt_lookup_min=1,
        num_kv_blocks=4000,
        speculative_disable_by_batch_size=0,
    )
    num_samples = 3000
    sampling = [
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, seed=s)
        for s in range(num_samples)
    ]
    for seed, params in enumerate(sampling):
        engine.add_request(b"t", str(seed), prompt, params)
    tokens: dict[str, list[int]] = {str(s): [] for s in range(num_samples)}
    while engine.has_work:
        for _, output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert engine.num_accepted_tokens > 0 and engine.num_draft_tokens > engine.num_accepted_tokens
    assert_follows_the_model(hf_model, prompt, vocab, list(tokens.values()))


def assert_follows_the_model(
    hf_model: HFLlama, prompt: list[int], vocab: int, samples: list[list[int]]
) -> None:
    """The samples' first two tokens' joint frequencies against transformers' probabilities
    after ``prompt`` (chi-squared)."""
    num_samples = len(samples)
    counts = Counter(tuple(t[:2]) for t in samples)
    with torch.no_grad():
        first = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        after = torch.tensor([[*prompt, x] for x in range(vocab)])
        second = torch.softmax(hf_model(after).logits[:, -1].float(), dim=-1)
    expected = (first.unsqueeze(1) * second).numpy() * num_samples  # [x1, x2]
    observed = np.zeros((vocab, vocab))
    for (x1, x2), count in counts.items():
        observed[x1, x2] = count
    kept = expected > 5  # chi-squared needs expected counts of at least 5
    chi2 = (((observed - expected) ** 2) / expected)[kept].sum()
    # The 99.9th percentile of chi-squared with 35 degrees of freedom is 66.6.
    assert observed[~kept].sum() <= 5 * (~kept).sum() + 10
    assert chi2 < 66.6, chi2
