"""Log-probabilities of generated tokens against transformers' own (float32, CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import RequestOutput, SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp("tiny")
    model = save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return directory, model


def generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Each request's outputs, without their queue and prefill times: measurements, which
    differ from run to run (the tests compare runs)."""
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(b"t", request_id, prompt, sampling)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].append(
                dataclasses.replace(output, queue_time=None, prefill_time=None)
            )
    return outputs


def reference_logprobs(model: HFLlama, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(tokens), V] of the distributions each token was
    drawn from."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def test_logprobs_match_transformers(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = LLMEngine(EngineConfig(model=str(directory), device="cpu", kv_cache_memory_gb=0.01))
    prompts = random_prompts(5)
    outputs = generate(
        engine,
        {
            "greedy": (prompts[3], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)),
            # Sampled at temperature 0.5: the log-probabilities stay the raw model's.
            "sampled": (
                prompts[4],
                SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.5, seed=3, logprobs=0),
            ),
            "none": (prompts[2], SamplingParams(max_tokens=6, ignore_eos=True)),
        },
    )
    assert all(output.logprobs is None for output in outputs["none"])
    for request_id, prompt, num_top in (("greedy", prompts[3], 3), ("sampled", prompts[4], 0)):
        tokens = [t for output in outputs[request_id] for t in output.new_token_ids]
        logprobs = [lp for output in outputs[request_id] for lp in output.logprobs or []]
        assert len(logprobs) == len(tokens) == 6
        reference = reference_logprobs(hf_model, prompt, tokens)
        ours = torch.tensor([lp.logprob for lp in logprobs])
        torch.testing.assert_close(ours, reference[range(6), tokens], rtol=1e-4, atol=1e-4)
        top = reference.topk(num_top, dim=-1)
        for i, lp in enumerate(logprobs):
            assert lp.top_token_ids == top.indices[i].tolist()
            torch.testing.assert_close(
                torch.tensor(lp.top_logprobs), top.values[i], rtol=1e-4, atol=1e-4
            )
    greedy = [lp for output in outputs["greedy"] for lp in output.logprobs or []]
    assert all(lp.top_logprobs[0] == lp.logprob for lp in greedy)  # greedy took the top one


def test_out_of_range_logprobs_are_refused() -> None:
    assert SamplingParams(logprobs=21).validate() == "logprobs must be in [0, 20]"
    assert SamplingParams(logprobs=-1).validate() is not None
    assert SamplingParams(logprobs=20).validate() is None
