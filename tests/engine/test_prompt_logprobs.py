"""Prompt log-probabilities against transformers' logits at every prompt position: through
chunked prefill (a few positions a step), past the prefix cache, and through preemption
with overlapped steps, each prompt token's entry arriving once, by the first token's output;
and sent in pieces, each step's in its output, so that no one message carries a long
prompt's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.llm_engine import EngineConfig, LLMEngine
from protocol import PromptTokenLogprobs, RequestOutput, SamplingParams, TokenOutputs
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tests.engine.test_logprobs import generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def make_engine(directory: Path, **overrides: int | bool) -> LLMEngine:
    settings = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


def prompt_logprobs_of(outputs: list[RequestOutput]) -> list[PromptTokenLogprobs]:
    """The request's prompt log-probabilities, joined from its outputs' pieces, checking they
    all came by its first token's output (those before it with no tokens)."""
    first_token = next(i for i, output in enumerate(outputs) if output.new_token_ids)
    carrying = [i for i, output in enumerate(outputs) if output.prompt_logprobs is not None]
    assert all(i <= first_token for i in carrying)
    assert all(not output.new_token_ids for output in outputs[:first_token])
    return [entry for output in outputs for entry in output.prompt_logprobs or []]


def assert_match_transformers(
    model: HFLlama, prompt: list[int], ours: list[PromptTokenLogprobs], num_top: int
) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    reference = torch.log_softmax(logits, dim=-1)  # row j scores prompt token j + 1
    assert len(ours) == len(prompt) - 1
    targets = torch.tensor(prompt[1:], dtype=torch.int64)
    chosen = reference[torch.arange(len(targets)), targets]
    torch.testing.assert_close(
        torch.tensor([entry.logprob for entry in ours]), chosen, rtol=1e-4, atol=1e-4
    )
    ranks = (reference >= chosen.unsqueeze(1)).sum(dim=1)
    assert [entry.rank for entry in ours] == ranks.tolist()
    top = reference.topk(num_top, dim=-1)
    assert [entry.top_token_ids for entry in ours] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([entry.top_logprobs for entry in ours]).reshape(len(ours), num_top),
        top.values,
        rtol=1e-4,
        atol=1e-4,
    )


def test_chunked_prompts_are_scored_at_every_position(tiny: tuple[Path, HFLlama]) -> None:
    """At most max_num_seqs (4) positions are scored a step: a 64-token prompt takes 16."""
    directory, hf_model = tiny
    engine = make_engine(directory, max_num_seqs=4, max_num_batched_tokens=8)
    prompts = random_prompts(5)
    requests = {
        "long": (prompts[4], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3)),
        "short": (prompts[2], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)),
        "one-token": (prompts[0], SamplingParams(max_tokens=3, prompt_logprobs=2)),
        "none": (prompts[3], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)),
    }
    outputs = generate(engine, requests)
    assert_match_transformers(hf_model, prompts[4], prompt_logprobs_of(outputs["long"]), 3)
    assert_match_transformers(hf_model, prompts[2], prompt_logprobs_of(outputs["short"]), 0)
    assert prompt_logprobs_of(outputs["one-token"]) == []
    assert all(output.prompt_logprobs is None for output in outputs["none"])


def test_a_cached_prompt_is_scored_again(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory)
    prompt = random_prompts(5)[4]
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    generate(engine, {"first": (prompt, plain)})
    hits = engine.block_manager.num_hit_tokens
    scored = generate(engine, {"scored": (prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))})
    assert engine.block_manager.num_hit_tokens == hits  # it took no cached block
    assert_match_transformers(hf_model, prompt, prompt_logprobs_of(scored["scored"]), 1)
    generate(engine, {"again": (prompt, plain)})
    assert engine.block_manager.num_hit_tokens > hits  # what it computed is cached


def test_preempted_requests_send_them_once(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(
        directory,
        overlap_steps=True,
        num_kv_blocks=40,
        max_model_len=160,
        max_num_seqs=8,
        max_num_batched_tokens=24,
    )
    prompts = random_prompts(8)
    requests = {
        str(i): (prompt, SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=2))
        for i, prompt in enumerate(prompts)
    }
    outputs = generate(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_match_transformers(hf_model, prompt, prompt_logprobs_of(outputs[str(i)]), 2)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prompt_in_chunks_sends_each_steps_scores_in_its_output(
    tiny: tuple[Path, HFLlama],
) -> None:
    """4 positions a step (max_num_seqs): a 64-token prompt's 63 entries come in 16 outputs,
    the 15 before its first token's with no tokens, and join into the entries that the
    engine prefilling it in one step sends in one output."""
    directory, _ = tiny
    prompt = random_prompts(5)[4]
    sampling = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    chunked = generate(
        make_engine(directory, max_num_seqs=4, max_num_batched_tokens=8), {"r": (prompt, sampling)}
    )["r"]
    at_once = generate(make_engine(directory), {"r": (prompt, sampling)})["r"]
    pieces = [output.prompt_logprobs for output in chunked if output.prompt_logprobs is not None]
    assert [len(piece) for piece in pieces] == [4] * 15 + [3]
    assert [len(output.new_token_ids) for output in chunked] == [0] * 15 + [1, 1, 1]
    assert [output.prompt_logprobs is not None for output in at_once] == [True, False, False]
    assert [t for o in chunked for t in o.new_token_ids] == at_once[0].new_token_ids + [
        t for o in at_once[1:] for t in o.new_token_ids
    ]
    joined = prompt_logprobs_of(chunked)
    whole = at_once[0].prompt_logprobs or []
    assert [(e.rank, e.top_token_ids) for e in joined] == [(e.rank, e.top_token_ids) for e in whole]
    torch.testing.assert_close(
        torch.tensor([[e.logprob, *e.top_logprobs] for e in joined]),
        torch.tensor([[e.logprob, *e.top_logprobs] for e in whole]),
        rtol=1e-5,
        atol=1e-5,
    )


def test_no_frame_carries_a_long_prompts_scores(tiny: tuple[Path, HFLlama]) -> None:
    """Each step's frame of outputs carries the scores of at most max_num_seqs (16) prompt
    positions, however long the prompt: one long prompt's, all in one frame, took the engine's
    loop seconds to encode and a server's event loop seconds to decode, every other request
    waiting."""
    directory, _ = tiny
    engine = make_engine(directory, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512)
    long_prompt = (random_prompts(8)[4] * 8)[:500]
    engine.add_request(b"t", "long", long_prompt, SamplingParams(max_tokens=2, prompt_logprobs=20))
    engine.add_request(b"t", "short", random_prompts(2)[1], SamplingParams(max_tokens=40))
    frame_sizes = []
    scored = []
    while engine.has_work:
        outputs = [output for _, output in engine.step()]
        if outputs:
            frame_sizes.append(len(TokenOutputs(outputs).encode()))
            scored += [o for o in outputs if o.request_id == "long" and o.prompt_logprobs]
    assert len(prompt_logprobs_of(scored)) == len(long_prompt) - 1
    # A position's entry with 20 alternatives: at most 21 + 14 * 20 bytes (protocol/limits.py).
    assert max(frame_sizes) < 16 * (21 + 14 * 20) + 1024
