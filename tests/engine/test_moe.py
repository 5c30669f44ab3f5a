"""Mixtures of experts (engine/models/moe.py) beyond the families' parity tests, which run
Qwen3-MoE and Mixtral against transformers in test_model_families.py (TP=1) and
test_tensor_parallel.py (TP=2):

- routing (the torch reference and the Triton kernel) equals transformers' routers, ties
  included;
- the torch reference of ``moe_experts`` equals a token-by-token sum, reads no expert that
  no token picked, splits over ``expert_offset`` into parts that add up, and multiplies FP8
  experts as their dequantized weights;
- a rank reads its own slice of each expert, stored one expert a tensor or stacked;
- ``--quantization fp8`` and ``--load-format dummy`` quantize the experts;
- GGUF files as llama.cpp writes them (``qwen3moe``; ``llama`` with experts for Mixtral)
  give the model's config, its weights and its greedy tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import MixtralConfig, PreTrainedModel, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton.moe_route import moe_route
from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.llm_engine import LLMEngine
from engine.models import load_checkpoint
from engine.models.moe import FusedExperts, MoEConfig
from engine.quantization.linear_methods import FP8, quantize_per_channel
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import hf_greedy, run_engine, stepwise_agreement
from tests.engine.test_checkpoint import llama_cpp_permute, rope_theta
from tests.engine.test_gguf_families import (
    hf_directory_config,
    qwen_vocabulary,
    sentencepiece_vocabulary,
    value_types,
)
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_quantization import AGREEMENT, cpu_engine

OPS = TorchLayerOps()


@pytest.mark.parametrize(
    ("router_class", "config"),
    [
        (Qwen3MoeTopKRouter, Qwen3MoeConfig(num_experts=8, num_experts_per_tok=3)),
        (
            Qwen3MoeTopKRouter,
            Qwen3MoeConfig(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        ),
        (MixtralTopKRouter, MixtralConfig(num_local_experts=8, num_experts_per_tok=2)),
    ],
)
@pytest.mark.parametrize("route", [OPS.moe_route, moe_route], ids=["torch", "triton"])
def test_routing_equals_transformers_ties_included(
    router_class: type, config: Any, route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> None:
    config.hidden_size = 16
    router = router_class(config)
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    x[0] = 0  # every expert ties for this token
    weight = torch.randn(8, 16)
    weight[5] = weight[7] = weight[2]  # three experts tie for every token
    with torch.no_grad():
        router.weight.copy_(weight)
        _, scores, indices = router(x)
    renormalize = getattr(config, "norm_topk_prob", True)  # Mixtral's always
    logits = F.linear(x, weight)
    if route is moe_route and torch.cuda.is_available():  # else Triton's interpreter
        logits = logits.cuda()
    weights, ids = route(logits, config.num_experts_per_tok, renormalize)
    weights, ids = weights.cpu(), ids.cpu()
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    if route is moe_route:  # ties to the lowest ids; torch.topk's order on the CPU differs
        k = config.num_experts_per_tok
        assert ids[0].tolist() == list(range(k))
        ids, indices, weights, scores = ids[1:], indices[1:], weights[1:], scores[1:]
    assert torch.equal(ids.long(), indices)
    torch.testing.assert_close(weights, scores.float())
    assert all(len(set(row)) == config.num_experts_per_tok for row in ids.tolist())


def token_by_token(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Each token's sum over its experts, one token and one expert at a time."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), ids[token].tolist(), strict=True):
            gate, up = (w13[expert] @ x[token]).chunk(2)
            out[token] += weight * (w2[expert] @ (F.silu(gate) * up))
    return out


def random_routing(
    tokens: int, experts: int, top_k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` distinct experts among the first ``experts``, and weights."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=generator), ids.to(torch.int32)


def test_reference_experts_equal_a_token_by_token_sum() -> None:
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 9, 16, 8, 6, 2
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    weights, ids = random_routing(tokens, 4, top_k)  # experts 4 and 5: no token picks them
    expected = token_by_token(x, weights, ids, w13, w2)
    out = OPS.moe_experts(x, weights, ids, w13, w2, None, None)
    torch.testing.assert_close(out, expected)
    # The experts no token picked are not read: NaN there changes nothing.
    w13[4:], w2[4:] = float("nan"), float("nan")
    torch.testing.assert_close(OPS.moe_experts(x, weights, ids, w13, w2, None, None), expected)
    # Experts split over two holders (expert_offset): each adds its own, the sum is the whole.
    first = OPS.moe_experts(x, weights, ids, w13[:3], w2[:3], None, None, 0)
    second = OPS.moe_experts(x, weights, ids, w13[3:], w2[3:], None, None, 3)
    assert not torch.allclose(first, expected) and not torch.allclose(second, expected)
    torch.testing.assert_close(first + second, expected)


def test_reference_experts_multiply_fp8_experts_as_their_dequantized_weights() -> None:
    torch.manual_seed(1)
    tokens, hidden, inter, experts = 5, 32, 16, 4
    x = torch.randn(tokens, hidden)
    weights, ids = random_routing(tokens, experts, 2)
    w13_codes, w13_scale = quantize_per_channel(torch.randn(experts * 2 * inter, hidden), FP8)
    w2_codes, w2_scale = quantize_per_channel(torch.randn(experts * hidden, inter), FP8)
    w13 = (w13_codes.float() * w13_scale[:, None]).view(experts, 2 * inter, hidden)
    w2 = (w2_codes.float() * w2_scale[:, None]).view(experts, hidden, inter)
    out = OPS.moe_experts(
        x,
        weights,
        ids,
        w13_codes.view(experts, 2 * inter, hidden),
        w2_codes.view(experts, hidden, inter),
        w13_scale.view(experts, 2 * inter),
        w2_scale.view(experts, hidden),
    )
    # The scales multiply the products, not the weights: float32's rounding apart.
    expected = token_by_token(x, weights, ids, w13, w2)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


class Slices:
    """A checkpoint tensor in memory, read as a file's (``TensorSlices``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        return self.tensor if length is None else self.tensor.narrow(dim, start, length)


