"""Random-weight checkpoints saved by transformers itself, for CPU tests, GPU tests and benchmarks.

Tiny ones (``save_tiny_llama``, ``save_with_tokenizer``) for the CPU tests against transformers;
real models' shapes (``save_random_model``) for the GPU tests and benchmarks. Throughput and
numerical error do not depend on the weights' values, so these stand in for the real models
(which no machine here can download).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 256  # the tiny checkpoints' vocabulary


def save_tiny_llama(directory: Path, **overrides: Any) -> LlamaForCausalLM:
    """A 3-layer Llama of hidden size 64 over ``VOCAB`` ids, ``overrides`` applied to its config."""
    torch.manual_seed(0)
    defaults = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_id=VOCAB - 1,
        bos_token_id=0,
    )
    config = LlamaConfig(**(defaults | overrides))
    model = LlamaForCausalLM(config).eval()
    save_with_tokenizer(model, directory)
    return model


def save_tiny_word_model(directory: Path, **overrides: Any) -> None:
    """``save_tiny_llama`` with a tokenizer of words and a ChatML template
    (``save_word_tokenizer``): the fastest model a server can chat with; the text is nonsense."""
    save_tiny_llama(directory, **overrides)
    save_word_tokenizer(directory, VOCAB)


def save_with_tokenizer(model: PreTrainedModel, directory: Path) -> None:
    """Save ``model`` as a checkpoint directory the engine loads."""
    model.save_pretrained(directory, safe_serialization=True)
    # The engine needs a tokenizer.json to hand to servers; ids here never meet text.
    Tokenizer(models.BPE()).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))


def random_prompts(count: int, seed: int = 1) -> list[list[int]]:
    """Up to 8 prompts of ids below ``VOCAB`` - 1 (the tiny checkpoints' EOS), lengths 1 to 64."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 17, 33, 64, 3, 40, 9][:count]
    return [torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist() for n in lengths]


_SPECIAL_IDS = dict(bos_token_id=0, eos_token_id=1)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_scaling=_LLAMA3_ROPE | {"factor": 32.0},
    **_SPECIAL_IDS,
)
LLAMA_3_1_8B = dict(
    LLAMA_3_2_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    tie_word_embeddings=False,
    rope_scaling=_LLAMA3_ROPE | {"factor": 8.0},
)
LLAMA_3_1_70B = dict(
    LLAMA_3_1_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
)
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    **_SPECIAL_IDS,
)
QWEN2_5_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    **_SPECIAL_IDS,
)
SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shape
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    **_SPECIAL_IDS,
)
GEMMA3_1B = dict(  # google/gemma-3-1b-it: five sliding layers to one global, head_dim 256
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    **_SPECIAL_IDS,
)

QWEN3_30B_A3B = dict(  # Qwen/Qwen3-30B-A3B: 128 experts, 8 a token, ~3.3B parameters active
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    **_SPECIAL_IDS,
)
QWEN3_235B_A22B = dict(  # Qwen/Qwen3-235B-A22B: ~22B parameters active
    QWEN3_30B_A3B,
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=94,
    num_attention_heads=64,
)
MIXTRAL_8X7B = dict(  # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 a token, ~12.9B active
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    rope_theta=1_000_000.0,
    max_position_embeddings=32768,
    sliding_window=None,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    **_SPECIAL_IDS,
)

GPT_OSS_20B = dict(  # openai/gpt-oss-20b: 32 experts, 4 a token, ~3.6B parameters active
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,  # each expert's
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,  # every other layer, from the first
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
    **_SPECIAL_IDS,
)
GPT_OSS_120B = dict(  # openai/gpt-oss-120b: 128 experts, ~5.1B parameters active
    GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128
)

# name: (transformers config class, model class, config)
SHAPES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama-3.2-1b": (LlamaConfig, LlamaForCausalLM, LLAMA_3_2_1B),
    "llama-3.1-8b": (LlamaConfig, LlamaForCausalLM, LLAMA_3_1_8B),
    "llama-3.1-70b": (LlamaConfig, LlamaForCausalLM, LLAMA_3_1_70B),
    "qwen3-0.6b": (Qwen3Config, Qwen3ForCausalLM, QWEN3_0_6B),
    "qwen2.5-0.5b": (Qwen2Config, Qwen2ForCausalLM, QWEN2_5_0_5B),
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, SMOLLM2_135M),
    "gemma3-1b": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3_1B),
    "qwen3-30b-a3b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_30B_A3B),
    "qwen3-235b-a22b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_235B_A22B),
    "mixtral-8x7b": (MixtralConfig, MixtralForCausalLM, MIXTRAL_8X7B),
    "gpt-oss-20b": (GptOssConfig, GptOssForCausalLM, GPT_OSS_20B),
    "gpt-oss-120b": (GptOssConfig, GptOssForCausalLM, GPT_OSS_120B),
}


@dataclass(frozen=True)
class ShapeDims:
    """A shape's attention and MLP sizes, as its benchmarks build its layers from them."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def shape_dims(shape: str) -> ShapeDims:
    """The sizes of ``shape`` (a key of SHAPES), head_dim hidden / heads where unset."""
    config = SHAPES[shape][2]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return ShapeDims(
        hidden,
        heads,
        config["num_key_value_heads"],
        config.get("head_dim", hidden // heads),
        config["intermediate_size"],
    )


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_PRINTABLE = [chr(c) for c in range(0x20, 0x7F)]


def save_random_model(
    directory: Path, shape: str, dtype: torch.dtype, **overrides: Any
) -> PreTrainedModel:
    """A random model of ``shape`` (a key of SHAPES; ``overrides`` applied to its config, such
    as fewer layers), saved as safetensors with a word-level tokenizer
    (``save_word_tokenizer``); returns the transformers model (on the CPU, in ``dtype``)."""
    config_class, model_class, config = SHAPES[shape]
    config = config | overrides
    torch.manual_seed(0)
    model = model_class(config_class(**config)).to(dtype).eval()
    model.save_pretrained(directory, safe_serialization=True)
    save_word_tokenizer(directory, config["vocab_size"])
    return model


def save_random_config(directory: Path, shape: str) -> None:
    """``shape``'s config.json and a word-level tokenizer, no weights: for the engine's
    ``--load-format dummy``, which makes random weights of the config's shape itself (a 70B
    model's 141 GB need never be written)."""
    config_class, model_class, config = SHAPES[shape]
    hf_config = config_class(**config)
    hf_config.architectures = [model_class.__name__]
    hf_config.save_pretrained(directory)
    save_word_tokenizer(directory, config["vocab_size"])


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A tokenizer of one word per id, so any generated id decodes to text: ChatML's two
    special tokens, the printable ASCII characters last, so that a grammar (JSON, say) can be
    spelled in these tokens, and words between."""
    first_char = vocab_size - len(_PRINTABLE)
    vocab = {f"w{i}": i for i in range(first_char)}
    vocab |= {char: first_char + i for i, char in enumerate(_PRINTABLE)}
    for i, special in enumerate(["<|im_start|>", "<|im_end|>"]):
        vocab[special] = i
        del vocab[f"w{i}"]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": None, "eos_token": "<|im_end|>"})
    )
