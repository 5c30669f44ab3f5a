"""Random-weight checkpoints in real models' shapes, with a tokenizer that covers the vocab."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

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
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=0,
    eos_token_id=1,
)
LLAMA_3_1_8B = dict(
    LLAMA_3_2_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_random_llama(directory: Path, shape: dict, dtype: torch.dtype) -> LlamaForCausalLM:
    """A random Llama with `shape`, saved as safetensors with a word-level tokenizer."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()
    model.save_pretrained(directory, safe_serialization=True)
    # One word per id, so any generated id decodes to text.
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    for i, special in enumerate(["<|im_start|>", "<|im_end|>"]):
        vocab[special] = i
        del vocab[f"w{i}"]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": None, "eos_token": "<|im_end|>"})
    )
    return model
