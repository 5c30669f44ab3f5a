"""Prompt log-probabilities against transformers' logits at every prompt position: through
chunked prefill (a few positions a step), past the prefix cache, and through preemption
with overlapped steps, each prompt token's entry arriving once, with the first token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.llm_engine import EngineConfig, LLMEngine
from protocol import PromptTokenLogprobs, RequestOutput, SamplingParams
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
    """The request's prompt log-probabilities, checking they came once, with its first token."""
    carrying = [i for i, output in enumerate(outputs) if output.prompt_logprobs is not None]
    assert carrying == [0]
    return outputs[0].prompt_logprobs or []


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
