"""Embeddings in the engine (engine/execution/pooling.py) against transformers' last hidden
state on the same weights: the last token's (a causal LM's default) and the mean (a
sentence-transformers Pooling config), prompts in chunks of a small token budget and several
at once, beside a generation that goes on as it would alone; blocks all given back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.llm_engine import EngineConfig, LLMEngine, RequestRejected
from protocol import Embedding, SamplingParams
from tandem.testing.random_checkpoint import random_prompts

CLIENT = b"test"


def reference(model: LlamaForCausalLM, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def make_engine(directory: Path, **overrides: int) -> LLMEngine:
    settings = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    return LLMEngine(EngineConfig(model=str(directory), device="cpu", **settings))


def embed_all(engine: LLMEngine, prompts: list[list[int]]) -> list[Embedding]:
    for index, prompt in enumerate(prompts):
        engine.add_embed_request(CLIENT, f"e{index}", prompt)
    done: dict[str, Embedding] = {}
    while engine.has_work:
        engine.step()
        done.update((embedding.request_id, embedding) for _, embedding in engine.pool())
    return [done[f"e{index}"] for index in range(len(prompts))]


def assert_close(ours: Embedding, expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(ours.embedding), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(
    tiny: tuple[Path, LlamaForCausalLM], tmp_path: Path, pooling: str
) -> None:
    directory, model = tiny
    if pooling == "mean":  # a sentence-transformers model pooling the mean
        directory = Path(shutil.copytree(directory, tmp_path / "mean"))
        (directory / "modules.json").write_text(
            json.dumps(
                [
                    {
                        "idx": 0,
                        "name": "1",
                        "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling",
                    }
                ]
            )
        )
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling/config.json").write_text(
            json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
        )
    # A budget of 8 tokens a step: the long prompts pool over several chunks.
    engine = make_engine(directory, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = random_prompts(4)[1:]  # 5, 17 and 33 tokens
    embeddings = embed_all(engine, prompts)
    for prompt, embedding in zip(prompts, embeddings, strict=True):
        assert embedding.num_prompt_tokens == len(prompt)
        assert_close(embedding, reference(model, prompt, pooling))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_embeddings_beside_a_generation(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    directory, model = tiny
    engine = make_engine(directory, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = random_prompts(8)[7]  # 9 tokens
    engine.add_request(CLIENT, "alone", prompt, SamplingParams(max_tokens=6))
    alone = []
    while engine.has_work:
        alone += [t for _, out in engine.step() for t in out.new_token_ids]

    engine.add_request(CLIENT, "g", prompt, SamplingParams(max_tokens=6))
    engine.add_embed_request(CLIENT, "e", prompt + prompt)
    tokens, embeddings = [], []
    while engine.has_work:
        tokens += [t for _, out in engine.step() for t in out.new_token_ids]
        embeddings += [embedding for _, embedding in engine.pool()]
    assert tokens == alone
    assert len(embeddings) == 1
    assert_close(embeddings[0], reference(model, prompt + prompt, "last"))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_embed_requests_refused_and_aborted(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    directory, _ = tiny
    engine = make_engine(directory, max_model_len=64)

    for prompt, code in (
        ([], "invalid_request"),
        ([10**6], "invalid_request"),
        ([1] * 65, "prompt_too_long"),
    ):
        with pytest.raises(RequestRejected) as refused:
            engine.add_embed_request(CLIENT, "bad", prompt)
        assert refused.value.code == code
    engine.add_embed_request(CLIENT, "e", [1, 2, 3])
    with pytest.raises(RequestRejected):  # its id is in use
        engine.add_request(CLIENT, "e", [1], SamplingParams())
    assert engine.abort(CLIENT, "e") is None
    assert not engine.has_work
