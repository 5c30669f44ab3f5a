"""N-gram speculation on CUDA (graphs for the plain decode steps, overlapped steps, the
Triton kernels' multi-token queries for the verify steps), in float32 at the Llama-3.2-1B
shape: the same tokens as without it, greedy and seeded."""

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


def test_ngram_speculation_equals_plain_decoding_on_cuda(tmp_path: Path) -> None:
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
    results = []
    for speculative in ({}, {"speculative_method": "ngram", "prompt_lookup_min": 1}):
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
        results.append(generate(engine, requests))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nn-gram drafts {drafts}, accepted {accepted}")
    assert drafts > 0
    plain, speculated = results
    for request_id in requests:
        ours = [t for o in speculated[request_id] for t in o.new_token_ids]
        theirs = [t for o in plain[request_id] for t in o.new_token_ids]
        assert ours == theirs, request_id
