"""Mixed steps split in two passes (engine/execution/mixed_steps.py) on the CPU, where both
passes run op by op (``--split-mixed-steps on``): a step of decodes with prompts mixed in,
computed as its decodes' step and then its prompts', gives the one pass's logits, scored
prompt positions included; and through the engine, requests arriving while others decode
(overlapped steps, their decodes' inputs pending on the device) get the same tokens,
log-probabilities, prompt log-probabilities and grammar-constrained outputs as with every
mixed step run as one pass. The CUDA graphs of both passes: tests/gpu/test_cuda_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.execution.mixed_steps import is_mixed
from engine.llm_engine import LLMEngine
from protocol import RequestOutput, SamplingParams
from tandem.testing.random_checkpoint import random_prompts
from tests.engine.test_constrained_generation import REGEX, tiny  # noqa: F401 (a fixture)
from tests.engine.test_overlap_steps import tokens


def make_engine(directory: Path, split: str, tensor_parallel_size: int = 1) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=4,
            kv_cache_memory_gb=0.01,
            overlap_steps=True,
            split_mixed_steps=split,
            tensor_parallel_size=tensor_parallel_size,
        )
    )


def test_a_split_mixed_step_gives_the_one_pass_logits(tiny: tuple[Path, HFLlama]) -> None:  # noqa: F811
    """Three decodes, then two prompts (one scoring its positions): the decodes' logits
    rows, the prompt's sampled row, and the scored positions' rows, as one pass gives them."""
    engine = make_engine(tiny[0], "on")
    prompts = random_prompts(5)
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(b"t", f"decode{i}", prompt, SamplingParams(max_tokens=8))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()  # no step in flight
    engine.add_request(b"t", "scored", prompts[3], SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.add_request(b"t", "plain", prompts[4], SamplingParams(max_tokens=2))
    batch = engine.scheduler.schedule()
    inputs = engine.runner.step_inputs(batch)
    assert is_mixed(inputs.shape) and inputs.shape.num_leading_decodes == 3
    assert inputs.scored is not None and len(inputs.rows) == 5
    split_steps = engine.runner.num_split_steps
    with torch.inference_mode():
        one_pass = engine.runner.forward_eager(inputs).clone()
        split = engine.runner.run_model(inputs)
    assert engine.runner.num_split_steps == split_steps + 1
    scored = len(prompts[3]) - 1
    assert split.shape == one_pass.shape == (5 + scored, engine.vocab_size)
    torch.testing.assert_close(split, one_pass, rtol=1e-5, atol=1e-5)
    for request_id in list(engine.requests):
        engine.abort(b"t", request_id)


def close(ours: list[float], theirs: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-5)


def _staggered(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Requests arriving two at a time, a few steps apart, while the earlier ones decode:
    greedy with log-probabilities, prompt log-probabilities, a grammar."""
    prompts = random_prompts(8)
    kinds = [
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(max_tokens=10, structured_output=REGEX),
    ]
    outputs: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        outputs[str(i)] = []
        engine.add_request(b"t", str(i), prompt, kinds[i % len(kinds)])
        if i % 2:
            for _ in range(3):
                for _, output in engine.step():
                    outputs[output.request_id].append(output)
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


@pytest.fixture(scope="module")
def one_pass(tiny: tuple[Path, HFLlama]) -> dict[str, list[RequestOutput]]:  # noqa: F811
    """The staggered requests' outputs with every mixed step run as one pass."""
    engine = make_engine(tiny[0], "off")
    outputs = _staggered(engine)
    assert engine.runner.num_split_steps == 0
    return outputs


def assert_same_outputs(
    split: dict[str, list[RequestOutput]], one_pass: dict[str, list[RequestOutput]]
) -> None:
    for request_id, outputs in one_pass.items():
        assert tokens(split[request_id]) == tokens(outputs), request_id
        assert split[request_id][-1].finish_reason == outputs[-1].finish_reason
        for ours, theirs in zip(split[request_id], outputs, strict=True):
            for a, b in zip(ours.logprobs or [], theirs.logprobs or [], strict=True):
                assert a.top_token_ids == b.top_token_ids
                close([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs])
            theirs_scored = theirs.prompt_logprobs or []
            assert len(ours.prompt_logprobs or []) == len(theirs_scored)
            for a, b in zip(ours.prompt_logprobs or [], theirs_scored, strict=True):
                assert (a.rank, a.top_token_ids) == (b.rank, b.top_token_ids)
                close([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs])


def test_split_mixed_steps_generate_what_one_pass_does(
    tiny: tuple[Path, HFLlama],  # noqa: F811
    one_pass: dict[str, list[RequestOutput]],
) -> None:
    engine = make_engine(tiny[0], "on")
    split = _staggered(engine)
    assert engine.runner.num_split_steps > 0
    assert_same_outputs(split, one_pass)


def test_tensor_parallel_workers_split_mixed_steps_alike(
    tiny: tuple[Path, HFLlama],  # noqa: F811
    one_pass: dict[str, list[RequestOutput]],
) -> None:
    """Two ranks over gloo: the worker splits each mixed step as rank 0 does, from the
    step's shape alone (the two passes' collectives pair up), and the outputs are the same."""
    engine = make_engine(tiny[0], "on", tensor_parallel_size=2)
    try:
        split = _staggered(engine)
        assert engine.runner.num_split_steps > 0
    finally:
        engine.close()
    assert_same_outputs(split, one_pass)
