"""Decode, not only prefill, against transformers at real shapes in float32: 64 greedy steps
of a batch (decode CUDA graphs, overlapped steps, split-K at a long context), then of one
request alone (batch 1: one-row kernels, and for Llama the QKV projection's fused RoPE and
cache write), each step's log-probabilities against transformers' on the same tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tests.engine.test_logprobs import generate

STEPS = 64
TOP = 5
# float32 on both sides, summed in different orders over tens of layers.
LOGPROB_ATOL = 2e-4


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "qwen3-0.6b", "gemma3-1b"])
def test_greedy_decode_matches_transformers_in_float32(
    shape: str, shape_checkpoint: Callable[[str], Path]
) -> None:
    directory = shape_checkpoint(shape)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            dtype="float32",
            max_model_len=4096,
            kv_cache_memory_gb=4,
        )
    )
    assert engine.runner.decode_graphs is not None and engine.overlap_steps
    generator = torch.Generator().manual_seed(7)
    # Short, past Gemma's 512-token window, and long enough for split-K at batch 3.
    prompts = {
        str(n): torch.randint(2, 30000, (n,), generator=generator).tolist() for n in (9, 700, 2500)
    }
    worst = assert_decode_matches_transformers(engine, hf, prompts, "700", STEPS, LOGPROB_ATOL)
    print(f"\n{shape}: {STEPS} greedy steps x {len(prompts) + 1}, worst logprob error {worst:.2e}")


def assert_decode_matches_transformers(
    engine: LLMEngine,
    hf: torch.nn.Module,
    prompts: dict[str, list[int]],
    alone: str,
    steps: int,
    atol: float,
) -> float:
    """``prompts`` decoded greedily together, then prompt ``alone`` by itself (batch 1), for
    ``steps`` tokens each: every token transformers' greedy choice on the same prefix (up to
    a tie) and every step's log-probabilities, the token's and its top TOP's, within ``atol``
    of transformers'. The worst error."""
    sampling = SamplingParams(max_tokens=steps, ignore_eos=True, logprobs=TOP)
    outputs = generate(engine, {name: (prompt, sampling) for name, prompt in prompts.items()})
    prompts = {**prompts, f"{alone} alone": prompts[alone]}
    outputs.update(generate(engine, {f"{alone} alone": (prompts[alone], sampling)}))
    worst = 0.0
    for name, prompt in prompts.items():
        tokens = [t for output in outputs[name] for t in output.new_token_ids]
        entries = [entry for output in outputs[name] for entry in output.logprobs or []]
        assert len(tokens) == len(entries) == steps
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1).cpu()
        for step, (token, ours, theirs) in enumerate(zip(tokens, entries, reference, strict=True)):
            # Our token is transformers' greedy choice on the same prefix, up to a tie.
            assert theirs.max() - theirs[token] <= atol, (name, step)
            got = torch.tensor([ours.logprob, *ours.top_logprobs])
            want = theirs[[token, *ours.top_token_ids]]
            worst = max(worst, (got - want).abs().max().item())
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=f"{name} {step}")
            # Our top tokens are transformers' top tokens (up to ties at the edge).
            assert theirs.topk(TOP).values[-1] - want[1:].min() <= atol, (name, step)
    return worst