@pytest.mark.parametrize("stacked", [False, True])
def test_a_rank_holds_its_slice_of_every_expert(stacked: bool) -> None:
    """Rank 1 of 2: the second half of each expert's gate and up rows, of its down columns;
    the same from one tensor an expert (safetensors) as from every expert's stacked (GGUF)."""
    hidden, inter, experts = 8, 6, 3
    config = MoEConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=inter,
        norm_topk_prob=True,
    )
    module = FusedExperts(config, OPS, TensorParallel(rank=1, size=2))
    gate, up = torch.randn(experts, inter, hidden), torch.randn(experts, inter, hidden)
    down = torch.randn(experts, hidden, inter)
    filled: set[str] = set()
    for name, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        if stacked:
            filled.update(module.load_tensor(f"{name}.weight", Slices(tensor), name))
        else:
            for expert in range(experts):
                key = f"{expert}.{name}.weight"
                filled.update(module.load_tensor(key, Slices(tensor[expert]), key))
        if name == "gate_proj":
            assert module.missing(filled)  # up and down to come
    assert module.missing(filled) == []
    half = slice(inter // 2, inter)
    assert torch.equal(module.w13, torch.cat([gate[:, half], up[:, half]], dim=1))
    assert torch.equal(module.w2, down[:, :, half])
    with pytest.raises(ValueError, match="checkpoint shape"):
        module.load_tensor("0.gate_proj.weight", Slices(gate[0, :, :4]), "bad")


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    directory = tmp_path_factory.mktemp("qwen3-moe")
    return directory, saved_tiny_model("qwen3-moe-dense-middle", directory)


def test_fp8_experts_generate_mostly_transformers_tokens(
    tiny_qwen3_moe: tuple[Path, PreTrainedModel],
) -> None:
    directory, hf_model = tiny_qwen3_moe
    engine = cpu_engine(directory, "fp8")
    experts = engine.runner.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == FP8
    hf_experts = hf_model.model.layers[0].mlp.experts
    codes, scale = quantize_per_channel(hf_experts.down_proj[2], FP8)  # [H, I] of expert 2
    assert torch.equal(experts.w2[2].float(), codes.float())
    assert torch.equal(experts.w2_scale[2], scale)
    prompts = random_prompts(4)
    agreement = stepwise_agreement(hf_model, prompts, run_engine(engine, prompts, max_tokens=12))
    print(f"\nqwen3-moe fp8: {agreement:.2f} of greedy tokens are transformers' choice")
    assert agreement >= AGREEMENT["fp8"]


def test_dummy_weights_quantize_the_experts_too(
    tiny_qwen3_moe: tuple[Path, PreTrainedModel],
) -> None:
    directory, _ = tiny_qwen3_moe
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        kv_cache_memory_gb=0.001,
        quantization="fp8",
        load_format="dummy",
    )
    engine = LLMEngine(config)
    experts = engine.runner.model.layers[2].mlp.experts
    assert experts.w13.dtype == FP8 and (experts.w13_scale > 0).all()
    assert (experts.w2_scale > 0).all()
    assert len(run_engine(engine, random_prompts(2), 4)[0]) == 4


