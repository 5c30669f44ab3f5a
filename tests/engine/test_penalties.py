"""Presence and frequency penalties against a plain loop over transformers' logits, and the
counts they read kept on the device from step to step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.execution.seen_tokens import SeenTokens, seen_token_table_bytes
from engine.llm_engine import LLMEngine, RequestRejected
from engine.scheduling.request import Request
from protocol import SamplingParams, TokenLogprobs
from tandem.testing.random_checkpoint import VOCAB, random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def penalized_greedy(
    model: HFLlama, prompt: list[int], steps: int, presence: float, frequency: float
) -> list[int]:
    output: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        output.append(int(logits.argmax()))
    return output


def test_penalized_greedy_matches_transformers(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", kv_cache_memory_gb=0.01))
    prompts = random_prompts(5)[2:]
    settings = [(0.0, 1.5), (1.0, 0.0), (0.5, 0.5)]  # (presence, frequency) per prompt
    for i, (prompt, (presence, frequency)) in enumerate(zip(prompts, settings, strict=True)):
        sampling = SamplingParams(
            max_tokens=16, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
        )
        engine.add_request(b"t", str(i), prompt, sampling)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id] += output.new_token_ids
    for i, (prompt, (presence, frequency)) in enumerate(zip(prompts, settings, strict=True)):
        expected = penalized_greedy(hf_model, prompt, 16, presence, frequency)
        assert outputs[str(i)] == expected
        assert expected != hf_greedy(hf_model, prompt, 16)  # the penalties changed something


def test_logit_bias_forces_and_bans_tokens(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", kv_cache_memory_gb=0.01))
    prompt = random_prompts(4)[3]
    plain = hf_greedy(hf_model, prompt, 8)
    requests = {
        "forced": SamplingParams(
            max_tokens=8, ignore_eos=True, logit_bias_token_ids=[42], logit_bias_values=[100.0]
        ),
        "banned": SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            logit_bias_token_ids=sorted(set(plain)),
            logit_bias_values=[-100.0] * len(set(plain)),
            logprobs=0,
        ),
    }
    for request_id, sampling in requests.items():
        engine.add_request(b"t", request_id, prompt, sampling)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    logprobs: list[TokenLogprobs] = []
    while engine.has_work:
        for _, output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            logprobs += output.logprobs or []
    assert tokens["forced"] == [42] * 8
    assert len(tokens["banned"]) == 8 and not set(tokens["banned"]) & set(plain)
    # Log-probabilities stay the raw model's, unbiased.
    assert len(logprobs) == 8 and all(lp.logprob > -20 for lp in logprobs)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", kv_cache_memory_gb=0.01))
    sampling = SamplingParams(logit_bias_token_ids=[VOCAB], logit_bias_values=[1.0])
    with pytest.raises(RequestRejected, match=r"token ids must be in \[0, 256\)"):
        engine.add_request(b"t", "r", [1, 2, 3], sampling)
    assert not engine.has_work  # nothing was queued


def test_seen_tokens_count_each_output_once_across_steps_and_lost_slots() -> None:
    """Each penalized request's slot holds its output's counts (the pending token included)
    and its prompt, added to step by step; a row without penalties reads another's slot; a
    request whose slot another took while it was out of the steps is counted afresh."""
    vocab = 12
    seen = SeenTokens(2, vocab, torch.device("cpu"))
    penalized = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    a, b, c = (Request(b"t", name, [1, 2, 3], penalized, seed=0) for name in "abc")
    plain = Request(b"t", "plain", [4], SamplingParams(), seed=0)

    def check(rows: list[Request], slots: torch.Tensor, last_sampled: list[int]) -> None:
        assert seen.counts is not None and seen.prompt_tokens is not None
        for row, request in enumerate(rows):
            if request is plain:
                continue
            history = list(request.output_token_ids)
            if request.num_pending_tokens:
                history.append(last_sampled[request.pending_row])
            expected = torch.bincount(torch.tensor(history, dtype=torch.int64), minlength=vocab)
            assert torch.equal(seen.counts[slots[row]], expected.float()), request.request_id
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[request.prompt_token_ids] = True
            assert torch.equal(seen.prompt_tokens[slots[row]], prompt)

    no_pending = torch.empty(0, dtype=torch.int64)
    a.output_token_ids, b.output_token_ids = [5, 5], [6]
    rows = [a, plain, b]
    slots = seen.slots_of(rows, no_pending)
    check(rows, slots, [])
    assert slots[1] in (slots[0], slots[2]) and slots[0] != slots[2]
    # Overlapped steps: each reads the token the step before sampled from the device, and
    # the host takes it a step later.
    before: list[int] = []
    for sampled in ([7, 8, 9], [7, 7, 9]):
        for row, request in enumerate(rows):
            if before:
                request.read_pending_token()
                request.append_output_tokens([before[row]])
            request.add_pending_token(row)
        before = sampled
        slots = seen.slots_of(rows, torch.tensor(sampled))
        check(rows, slots, sampled)
    assert a.output_token_ids == [5, 5, 7] and b.output_token_ids == [6, 9]
    # c takes the slot of a request out of its step; that one, back, is counted afresh.
    c.output_token_ids = [9]
    check([c], seen.slots_of([c], no_pending), [])
    for row, request in enumerate(rows):
        request.read_pending_token()
        request.append_output_tokens([before[row]])
    rows = [b, a]
    check(rows, seen.slots_of(rows, no_pending), [])
    # What the KV cache's sizing leaves them is what they take.
    assert seen.counts.nbytes + seen.prompt_tokens.nbytes == seen_token_table_bytes(2, vocab)
    # Steps launched back to back with none read (as a test of the runner does): no failure,
    # and the counts are exact again once the host has read the tokens.
    steps = ([3, 4], [3, 3])
    for sampled in steps:
        for row, request in enumerate(rows):
            request.add_pending_token(row)
        seen.slots_of(rows, torch.tensor(sampled))
    for sampled in steps:
        for row, request in enumerate(rows):
            request.read_pending_token()
            request.append_output_tokens([sampled[row]])
    check(rows, seen.slots_of(rows, no_pending), [])
