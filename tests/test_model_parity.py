"""Our engine against Hugging Face transformers on tiny random Llama checkpoints (float32, CPU).

The model, the paged cache, the scheduler and preemption are all in the path: greedy
generations of a mixed batch must equal transformers' token for token. The helpers serve
tests/test_model_families.py too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, PreTrainedModel
from transformers import LlamaForCausalLM as HFLlama

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from engine.checkpoint import load_checkpoint
from engine.layer_ops import LayerOps
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import select_backend
from engine.models import build_model
from engine.triton_backend import TritonLayerOps, TritonPagedAttention
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
    save_with_tokenizer(model, directory)
    return model


def save_with_tokenizer(model: PreTrainedModel, directory: Path) -> None:
    """Save ``model`` as a checkpoint directory the engine loads."""
    model.save_pretrained(directory, safe_serialization=True)
    # The engine needs a tokenizer.json to hand to servers; ids here never meet text.
    Tokenizer(models.BPE()).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, save_tiny_llama(directory, **CONFIGS[request.param])


def random_prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 17, 33, 64, 3, 40, 9][:count]
    return [torch.randint(0, VOCAB - 1, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
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


def engine_prefill_logits(
    directory: Path,
    prompts: list[list[int]],
    backend: tuple[AttentionBackend, LayerOps] | None = None,
) -> torch.Tensor:
    """Our model's logits at every prompt token, the prompts prefilled as one packed batch,
    with the CPU's backend unless ``backend`` names another."""
    checkpoint = load_checkpoint(str(directory))
    device = torch.device("cpu")
    config = checkpoint.config
    attention, ops = backend or select_backend(device)
    model = build_model(config, attention, ops, 512, device, torch.float32)
    model.load_weights(checkpoint.weights())
    block_size, blocks_per_sequence = 4, 32  # each sequence its own blocks, up to 128 tokens
    shape = (
        len(prompts) * blocks_per_sequence,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
    )
    model.bind_kv_cache(
        [
            LayerKVCache(torch.zeros(shape), torch.zeros(shape))
            for _ in range(config.num_hidden_layers)
        ]
    )
    lengths = torch.tensor([len(p) for p in prompts])
    tables = torch.arange(shape[0]).view(len(prompts), blocks_per_sequence)
    seq_index = torch.repeat_interleave(torch.arange(len(prompts)), lengths)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    metadata = AttentionMetadata(
        positions=positions,
        slot_mapping=tables[seq_index, positions // block_size] * block_size
        + positions % block_size,
        token_seq_index=seq_index,
        block_tables=tables,
        context_lens=lengths,
        query_lens=lengths,
        query_starts=torch.cumsum(lengths, 0) - lengths,
        max_query_len=int(lengths.max()),
    )
    input_ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        return model(input_ids, metadata, torch.arange(int(lengths.sum())))


def hf_prefill_logits(model: PreTrainedModel, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


def test_prefill_logits_match_transformers(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    prompts = random_prompts(3, seed=2)  # lengths 1, 5, 17
    torch.testing.assert_close(
        engine_prefill_logits(directory, prompts),
        hf_prefill_logits(hf_model, prompts),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter; tests/gpu runs these kernels on CUDA",
)
def test_triton_backend_prefill_logits_match_transformers(tiny: tuple[Path, HFLlama]) -> None:
    """The CUDA backend's kernels in the whole model, run by Triton's CPU interpreter."""
    directory, hf_model = tiny
    prompts = random_prompts(3, seed=2)
    torch.testing.assert_close(
        engine_prefill_logits(directory, prompts, (TritonPagedAttention(), TritonLayerOps())),
        hf_prefill_logits(hf_model, prompts),
        rtol=1e-4,
        atol=1e-4,
    )


def test_greedy_generation_matches_transformers(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = LLMEngine(
        EngineConfig(model=str(directory), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = random_prompts(8)
    ours = run_engine(engine, prompts, max_tokens=24)
    theirs = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours == theirs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_cache_pressure_keeps_outputs_exact(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    # 40 blocks of 4 tokens: the 8 requests (up to 64 + 24 tokens) cannot all stay resident.
    engine = LLMEngine(
        EngineConfig(
            model=str(directory), device="cpu", block_size=4, num_kv_blocks=40, max_model_len=160
        )
    )
    prompts = random_prompts(8)
    ours = run_engine(engine, prompts, max_tokens=24)
    theirs = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert ours == theirs
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 40
