"""--backend decides every kernel on CUDA: the torch backend runs no Triton kernel at all,
through prefills, decodes, sampled, greedy and grammar-constrained requests, n-gram verify
steps and quantized (fp8, int8) linear layers; the triton backend runs its kernels, of every
concern.

Launches are counted with Triton's launch hook (``triton.knobs.runtime.launch_enter_hook``;
``CompiledKernel.launch_enter_hook`` before knobs). Why the count is sound: every launch of
a compiled Triton (or Gluon) kernel goes through the driver's launcher, which calls the hook
first, both through ``kernel[grid](...)`` and through a compiled kernel launched directly
(``engine.backends.triton.one_variant``). A replayed CUDA graph launches nothing from
Python, so its replays are not counted; but each of its kernels was launched once while it
was captured, with the hook set (it is set before the engine is built: start-up's warm-up
and graph captures included). And the torch backend captures no graph
(``supports_cuda_graphs`` is False): everything it runs is launched eagerly. So a count of
zero means no Triton kernel ran in this process while the engine did, and the triton
backend's count shows the hook sees the engine's launches.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams, StructuredOutput, StructuredOutputKind
from tandem.testing.random_checkpoint import (
    VOCAB,
    random_prompts,
    save_tiny_llama,
    save_word_tokenizer,
)
from tests.engine.test_logprobs import generate

# Prompts of more than 16 tokens: their prefills take the FP8 layers' W8A8 product.
PROMPTS = [prompt for prompt in random_prompts(8) if len(prompt) > 16][:4]
REPETITIVE = PROMPTS[0][:10] * 4  # n-gram speculation drafts from it
REGEX = r"[0-9]{3}-[a-z]{2,5}"


@contextlib.contextmanager
def triton_launches() -> Iterator[Counter[str]]:
    """Counts every Triton kernel launched in this process while held, by kernel name."""
    import triton
    from triton.compiler.compiler import CompiledKernel

    launches: Counter[str] = Counter()

    def count(metadata: Any) -> None:
        data = getattr(metadata, "data", None) or {}
        launches[data.get("name", "?")] += 1

    knobs = getattr(triton, "knobs", None)
    chain = None if knobs is None else knobs.runtime.launch_enter_hook
    if chain is not None and hasattr(chain, "add"):  # a chain of hooks
        chain.add(count)
        try:
            yield launches
        finally:
            chain.remove(count)
        return
    owner = knobs.runtime if knobs is not None else CompiledKernel
    previous = owner.launch_enter_hook

    def chained(metadata: Any) -> None:
        count(metadata)
        if previous is not None:
            previous(metadata)

    owner.launch_enter_hook = chained
    try:
        yield launches
    finally:
        owner.launch_enter_hook = previous


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama (heads of 64 dimensions, as Llama 3.2 1B's; every size a multiple of 16,
    as FP8's W8A8 product takes) with a tokenizer a grammar can spell in."""
    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(
        directory,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    save_word_tokenizer(directory, VOCAB)
    return directory


def run(directory: Path, backend: str, quantization: str | None) -> tuple[LLMEngine, dict]:
    """An engine of ``backend`` with n-gram speculation: one request alone (batch-1 prefill
    and decode steps), then greedy, seeded-sampled, penalized, drafting and
    grammar-constrained requests together."""
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            backend=backend,
            quantization=quantization,
            kv_cache_memory_gb=0.25,
            max_num_seqs=8,
            speculative_method="ngram",
            prompt_lookup_min=1,
            num_speculative_tokens=3,
        )
    )
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)
    outputs = generate(engine, {"alone": (PROMPTS[0], greedy)})
    together = {f"greedy-{i}": (prompt, greedy) for i, prompt in enumerate(PROMPTS)}
    together["sampled"] = (PROMPTS[1], sampled)
    penalized = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.1)
    together["penalized"] = (PROMPTS[2], penalized)
    together["drafting"] = (REPETITIVE, SamplingParams(max_tokens=24, ignore_eos=True))
    regex = StructuredOutput(StructuredOutputKind.REGEX, REGEX)
    together["constrained"] = (PROMPTS[2], SamplingParams(max_tokens=16, structured_output=regex))
    outputs |= generate(engine, together)
    return engine, outputs


def check_outputs(directory: Path, outputs: dict) -> None:
    """Every request's tokens: all it asked for, the constrained one's spelling its regex."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for name, request_outputs in outputs.items():
        tokens = [t for output in request_outputs for t in output.new_token_ids]
        if name == "constrained":
            assert request_outputs[-1].finish_reason == "stop"
            assert re.fullmatch(REGEX, "".join(tokenizer.id_to_token(t) for t in tokens))
        else:
            assert len(tokens) >= 12, name


def requires(quantization: str | None) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")


@pytest.mark.parametrize("quantization", [None, "fp8", "int8"])
def test_the_torch_backend_launches_no_triton_kernel(tiny: Path, quantization: str | None) -> None:
    requires(quantization)
    with triton_launches() as launches:
        engine, outputs = run(tiny, "torch", quantization)
    assert engine.runner.backend.name == "torch" and engine.runner.decode_graphs is None
    check_outputs(tiny, outputs)
    assert engine.num_draft_tokens > 0  # verify steps ran
    assert not launches, f"Triton kernels launched with --backend torch: {dict(launches)}"
    engine.close()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_the_triton_backend_launches_its_kernels(tiny: Path, quantization: str | None) -> None:
    """The same requests with --backend triton: the hook counts the kernels of the model,
    the sampler and the step inputs (the counter above can fail)."""
    requires(quantization)
    with triton_launches() as launches:
        engine, outputs = run(tiny, "triton", quantization)
    check_outputs(tiny, outputs)
    print(f"\n{quantization or 'bf16'}: {sum(launches.values())} Triton launches, {dict(launches)}")
    expected = {
        "_one_row_kernel",  # batch-1 linear layers
        "_chunk_argmax_kernel",  # the sampler's argmax, and its uncut race
        "_chunk_mass_kernel",  # the draw within top-k, top-p and min-p (nucleus.py)
        "_finish_kernel",
        "_penalties_kernel",  # the penalized request's (penalties.py)
        "_fill_pending_tokens_kernel",  # overlapped steps' inputs
        "_fill_graph_inputs_kernel",  # the decode graphs' inputs
    }
    if quantization == "fp8":
        expected.add("_quantize_rows_kernel")  # prompts' W8A8 activations
        expected.add("_scale_product_kernel")  # their narrow products' scales (fp8_matmul.py)
    assert expected <= set(launches), sorted(launches)
    engine.close()
