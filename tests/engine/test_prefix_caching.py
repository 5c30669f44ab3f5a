"""Prefix caching: prompts that share a prefix reuse its cache, and outputs do not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.scheduling.request import Request
from protocol import SamplingParams
from tandem.testing.random_checkpoint import VOCAB, save_tiny_llama
from tandem.testing.reference import hf_greedy, run_engine

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def make_engine(directory: Path, prefix_caching: bool = True, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_blocks,
            max_model_len=min(256, num_blocks * BLOCK_SIZE),
            enable_prefix_caching=prefix_caching,
        )
    )


def prompts_with_common_prefix(
    prefix_len: int, suffix_lens: list[int], seed: int = 7
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB - 1, (prefix_len,), generator=generator).tolist()
    return [
        prefix + torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist()
        for n in suffix_lens
    ]


def test_shared_prefix_is_reused_and_outputs_are_unchanged(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    prompts = prompts_with_common_prefix(30, [3, 9, 1])
    engine = make_engine(directory)
    first = run_engine(engine, prompts[:1], max_tokens=12)
    assert engine.block_manager.num_hit_tokens == 0
    rest = run_engine(engine, prompts[1:], max_tokens=12)
    # Both later prompts find the prefix's 7 full blocks (28 tokens) and the first one's
    # output is irrelevant to them: they diverge inside block 8.
    assert engine.block_manager.num_hit_tokens == 2 * 28
    assert first + rest == [hf_greedy(hf_model, p, 12) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_repeated_prompt_computes_only_its_last_block(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    prompt = prompts_with_common_prefix(24, [0])[0]  # six full blocks
    engine = make_engine(directory)
    first = run_engine(engine, [prompt], max_tokens=8)
    again = run_engine(engine, [prompt], max_tokens=8)
    # The last token's block is always computed: its logits are needed.
    assert engine.block_manager.num_hit_tokens == 20
    assert again == first


def test_generated_tokens_are_cached_for_the_next_turn(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    prompt = prompts_with_common_prefix(10, [0])[0]
    engine = make_engine(directory)
    [answer] = run_engine(engine, [prompt], max_tokens=14)
    # The answer's last token was sampled but never fed back: 23 tokens were computed,
    # five full blocks of them.
    next_turn = prompt + answer + [5, 6, 7]
    [reply] = run_engine(engine, [next_turn], max_tokens=6)
    assert engine.block_manager.num_hit_tokens == 20
    assert reply == hf_greedy(hf_model, next_turn, 6)


def test_running_requests_share_blocks_until_both_finish(tiny: tuple[Path, HFLlama]) -> None:
    """The second request arrives while the first still decodes and takes its prefix blocks;
    the first finishing early must not free what the second still reads."""
    directory, hf_model = tiny
    prompts = prompts_with_common_prefix(16, [2, 5])
    engine = make_engine(directory)
    engine.add_request(b"t", "a", prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # a's prefill: its four prefix blocks are keyed
    engine.add_request(b"t", "b", prompts[1], SamplingParams(max_tokens=20, ignore_eos=True))
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    shared = None
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
        if shared is None:
            a, b = engine.requests[(b"t", "a")], engine.requests[(b"t", "b")]
            shared = set(a.block_ids) & set(b.block_ids)
    assert len(shared) == 4
    assert engine.block_manager.num_hit_tokens == 16
    assert outputs["b"] == hf_greedy(hf_model, prompts[1], 20)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_evicted_blocks_are_recomputed(tiny: tuple[Path, HFLlama]) -> None:
    """A small cache hands cached blocks to other requests; the prefix is then computed
    again, correctly, and no block is lost."""
    directory, hf_model = tiny
    engine = make_engine(directory, num_blocks=24)
    prompt = prompts_with_common_prefix(40, [0])[0]
    run_engine(engine, [prompt], max_tokens=4)
    other = prompts_with_common_prefix(92, [0], seed=8)  # with 4 new tokens: all 24 blocks
    run_engine(engine, other, max_tokens=4)
    hits_before = engine.block_manager.num_hit_tokens
    [again] = run_engine(engine, [prompt], max_tokens=4)
    assert engine.block_manager.num_hit_tokens == hits_before  # evicted: no hit
    assert again == hf_greedy(hf_model, prompt, 4)
    assert engine.block_manager.num_free_blocks == 24


def test_disabled_prefix_caching_finds_nothing(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    prompt = prompts_with_common_prefix(24, [0])[0]
    engine = make_engine(directory, prefix_caching=False)
    first = run_engine(engine, [prompt], max_tokens=8)
    assert run_engine(engine, [prompt], max_tokens=8) == first
    assert engine.block_manager.num_hit_tokens == 0


@pytest.mark.parametrize(("start", "end"), [(0, 3), (2, 5), (3, 6), (5, 7), (0, 7)])
def test_token_ids_between_spans_prompt_and_output(start: int, end: int) -> None:
    request = Request(b"c", "r", [0, 1, 2, 3], SamplingParams(), seed=0)
    for token in [4, 5, 6]:
        request.append_output_tokens([token])
    assert request.num_tokens == 7 and request.num_output_tokens == 3
    assert request.token_ids_between(start, end) == list(range(start, end))
