"""Our engine against Hugging Face transformers on tiny random Llama checkpoints (float32, CPU).

The model, the paged cache, the scheduler and preemption are all in the path: greedy
generations of a mixed batch must equal transformers' token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from engine.attention import AttentionMetadata, LayerKVCache
from engine.checkpoint import load_checkpoint
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model import build_model
from engine.model_runner import select_attention_backend
from protocol import SamplingParams

VOCAB = 256

CONFIGS = {
    "gqa-untied-llama3-rope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mha-tied": dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True
    ),
    "gqa8-head64": dict(
        num_attention_heads=8, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True
    ),
}


def save_tiny_llama(directory: Path, **overrides) -> HFLlama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rope_theta=10000.0,
        eos_token_id=VOCAB - 1,
        bos_token_id=0,
        **overrides,
    )
    model = HFLlama(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    # The engine needs a tokenizer.json to hand to servers; ids here never meet text.
    Tokenizer(models.BPE()).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, save_tiny_llama(directory, **CONFIGS[request.param])


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 17, 33, 64, 3, 40, 9][:count]
    return [torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model: HFLlama, prompt: list[int], max_new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt)),
    )
    return output[0, len(prompt) :].tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(b"test", str(i), prompt, sampling)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def test_prefill_logits_match_transformers(tiny):
    directory, hf_model = tiny
    checkpoint = load_checkpoint(str(directory))
    device = torch.device("cpu")
    model = build_model(
        checkpoint.config, select_attention_backend(device), 512, device, torch.float32
    )
    model.load_weights(checkpoint.weights())
    config = checkpoint.config
    block_size, num_blocks = 4, 64
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    model.bind_kv_cache(
        [
            LayerKVCache(torch.zeros(shape), torch.zeros(shape))
            for _ in range(config.num_hidden_layers)
        ]
    )
    prompts = [torch.tensor(p) for p in _prompts(3, seed=2)]  # lengths 1, 5, 17
    lengths = torch.tensor([len(p) for p in prompts])
    tables = torch.arange(3 * 8).view(3, 8)  # disjoint blocks for the three sequences
    seq_index = torch.repeat_interleave(torch.arange(3), lengths)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    metadata = AttentionMetadata(
        positions=positions,
        slot_mapping=tables[seq_index, positions // block_size] * block_size
        + positions % block_size,
        token_seq_index=seq_index,
        block_tables=tables,
        context_lens=lengths,
        query_lens=lengths,
        max_query_len=int(lengths.max()),
    )
    with torch.no_grad():
        ours = model(torch.cat(prompts), metadata, torch.arange(int(lengths.sum())))
        theirs = torch.cat([hf_model(p[None]).logits[0] for p in prompts])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers(tiny):
    directory, hf_model = tiny
    engine = LLMEngine(
        EngineConfig(model=str(directory), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = _prompts(8)
    ours = run_engine(engine, prompts, max_tokens=24)
    theirs = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours == theirs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_cache_pressure_keeps_outputs_exact(tiny):
    directory, hf_model = tiny
    # 40 blocks of 4 tokens: the 8 requests (up to 64 + 24 tokens) cannot all stay resident.
    engine = LLMEngine(
        EngineConfig(
            model=str(directory), device="cpu", block_size=4, num_kv_blocks=40, max_model_len=160
        )
    )
    prompts = _prompts(8)
    ours = run_engine(engine, prompts, max_tokens=24)
    theirs = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours == theirs
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 40
