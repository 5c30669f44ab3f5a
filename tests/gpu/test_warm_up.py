"""On CUDA: the start-up warm-up (engine/execution/warm_up.py) compiles every Triton kernel variant
the engine will use, so that no step of a varied workload compiles another, and the first
request is as fast as the later ones."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

import engine.backends.triton.activation
import engine.backends.triton.argmax
import engine.backends.triton.fp8_decode
import engine.backends.triton.fp8_quantize
import engine.backends.triton.graph_inputs
import engine.backends.triton.norm
import engine.backends.triton.nucleus
import engine.backends.triton.one_row_matmul
import engine.backends.triton.one_row_qkv
import engine.backends.triton.paged_attention
import engine.backends.triton.penalties
import engine.backends.triton.pending_tokens
import engine.backends.triton.quantized_matmul
import engine.backends.triton.rotary_store
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams

KERNEL_MODULES = [
    engine.backends.triton.activation,
    engine.backends.triton.argmax,
    engine.backends.triton.fp8_decode,
    engine.backends.triton.fp8_quantize,
    engine.backends.triton.graph_inputs,
    engine.backends.triton.norm,
    engine.backends.triton.nucleus,
    engine.backends.triton.one_row_matmul,
    engine.backends.triton.one_row_qkv,
    engine.backends.triton.paged_attention,
    engine.backends.triton.penalties,
    engine.backends.triton.pending_tokens,
    engine.backends.triton.quantized_matmul,
    engine.backends.triton.rotary_store,
]


def our_kernels() -> Iterator[tuple[str, triton.runtime.JITFunction]]:
    """Each of our Triton kernels, by name. None is autotuned: their configurations are
    chosen by shape (a timing mid-run would stall a step, and timings differ by process)."""
    for module in KERNEL_MODULES:
        for name, value in vars(module).items():
            assert not isinstance(value, triton.runtime.Autotuner), name
            if isinstance(value, triton.runtime.JITFunction):
                yield name, value


def compiled_variants() -> dict[str, set[str]]:
    """The variants (specialization keys) of each of our Triton kernels this process has
    compiled."""
    variants: dict[str, set[str]] = {}
    for name, kernel in our_kernels():
        caches = kernel.device_caches.values()
        variants[name] = {str(key) for cache in caches for key in cache[0]}
    return variants


def forget_compiled_variants() -> None:
    """Drop what this process has compiled of our kernels (Triton's disk cache stays), so
    that a test sees only what its own engine's start-up compiles: kernels an earlier test's
    run compiled would otherwise hide a variant this start-up misses."""
    for _, kernel in our_kernels():
        kernel.device_caches.clear()


def varied_workload(engine: LLMEngine) -> float:
    """Prompts of odd and even lengths, chunked and mixed with decodes, batches of every
    size as requests come and go, greedy and sampled (uncut, within top-p, min-p or both),
    with and without log-probabilities and penalties, and one long prompt decoded alone at
    the end; the first request's TTFT in seconds."""
    generator = torch.Generator().manual_seed(5)
    first = SamplingParams(max_tokens=1)
    started = time.perf_counter()
    engine.add_request(b"gpu", "first", list(range(2, 130)), first)
    while engine.has_work:
        engine.step()
    ttft = time.perf_counter() - started
    lengths = torch.randint(1, 1500, (40,), generator=generator).tolist()
    for i, length in enumerate(lengths):
        prompt = torch.randint(2, 1000, (length,), generator=generator).tolist()
        sampling = SamplingParams(
            max_tokens=1 + i % 37,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.7,
            top_p=0.9 if i % 4 else 1.0,  # steps drawn within top-p, and uncut
            min_p=0.05 if i % 5 == 0 else 0.0,
            logprobs=2 if i % 3 == 0 else None,
            repetition_penalty=1.1 if i % 6 == 1 else 1.0,
            frequency_penalty=0.2 if i % 7 == 2 else 0.0,
        )
        engine.add_request(b"gpu", str(i), prompt, sampling)
        if i % 4 == 3:
            for _ in range(i % 7):
                engine.step()
    engine.add_request(b"gpu", "long", list(range(2, 3500)), SamplingParams(max_tokens=8))
    while engine.has_work:
        engine.step()
    return ttft


NGRAM = {"speculative_method": "ngram", "prompt_lookup_min": 1}
FP8 = {"quantization": "fp8"}  # weight-only GEMMs up to 16 rows (split K), W8A8 past them
# Decode attention over an fp8 cache takes the Gluon kernel at head_dim 128 (Qwen3's), not
# at Gemma 3's 256.
FP8_KV = {"kv_cache_dtype": "fp8", "shape": "qwen3-0.6b"}
# A Llama's batch-1 steps project, rotate and store in one kernel (one_row_qkv); Gemma's not.
LLAMA = {"shape": "llama-3.2-1b"}
# Over a bf16 cache one sequence's split decode takes more warps than two or more sequences'
# (decode_num_warps: at head_dim 128 eight against four; the Llama's 64 four against two),
# two variants an eager decode must compile.
QWEN3 = {"shape": "qwen3-0.6b"}


@pytest.mark.parametrize(
    ("enforce_eager", "options"),
    [
        (False, {}),
        (True, {}),
        (False, NGRAM),
        (True, NGRAM),
        (False, FP8),
        (False, FP8_KV),
        (False, LLAMA),
        (True, LLAMA),
        (True, QWEN3),
    ],
    # ngram: speculative verify steps, in graphs or eager
    ids=[
        "graphs",
        "eager",
        "ngram-graphs",
        "ngram-eager",
        "fp8-graphs",
        "fp8-kv-graphs",
        "llama-graphs",
        "llama-eager",
        "qwen3-eager",
    ],
)
def test_no_kernel_compiles_after_start_up(
    enforce_eager: bool, options: dict[str, Any], shape_checkpoint: Callable[[str], Path]
) -> None:
    options = dict(options)
    # gemma3-1b by default: sliding and full layers, both variants
    directory = shape_checkpoint(options.pop("shape", "gemma3-1b"))
    forget_compiled_variants()
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            max_model_len=4096,
            max_num_batched_tokens=1024,
            kv_cache_memory_gb=4,
            enforce_eager=enforce_eager,
            **options,
        )
    )
    start_s = time.perf_counter() - started
    after_start = compiled_variants()
    ttft = varied_workload(engine)
    after_run = compiled_variants()
    print(
        f"\nenforce_eager={enforce_eager}, {options or 'no options'}: start "
        f"{start_s:.1f} s, first TTFT {ttft * 1e3:.1f} ms; drafts {engine.num_draft_tokens};"
        f" variants { {name: len(keys) for name, keys in after_start.items()} }"
    )
    compiled_late = {name: keys - after_start[name] for name, keys in after_run.items()}
    for name, keys in compiled_late.items():
        for key in keys:
            print(f"compiled after start-up: {name} {key}")
    assert not any(compiled_late.values())
