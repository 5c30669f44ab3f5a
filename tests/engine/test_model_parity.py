"""Our engine against Hugging Face transformers on tiny random Llama checkpoints (float32, CPU).

The model, the paged cache, the scheduler and preemption are all in the path: greedy
generations of a mixed batch must equal transformers' token for token. The prefill helpers serve
tests/engine/test_model_families.py too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama
from transformers import PreTrainedModel

from engine.backends import BACKENDS, Backend, create_backend
from engine.backends.attention import AttentionMetadata, LayerKVCache, Rotary
from engine.backends.pytorch import TorchLayerOps, TorchPagedAttention, TorchStepOps, store_kv
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import build_model, load_checkpoint
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy, run_engine

# initializer_range 0.2, not transformers' 0.02: at 0.02 these tiny models' greedy outputs
# collapse into one token repeated, which a decode that ignores the cache reproduces too
# (test_a_decode_that_ignores_the_cache_fails_parity).
DIVERSE = dict(initializer_range=0.2)
CONFIGS = {
    "gqa-untied-llama3-rope": DIVERSE
    | dict(
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
    "mha-tied": DIVERSE
    | dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    "gqa8-head64": DIVERSE
    | dict(num_attention_heads=8, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, HFLlama]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, save_tiny_llama(directory, **CONFIGS[request.param])


def engine_prefill_logits(
    directory: Path, prompts: list[list[int]], backend: str = "torch"
) -> torch.Tensor:
    """Our model's logits at every prompt token, the prompts prefilled as one packed batch
    on the CPU, with the CPU's backend unless ``backend`` names another."""
    checkpoint = load_checkpoint(str(directory))
    device = torch.device("cpu")
    config = checkpoint.config
    built = create_backend(backend, device)
    attention = built.attention
    model = build_model(config, built, 512, device, torch.float32)
    model.load_weights(checkpoint.weight_slices())
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
    attention.prepare(metadata)
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
        engine_prefill_logits(directory, prompts, "triton"),
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
    # Varied outputs, not one token repeated: what makes equality mean something.
    assert all(len(set(tokens)) >= 8 for tokens in theirs)
    assert ours == theirs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class CachelessDecode(TorchPagedAttention):
    """A fast, wrong decode: each new token attends to itself alone, ignoring the cache
    (which it still writes). Prefills are right."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        rotary: Rotary | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if metadata.max_query_len > 1:
            return super().forward(
                q, k, v, cache, metadata, scale, sliding_window, rotary=rotary, sinks=sinks
            )
        store_kv(k, v, cache.key, cache.value, metadata.slot_mapping)
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # softmax of one key


def test_a_decode_that_ignores_the_cache_fails_parity(
    tiny: tuple[Path, HFLlama], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parity test above can fail: with decode steps that ignore the cache, each
    request's first token (from its prefill) is right and the rest are not."""
    directory, hf_model = tiny
    cacheless = Backend("cacheless", CachelessDecode(), TorchLayerOps(), TorchStepOps())
    monkeypatch.setitem(BACKENDS, "cacheless", lambda _: cacheless)
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=4,
            kv_cache_memory_gb=0.01,
            backend="cacheless",
        )
    )
    prompts = random_prompts(8)
    ours = run_engine(engine, prompts, max_tokens=24)
    theirs = [hf_greedy(hf_model, p, 24) for p in prompts]
    assert [tokens[0] for tokens in ours] == [tokens[0] for tokens in theirs]
    assert all(mine != reference for mine, reference in zip(ours, theirs, strict=True))


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
