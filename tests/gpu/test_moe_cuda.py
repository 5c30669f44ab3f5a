"""Mixtures of experts on CUDA against transformers on the same GPU: small random Qwen3-MoE
(64 experts, 8 a token), Mixtral (8 experts, 2 a token) and gpt-oss (16 experts, 4 a token;
attention sinks, a 128-token window every other layer, biased experts with the clamped
SwiGLU), through the torch backend (its ``moe_experts`` reference) and the Triton one (the
fused MoE kernel and its gpt-oss variant, sinks in the split decode and prefill kernels, in
decode CUDA graphs).

In float32, every greedy step's log-probabilities of a batch and of one request alone equal
transformers' on the same tokens; with ``--quantization fp8`` (bf16, FP8 experts), greedy
tokens are the choice of transformers holding the same FP8 weights after the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.moe import FusedExperts
from tandem.testing.random_checkpoint import save_with_tokenizer
from tandem.testing.reference import run_engine, stepwise_agreement, with_weights_as_fp8_codes
from tests.gpu.test_decode_parity import assert_decode_matches_transformers

STEPS = 32
# float32 on both sides; a router's near-tie that rounding decides the other way (its two
# experts about equally weighted) moves a log-probability by a little more than the dense
# models' 2e-4.
LOGPROB_ATOL = 1e-3
_COMMON = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.05,
    bos_token_id=0,
    eos_token_id=1,
)
SHAPES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "qwen3-moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        _COMMON
        | dict(
            head_dim=64,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=256,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        _COMMON | dict(num_local_experts=8, num_experts_per_tok=2),
    ),
    # Its prompts of 9 and 300 tokens: the longer past the sliding layers' window.
    "gpt-oss": (
        GptOssConfig,
        GptOssForCausalLM,
        _COMMON
        | dict(head_dim=64, num_local_experts=16, num_experts_per_tok=4, sliding_window=128),
    ),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def moe_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    config_class, model_class, config = SHAPES[request.param]
    torch.manual_seed(0)
    model = model_class(config_class(**config, attn_implementation="eager")).eval()
    directory = tmp_path_factory.mktemp(request.param)
    save_with_tokenizer(model, directory)
    return directory, model.cuda()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_decode_matches_transformers_in_float32(
    moe_checkpoint: tuple[Path, PreTrainedModel], backend: str
) -> None:
    directory, hf = moe_checkpoint
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            dtype="float32",
            backend=backend,
            max_model_len=2048,
            kv_cache_memory_gb=2,
        )
    )
    generator = torch.Generator().manual_seed(7)
    prompts = {str(n): torch.randint(2, 4096, (n,), generator=generator).tolist() for n in (9, 300)}
    worst = assert_decode_matches_transformers(engine, hf, prompts, "300", STEPS, LOGPROB_ATOL)
    print(
        f"\n{directory.name} {backend}: {STEPS} greedy steps x 3, worst logprob error {worst:.2e}"
    )


# Greedy tokens that are the choice of transformers holding the same FP8 weights, after the
# same tokens. Steps of at most 16 rows read FP8 weights into bf16 products (weight-only):
# the reference's arithmetic but for bf16 rounding, which alone moves these random models'
# near-tied choices often (the weight-only path in float32 agrees on every step). Longer
# steps (prompts of 64 tokens) quantize activations per token to FP8 (W8A8), three mantissa
# bits, which flips the near-tied routing of random Mixtral and gpt-oss more often still.
# Both bounds only catch a broken path (scales, layouts: near 0 of 4,096 tokens); the
# kernel's products are checked against the reference by tests/gpu/test_fused_moe_cuda.py.
FP8_CASES = {"weight-only": (4, 4, 0.5), "w8a8": (24, 64, 0.15)}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_experts_follow_transformers_on_the_same_weights(
    moe_checkpoint: tuple[Path, PreTrainedModel], backend: str
) -> None:
    directory, hf = moe_checkpoint
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            backend=backend,
            quantization="fp8",
            max_model_len=2048,
            kv_cache_memory_gb=2,
        )
    )
    experts = next(m for m in engine.runner.model.modules() if isinstance(m, FusedExperts))
    assert experts.w13.dtype == torch.float8_e4m3fn
    reference = with_weights_as_fp8_codes(hf)
    generator = torch.Generator().manual_seed(3)
    for case, (count, length, least) in FP8_CASES.items():
        prompts = torch.randint(2, 4096, (count, length), generator=generator).tolist()
        tokens = run_engine(engine, prompts, max_tokens=16)
        agreement = stepwise_agreement(reference, prompts, tokens)
        print(f"\n{directory.name} {backend} fp8 {case}: {agreement:.2f} agree")
        assert agreement >= least
