"""N-gram and draft-model speculation on CUDA (graphs for the plain decode steps, overlapped
steps, the Triton kernels' multi-token queries for the verify steps and the draft's passes),
in float32 at the Llama-3.2-1B shape: the same tokens as without it, greedy and seeded; the
target as its own draft has (nearly) every draft accepted."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tests.engine.test_logprobs import generate
from tests.gpu.test_cuda_engine import _prompts
from tests.random_checkpoint import save_random_model


def test_speculation_equals_plain_decoding_on_cuda(tmp_path: Path) -> None:
    save_random_model(tmp_path, "llama-3.2-1b", torch.bfloat16)
    prompts = _prompts(6)
    repetitive = prompts[0][:20] * 8
    requests = {
        **{
            f"greedy-{i}": (p, SamplingParams(max_tokens=48, ignore_eos=True))
            for i, p in enumerate([*prompts, repetitive])
        },
        "seeded": (repetitive, SamplingParams(max_tokens=48, temperature=0.8, seed=5)),
        "logprobs": (repetitive, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)),
    }
    methods = {
        "plain": {},
        "ngram": {"speculative_method": "ngram", "prompt_lookup_min": 1},
        "draft=self": {"speculative_model": str(tmp_path)},
    }
    results = {}
    counts = {}
    for method, speculative in methods.items():
        engine = LLMEngine(
            EngineConfig(
                model=str(tmp_path),
                device="cuda",
                dtype="float32",
                max_model_len=2048,
                kv_cache_memory_gb=2,
                **speculative,
            )
        )
        assert engine.overlap_steps and engine.runner.decode_graphs is not None
        results[method] = generate(engine, requests)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        counts[method] = (engine.num_draft_tokens, engine.num_accepted_tokens)
        print(f"\n{method}: drafts {counts[method][0]}, accepted {counts[method][1]}")
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    assert counts["ngram"][0] > 0
    drafts, accepted = counts["draft=self"]
    # The greedy requests accept all but near-ties (float32); the seeded one samples.
    assert drafts > 0 and accepted >= 0.8 * drafts
    plain = results["plain"]
    for method in ("ngram", "draft=self"):
        for request_id in requests:
            ours = [t for o in results[method][request_id] for t in o.new_token_ids]
            theirs = [t for o in plain[request_id] for t in o.new_token_ids]
            assert ours == theirs, (method, request_id)
