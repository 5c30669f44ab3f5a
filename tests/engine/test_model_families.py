"""Every supported model family against transformers on tiny random checkpoints (float32, CPU).

Each checkpoint is saved by transformers itself (config.json in its v5 format, safetensors)
and loaded by our engine: prefill logits and greedy generations of a mixed batch must match.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from engine.backends import create_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import SUPPORTED_ARCHITECTURES, build_model, hf_model_config, load_checkpoint
from tandem.testing.random_checkpoint import VOCAB, random_prompts, save_with_tokenizer
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_model_parity import engine_prefill_logits, hf_prefill_logits

SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW = 16  # shorter than most test prompts, so sliding layers see only part of them

SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_id=VOCAB - 1,
    bos_token_id=0,
    pad_token_id=0,
    # Larger than transformers' 0.02, so greedy decoding varies its tokens instead of repeating one.
    initializer_range=0.2,
)

GEMMA3 = dict(
    layer_types=[SLIDING, FULL, SLIDING],
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,  # not head_dim, so a wrong attention scale shows
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    },
)

# name: (config class, model class, the config's differences from SHAPE)
FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama-llama3-rope-untied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral-sliding-window": (MistralConfig, MistralForCausalLM, dict(sliding_window=WINDOW)),
    "qwen2-biases-tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2-sliding-upper-layers": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3-wide-heads": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),  # 4 * 32 != 64
    # Tied, as Gemma 3 is; a random tied Gemma repeats one token unless its init is small.
    "gemma3-tied": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3 | dict(initializer_range=0.05)),
    "gemma3-untied-softcap": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        GEMMA3 | dict(tie_word_embeddings=False, final_logit_softcapping=2.0),
    ),
    # Q/K norms over all heads (q and k of different widths under GQA), norms after sublayers.
    "olmo2-gqa": (Olmo2Config, Olmo2ForCausalLM, dict()),
    # Mixtures of experts: Qwen3-MoE's top 3 of 8 renormalized, its middle layer a dense MLP
    # (mlp_only_layers); Mixtral's top 2 of 4 (renormalized, always).
    "qwen3-moe-dense-middle": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    # Top 4 of 8 with a softmax after the top k, biased router and experts, the clamped
    # SwiGLU, attention sinks and biases, sliding and full layers alternating, YaRN's RoPE
    # (transformers' default for gpt-oss: factor 32 over 4096 positions).
    "gpt-oss": (
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            num_local_experts=8,
            num_experts_per_tok=4,
            intermediate_size=64,
            sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING],
        ),
    ),
}


def tiny_model(name: str, **changes: Any) -> PreTrainedModel:
    """The family's tiny model, with the same random weights each time."""
    config_class, model_class, overrides = FAMILIES[name]
    torch.manual_seed(0)
    # Eager attention: the plainest reference, and it applies sliding windows through the mask.
    config = config_class(**(SHAPE | overrides | changes), attn_implementation="eager")
    return model_class(config).eval()


def saved_tiny_model(name: str, directory: Path, **changes: Any) -> PreTrainedModel:
    model = tiny_model(name, **changes)
    save_with_tokenizer(model, directory)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, saved_tiny_model(request.param, directory)


def test_prefill_logits_match_transformers(family: tuple[Path, PreTrainedModel]) -> None:
    directory, hf_model = family
    prompts = random_prompts(5, seed=2)  # lengths 1, 5, 17, 33, 64: past the window too
    torch.testing.assert_close(
        engine_prefill_logits(directory, prompts),
        hf_prefill_logits(hf_model, prompts),
        rtol=1e-4,
        atol=1e-4,
    )