def test_int8_experts_are_refused(tiny_qwen3_moe: tuple[Path, PreTrainedModel]) -> None:
    directory, _ = tiny_qwen3_moe
    with pytest.raises(ValueError, match="int8 and pre-quantized experts are not supported"):
        cpu_engine(directory, "int8")


# --- GGUF, as llama.cpp's converter writes a mixture of experts --------------------------------

# Each GGUF architecture: the tiny family of test_model_families.py it is written from, its
# tokenizer, and the settings llama.cpp's file needs (qwen3moe renormalizes always; a GGUF
# vocabulary of its own size).
GGUF_CASES = {
    "qwen3moe": ("qwen3-moe-dense-middle", qwen_vocabulary, dict(mlp_only_layers=[])),
    "llama": ("mixtral", lambda: sentencepiece_vocabulary(gemma=False), {}),
}
_EXPERT = re.compile(r"(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight")


def write_moe_gguf(path: Path, directory: Path, model: PreTrainedModel, arch: str) -> Path:
    """The checkpoint in ``directory`` as llama.cpp's converter writes it: each projection's
    experts stacked into one tensor, Llama's Q and K permuted, float32."""
    config = model.config
    vocabulary = GGUF_CASES[arch][1]()
    metadata = {
        "general.name": f"tiny-{arch}-moe",
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": config.head_dim,
        f"{arch}.attention.value_length": config.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.rope.freq_base": rope_theta(config),
        f"{arch}.expert_count": config.num_local_experts,
        f"{arch}.expert_used_count": config.num_experts_per_tok,
        **vocabulary,
    }
    if arch == "qwen3moe":
        metadata[f"{arch}.expert_feed_forward_length"] = config.moe_intermediate_size
    writer = gguf.GGUFWriter(path, arch, use_temp_file=False)
    for key, value in metadata.items():
        writer.add_key_value(key, value, *value_types(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in load_file(directory / "model.safetensors").items():
        array = tensor.numpy()
        if match := _EXPERT.fullmatch(hf_name):
            module = f"{match['module']}.{match['projection']}"
            experts.setdefault(module, {})[int(match["expert"])] = array
            continue
        module, kind = hf_name.rsplit(".", 1)
        name = f"{names.get_name(module)}.{kind}"
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(name, array)
    for module, arrays in experts.items():
        stacked = np.stack([arrays[expert] for expert in sorted(arrays)])
        writer.add_tensor(f"{names.get_name(module)}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_round_trip(arch: str, tmp_path: Path) -> None:
    """The file gives the model's config (equal to its Hugging Face directory's), its
    weights bit for bit (each projection's experts stacked), and its greedy tokens."""
    family, vocabulary, changes = GGUF_CASES[arch]
    vocab_size = len(vocabulary()["tokenizer.ggml.tokens"])
    directory = tmp_path / "hf"
    model = saved_tiny_model(family, directory, vocab_size=vocab_size, **changes)
    path = write_moe_gguf(tmp_path / f"{arch}.gguf", directory, model, arch)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.config.architecture == type(model).__name__
    assert checkpoint.config == hf_directory_config(model, tmp_path)
    expected: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if match := _EXPERT.fullmatch(name):
            stacked = f"{match['module']}.{match['projection']}.weight"
            experts.setdefault(stacked, {})[int(match["expert"])] = tensor
        else:
            expected[name] = tensor
    expected |= {name: torch.stack([e[i] for i in sorted(e)]) for name, e in experts.items()}
    weights = dict(checkpoint.weights())
    assert sorted(weights) == sorted(expected)
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
    engine = LLMEngine(
        EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = [[5, 60, 7], list(range(100, 140))]
    assert run_engine(engine, prompts, max_tokens=12) == [hf_greedy(model, p, 12) for p in prompts]
