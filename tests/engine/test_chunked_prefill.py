"""Chunked prefill: prompts longer than a step's token budget are computed over several
steps, outputs unchanged, while running requests keep decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy, run_engine

BUDGET = 8  # tokens a step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def make_engine(directory: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=4,
            kv_cache_memory_gb=0.01,
            max_num_seqs=BUDGET,
            max_num_batched_tokens=BUDGET,
        )
    )


def test_chunked_prompts_give_the_same_tokens(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory)
    prompts = random_prompts(8)  # up to 64 tokens: eight steps' budget
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    assert run_engine(engine, prompts, max_tokens=10) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_running_requests_decode_while_a_long_prompt_is_prefilled(
    tiny: tuple[Path, HFLlama],
) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory)
    short, long = random_prompts(5)[1], random_prompts(5)[4]  # 5 and 64 tokens
    sampling = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(b"t", "short", short, sampling)
    [(_, first)] = engine.step()  # its prefill
    engine.add_request(b"t", "long", long, sampling)
    tokens: dict[str, list[int]] = {"short": first.new_token_ids, "long": []}
    steps_until_long_starts = 0
    while not tokens["long"]:
        outputs = {output.request_id: output for _, output in engine.step()}
        steps_until_long_starts += 1
        assert len(outputs["short"].new_token_ids) == 1  # a token every step, all along
        for request_id, output in outputs.items():
            tokens[request_id] += output.new_token_ids
    # 64 prompt tokens in chunks of 7 (the budget less the decode's one token).
    assert steps_until_long_starts == 10
    while engine.has_work:
        for _, output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["short"] == hf_greedy(hf_model, short, 20)
    assert tokens["long"] == hf_greedy(hf_model, long, 20)


def test_budget_below_max_num_seqs_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    config = EngineConfig(
        model=str(directory), device="cpu", max_num_seqs=16, max_num_batched_tokens=8
    )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be at least"):
        LLMEngine(config)


def test_on_the_cpu_a_step_computes_512_tokens_by_default(tmp_path: Path) -> None:
    """A step computes at most 512 tokens on the CPU unless told (a longer step there would
    outlast the servers' heartbeat): a 1,200-token prompt takes three steps to its first
    token, and its tokens are transformers'."""
    hf_model = save_tiny_llama(tmp_path, max_position_embeddings=2048)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_gb=0.05))
    assert engine.scheduler.max_num_batched_tokens == 512
    prompt = [token % 200 + 3 for token in range(1200)]
    engine.add_request(b"t", "long", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    steps: list[list[int]] = []  # each step's new tokens
    while engine.has_work:
        steps.append([token for _, output in engine.step() for token in output.new_token_ids])
    # Three chunks of 512, 512 and 176 tokens, the last one's step sampling the first token.
    assert [bool(new) for new in steps] == [False, False, True, True, True, True]
    assert [token for new in steps for token in new] == hf_greedy(hf_model, prompt, 4)
