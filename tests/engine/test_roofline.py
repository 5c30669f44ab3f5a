"""The roofline's arithmetic (engine/roofline.py) by hand, and the step shapes the engine
records against the schedule it ran."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from engine.backends import create_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import Quantization
from engine.models import build_model, load_checkpoint
from engine.roofline import (
    DeviceRates,
    ModelCost,
    StepShape,
    cache_read_bytes,
    load_steps,
    measure_rates,
    run_bound,
    save_steps,
    step_bound,
    step_traffic,
    uneven_routing_note,
    workload_bound,
)
from tandem.testing.reference import run_engine
from tests.engine.test_model_families import saved_tiny_model

# One layer of 2 KV heads of dim 4 (K and V: 16 elements a token), 8 query heads.
COST = ModelCost(
    layer_weight_bytes=1000,
    head_weight_bytes=500,
    embedding_row_bytes=10,
    layer_matmul_params=300,
    head_params=250,
    kv_bytes_per_token=2 * 2 * 4 * 2,
    attention_flops_per_pair=4 * 8 * 4,
    windows=(None,),
)


def shape(query_lens: list[int], context_lens: list[int], num_logits: int) -> StepShape:
    return StepShape(np.array(query_lens), np.array(context_lens), num_logits)


def test_decode_step_reads_the_weights_and_every_cached_key() -> None:
    step = shape([1, 1], [10, 3], num_logits=2)
    num_bytes, flops, _ = step_traffic(step, COST)
    kv_read, kv_written = 9 + 2, 2  # the new keys are written, never read back
    assert num_bytes == 1000 + 500 + 2 * 10 + (kv_read + kv_written) * 32
    # Each query sees its whole context, itself included.
    assert flops == 2 * 300 * 2 + 2 * 250 * 2 + 128 * (10 + 3)
    # The cache's part alone: what its decode attention cannot read in less time.
    assert cache_read_bytes(step, COST) == kv_read * 32


def test_prefill_chunk_is_causal_and_skips_the_head_without_logits() -> None:
    # A chunk of 4 tokens after 6 cached ones: its queries see 7, 8, 9 and 10 keys.
    step = shape([4], [10], num_logits=0)
    num_bytes, flops, _ = step_traffic(step, COST)
    assert num_bytes == 1000 + 4 * 10 + (6 + 4) * 32
    assert flops == 2 * 300 * 4 + 128 * (7 + 8 + 9 + 10)


def test_sliding_window_caps_keys_read_and_attended() -> None:
    windowed = ModelCost(**{**COST.__dict__, "windows": (None, 4)})
    # Decode at context 10: the full layer reads 9 cached keys and sees 10; the windowed
    # one reads the 3 before the new token and sees 4.
    num_bytes, flops, _ = step_traffic(shape([1], [10], 1), windowed)
    assert num_bytes == 1000 + 500 + 10 + (9 + 3 + 2) * 32
    assert cache_read_bytes(shape([1], [10], 1), windowed) == (9 + 3) * 32
    assert flops == 2 * 300 + 2 * 250 + 128 * (10 + 4)
    # A prefill of 6 from nothing: the windowed layer's queries see 1, 2, 3, 4, 4, 4 keys.
    _, flops, _ = step_traffic(shape([6], [6], 1), windowed)
    assert flops == 2 * 300 * 6 + 2 * 250 + 128 * (21 + 18)


def test_bound_is_the_larger_term_summed_over_steps() -> None:
    decode, prefill = shape([1], [10], 1), shape([8], [8], 1)
    rates = DeviceRates(bytes_per_s=1000.0, flops_per_s=5e3)
    for step in (decode, prefill):
        num_bytes, flops, _ = step_traffic(step, COST)
        assert step_bound(step, COST, rates) == max(num_bytes / 1000.0, flops / 5e3)
    # The decode step is bound by bytes, the prefill by FLOPs at these rates.
    assert step_traffic(decode, COST)[0] / 1000.0 > step_traffic(decode, COST)[1] / 5e3
    assert step_traffic(prefill, COST)[1] / 5e3 > step_traffic(prefill, COST)[0] / 1000.0
    assert run_bound([decode, prefill, decode], COST, rates) == pytest.approx(
        2 * step_bound(decode, COST, rates) + step_bound(prefill, COST, rates)
    )


def test_fp8_layers_products_count_at_the_fp8_rate() -> None:
    # Two thirds of the layers' matrices in FP8, multiplied twice as fast as bf16.
    fp8 = ModelCost(**{**COST.__dict__, "fp8_matmul_params": 200})
    prefill = shape([8], [8], 1)
    num_bytes, flops, fp8_flops = step_traffic(prefill, fp8)
    assert fp8_flops == 2 * 200 * 8
    assert flops + fp8_flops == step_traffic(prefill, COST).flops
    rates = DeviceRates(bytes_per_s=1000.0, flops_per_s=5e3, fp8_flops_per_s=1e4)
    assert step_bound(prefill, fp8, rates) == max(num_bytes / 1000.0, flops / 5e3 + fp8_flops / 1e4)
    assert step_bound(prefill, fp8, rates) < step_bound(prefill, COST, rates)
    # With no FP8 rate measured they count at the bf16 rate: the bound is unchanged.
    bf16_only = DeviceRates(bytes_per_s=1000.0, flops_per_s=5e3)
    assert step_bound(prefill, fp8, bf16_only) == pytest.approx(
        step_bound(prefill, COST, bf16_only)
    )


def test_model_cost_of_a_tiny_llama(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    directory, _ = tiny
    config = load_checkpoint(str(directory)).config
    meta = torch.device("meta")
    model = build_model(config, create_backend("torch", meta), 16, meta, torch.bfloat16)
    cost = ModelCost.of_model(model, torch.bfloat16)
    hidden, inter, layers, vocab = 64, 160, 3, 256
    q, kv = 4 * 16, 2 * 16
    matmuls = hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden
    assert cost.layer_matmul_params == layers * matmuls
    assert cost.layer_weight_bytes == 2 * (layers * (matmuls + 2 * hidden) + hidden)
    assert cost.head_params == vocab * hidden  # untied: lm_head's own
    assert cost.head_weight_bytes == 2 * vocab * hidden
    assert cost.embedding_row_bytes == 2 * hidden
    assert cost.kv_bytes_per_token == 2 * kv * 2
    assert cost.attention_flops_per_pair == 4 * q
    assert cost.windows == (None, None, None)
    assert cost.fp8_matmul_params == 0
    quantized = replace(config, quantization=Quantization("fp8"))
    model = build_model(quantized, create_backend("torch", meta), 16, meta, torch.bfloat16)
    fp8_cost = ModelCost.of_model(model, torch.bfloat16)
    assert fp8_cost.fp8_matmul_params == fp8_cost.layer_matmul_params == layers * matmuls
    # A byte a matrix element (the per-channel scales are buffers, a thousandth of it, left out).
    assert fp8_cost.layer_weight_bytes == cost.layer_weight_bytes - layers * matmuls


def test_a_mixture_of_experts_reads_the_experts_its_tokens_go_to(tmp_path: Path) -> None:
    """Tiny Qwen3-MoE: 3 layers, the middle one dense; 8 experts of 48 features, 3 a token.
    One token reads 3 experts a layer; 100 tokens, every expert; each token computes
    through 3."""
    saved_tiny_model("qwen3-moe-dense-middle", tmp_path)
    meta = torch.device("meta")
    config = load_checkpoint(str(tmp_path)).config
    model = build_model(config, create_backend("torch", meta), 16, meta, torch.bfloat16)
    cost = ModelCost.of_model(model, torch.bfloat16)
    hidden, moe_layers, experts, top_k = 64, 2, 8, 3
    per_expert = 3 * hidden * 48  # gate, up and down
    assert cost.expert_matmul_params == moe_layers * experts * per_expert
    assert cost.expert_weight_bytes == 2 * cost.expert_matmul_params
    assert (cost.num_experts, cost.experts_per_token) == (experts, top_k)
    q, kv = 4 * 16, 2 * 16
    attention = hidden * (q + 2 * kv) + q * hidden
    routers, dense_mlp = moe_layers * experts * hidden, 3 * hidden * 160
    assert cost.layer_matmul_params == 3 * attention + routers + dense_mlp
    without_experts = replace(cost, expert_weight_bytes=0, expert_matmul_params=0)
    for tokens, experts_read in ((1, top_k), (2, 2 * top_k), (100, experts)):
        step = shape([tokens], [tokens], num_logits=1)
        traffic, dense = step_traffic(step, cost), step_traffic(step, without_experts)
        expert_bytes = moe_layers * experts_read * per_expert * 2
        assert traffic.num_bytes - dense.num_bytes == expert_bytes
        assert traffic.flops - dense.flops == 2 * tokens * top_k * moe_layers * per_expert
    fp8 = replace(cost, fp8_expert_matmul_params=cost.expert_matmul_params)
    step = shape([5], [5], num_logits=1)
    assert step_traffic(step, fp8).flops == step_traffic(step, without_experts).flops
    assert step_traffic(step, fp8).fp8_flops == 2 * 5 * top_k * moe_layers * per_expert


def test_a_share_above_the_bound_is_explained_only_for_a_mixture_of_experts() -> None:
    """Random weights route a mixture of experts' tokens unevenly, so its runs can beat a bound
    that spreads them evenly: the benchmarks say so under the shares. A dense model's share
    above 100% gets no excuse (a wrong bound), nor does any share at or below it."""
    moe = replace(COST, num_experts=128, experts_per_token=8)
    note = uneven_routing_note(moe, [0.62, 1.28])
    assert note is not None and "min(E, tokens x k)" in note
    assert uneven_routing_note(moe, [0.62, 1.0]) is None
    assert uneven_routing_note(COST, [0.62, 1.28]) is None


def test_engine_records_the_steps_it_ran(
    tiny: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    directory, _ = tiny
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=16,
        )
    )
    assert engine.step_shapes is None  # nothing kept unless asked
    engine.step_shapes = []
    prompts = [list(range(1, 21)), list(range(30, 35))]
    run_engine(engine, prompts, max_tokens=3)
    steps = engine.step_shapes
    # 16 tokens a step: the first prompt's first chunk; then its last 4 with the second
    # prompt; then two decode steps of both.
    assert [s.query_lens.tolist() for s in steps] == [[16], [4, 5], [1, 1], [1, 1]]
    assert [s.context_lens.tolist() for s in steps] == [[16], [20, 5], [21, 6], [22, 7]]
    assert [s.num_logits for s in steps] == [0, 2, 2, 2]
    assert [s.is_decode for s in steps] == [False, False, True, True]
    save_steps(tmp_path / "steps.json", steps)
    loaded = load_steps(tmp_path / "steps.json")
    assert [(s.query_lens.tolist(), s.context_lens.tolist(), s.num_logits) for s in loaded] == [
        (s.query_lens.tolist(), s.context_lens.tolist(), s.num_logits) for s in steps
    ]


def test_workload_bound_reads_the_weights_once_a_position_and_never_exceeds_the_steps() -> None:
    """Two requests, prompts 20 and 5 tokens, 3 and 1 output tokens: the weights are read 3
    times (the prompts' step, then two decodes of the longer request);
    the K/V of every token written and read as its queries need; FLOPs summed."""
    memory_bound = DeviceRates(bytes_per_s=1.0, flops_per_s=1e30)
    cached_keys = 20 + 21  # the two decodes' queries read the 20, then 21, keys before them
    kv_bytes = ((20 + 5 + 2) + cached_keys) * COST.kv_bytes_per_token
    weights = 3 * COST.layer_weight_bytes + 3 * COST.head_weight_bytes
    embeddings = (20 + 5 + 2) * COST.embedding_row_bytes
    assert workload_bound([20, 5], [3, 1], 4, COST, memory_bound) == weights + kv_bytes + embeddings
    # The same steps as an engine would run them: the prompts alone, then the decodes.
    steps = [shape([20, 5], [20, 5], 2), shape([1], [21], 1), shape([1], [22], 1)]
    assert run_bound(steps, COST, memory_bound) == workload_bound(
        [20, 5], [3, 1], 4, COST, memory_bound
    )
    # Computing overlaps reading across the whole run: never above the steps' own bound.
    rates = DeviceRates(bytes_per_s=1.0, flops_per_s=40.0)
    assert workload_bound([20, 5], [3, 1], 4, COST, rates) <= run_bound(steps, COST, rates)
    # One request a wave: each wave reads the weights as often as its request has tokens.
    waves = workload_bound([20, 5], [3, 1], 1, COST, memory_bound)
    assert (
        waves == weights + COST.layer_weight_bytes + COST.head_weight_bytes + kv_bytes + embeddings
    )
    # Prompts found in the prefix cache: one token of each computed, the rest read.
    cached = workload_bound([20, 5], [3, 1], 4, COST, memory_bound, prompts_cached=True)
    read_prompts = (19 + 4) * COST.kv_bytes_per_token
    written = (20 + 5 - 2) * COST.kv_bytes_per_token + (20 + 5 - 2) * COST.embedding_row_bytes
    assert cached == workload_bound([20, 5], [3, 1], 4, COST, memory_bound) + read_prompts - written


def test_measure_rates_runs_on_the_cpu() -> None:
    rates = measure_rates(torch.device("cpu"), torch.float32)
    assert rates.bytes_per_s > 1e8 and rates.flops_per_s > 1e8