def test_greedy_generation_matches_transformers(family: tuple[Path, PreTrainedModel]) -> None:
    directory, hf_model = family
    engine = LLMEngine(
        EngineConfig(model=str(directory), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = random_prompts(8)  # up to 64 tokens, and 24 more generated
    ours = run_engine(engine, prompts, max_tokens=24)
    assert ours == [hf_greedy(hf_model, p, 24) for p in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# The Triton kernels (in Triton's CPU interpreter) where the families differ around
# attention: Qwen3's and Gemma's Q/K norms fused with RoPE and the cache write, OLMo's not.
TRITON_CASES = [
    pytest.param(
        name,
        "triton",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1",
            reason="CPU tensors need Triton's interpreter; tests/gpu runs these kernels on CUDA",
        ),
    )
    for name in ["qwen3-wide-heads", "gemma3-tied", "olmo2-gqa", "gpt-oss"]
]


@pytest.mark.parametrize(("name", "backend"), [(name, "torch") for name in FAMILIES] + TRITON_CASES)
def test_prefill_logits_match_transformers_with_random_norms(
    name: str, backend: str, tmp_path: Path
) -> None:
    """Norm weights start all alike (ones; zeros for Gemma's (1 + weight)): drawn at random
    here, a weight loaded into the wrong norm shows."""
    hf_model = tiny_model(name)
    with torch.no_grad():
        for parameter_name, parameter in hf_model.named_parameters():
            if "norm" in parameter_name:
                parameter.uniform_(0.5, 1.5)
    save_with_tokenizer(hf_model, tmp_path)
    prompts = random_prompts(4, seed=3)
    torch.testing.assert_close(
        engine_prefill_logits(tmp_path, prompts, backend),
        hf_prefill_logits(hf_model, prompts),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("name", [n for n, (_, _, o) in FAMILIES.items() if "sliding_window" in o])
def test_the_reference_applies_the_sliding_window(name: str, tmp_path: Path) -> None:
    """Without this, the parity tests above could pass with windows ignored on both sides."""
    windowed = saved_tiny_model(name, tmp_path)
    unwindowed = tiny_model(name, sliding_window=4096)
    unwindowed.load_state_dict(windowed.state_dict())
    prompt = random_prompts(7)[-1]  # 40 tokens
    ours = engine_prefill_logits(tmp_path, [prompt])
    # Within the window both agree; past it only the windowed reference matches ours.
    torch.testing.assert_close(ours, hf_prefill_logits(windowed, [prompt]), rtol=1e-4, atol=1e-4)
    full_context = hf_prefill_logits(unwindowed, [prompt])
    torch.testing.assert_close(ours[:WINDOW], full_context[:WINDOW], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours[WINDOW:], full_context[WINDOW:], rtol=1e-2, atol=1e-2)


def test_gemma3_softcap_bites(tmp_path: Path) -> None:
    """The soft-cap case is one where capping changes the logits a lot, not a no-op."""
    name = "gemma3-untied-softcap"
    capped = saved_tiny_model(name, tmp_path)
    uncapped = tiny_model(name, final_logit_softcapping=None)
    uncapped.load_state_dict(capped.state_dict())
    prompts = random_prompts(5)
    cap = capped.config.final_logit_softcapping
    raw = hf_prefill_logits(uncapped, prompts)
    assert raw.abs().max() > 1.5 * cap
    ours = engine_prefill_logits(tmp_path, prompts)
    torch.testing.assert_close(ours, cap * torch.tanh(raw / cap), rtol=1e-4, atol=1e-4)


def test_every_eos_id_of_the_config_is_read(tmp_path: Path) -> None:
    eos = [VOCAB - 1, VOCAB - 2]  # as Gemma 3 lists <eos> and <end_of_turn>
    saved_tiny_model("gemma3-tied", tmp_path, eos_token_id=eos)
    assert load_checkpoint(str(tmp_path)).tokenizer.eos_token_ids == eos


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    saved_tiny_model("llama-llama3-rope-untied", tmp_path)
    config_file = tmp_path / "config.json"
    config_file.write_text(
        config_file.read_text().replace('"LlamaForCausalLM"', '"FalconForCausalLM"')
    )
    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported") as error:
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_gb=0.01))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_build_model_refuses_an_unknown_architecture(tmp_path: Path) -> None:
    saved_tiny_model("qwen2-biases-tied", tmp_path)
    config = load_checkpoint(str(tmp_path)).config
    config.architecture = "Qwen2MoeForCausalLM"
    device = torch.device("cpu")
    with pytest.raises(ValueError, match="'Qwen2MoeForCausalLM' is not supported, only Llama"):
        build_model(config, create_backend("torch", device), 64, device, torch.float32)


# --- config.json in the formats found on the Hub ------------------------------------------------

GEMMA3_4B_TEXT = {  # google/gemma-3-4b-it's text_config as a text-only checkpoint, transformers 4
    "architectures": ["Gemma3ForCausalLM"],
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "max_position_embeddings": 131072,
    "num_attention_heads": 8,
    "num_hidden_layers": 34,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "vocab_size": 262208,
    "eos_token_id": [1, 106],
}


def test_gemma3_config_in_the_older_format() -> None:
    config = hf_model_config(GEMMA3_4B_TEXT, Path("gemma-3-4b"))
    assert config.layer_types == ([SLIDING] * 5 + [FULL]) * 5 + [SLIDING] * 4
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.rope_linear_factor == 8.0
    assert config.rope_scaling is None
    assert config.sliding_window == 1024
    assert config.query_pre_attn_scalar == 256
    assert config.tie_word_embeddings  # Gemma 3's default, which the file leaves out
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert config.architecture == "Gemma3ForCausalLM"  # its QK norms and Gemma's norms
    assert config.final_logit_softcapping is None


def test_gemma3_config_reads_the_same_in_both_formats() -> None:
    # transformers 5 turns the older fields into its format: per layer type rope_parameters.
    newer = Gemma3TextConfig(**GEMMA3_4B_TEXT).to_dict()
    assert set(newer["rope_parameters"]) == {SLIDING, FULL}
    assert "rope_local_base_freq" not in newer and "rope_scaling" not in newer
    assert hf_model_config(newer, Path("new")) == hf_model_config(GEMMA3_4B_TEXT, Path("old"))


QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct: a window named, but not used
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


def test_qwen2_config_ignores_an_unused_window() -> None:
    config = hf_model_config(QWEN25_7B, Path("Qwen2.5-7B-Instruct"))
    assert config.architecture == "Qwen2ForCausalLM"  # its Q/K/V biases
    assert (config.layer_types, config.sliding_window) == (None, None)
    assert config.rope_theta == 1_000_000.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GEMMA3_4B_TEXT | {"architectures": ["Gemma3ForConditionalGeneration"]}, "text-only"),
        (GEMMA3_4B_TEXT | {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (GEMMA3_4B_TEXT | {"layer_types": [SLIDING] * 3}, "each of the 34 layers"),
        (GEMMA3_4B_TEXT | {"layer_types": ["chunked_attention"] * 34}, "layer_types"),
        (QWEN25_7B | {"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "'dynamic'"),
        (
            QWEN25_7B | {"rope_scaling": {"type": "yarn", "factor": 4.0}},
            r"config\.json: rope_scaling's 'original_max_position_embeddings' is missing",
        ),
        (QWEN25_7B | {"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "bias"),
    ],
)
def test_configs_the_models_cannot_run_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf_model_config(config, Path("model"))
