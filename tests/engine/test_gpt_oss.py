"""gpt-oss (engine/models/gpt_oss.py) beyond its parity tests in test_model_families.py
(TP=1, the torch and Triton backends) and test_tensor_parallel.py (TP=2):

- YaRN's RoPE frequencies and attention factor equal transformers' rope init;
- routing (top-4 logits, then their softmax) equals transformers' router;
- MXFP4 blocks and scales dequantize to transformers' values;
- a sharded MXFP4 checkpoint, as published, loads and generates as transformers does with
  the same dequantized weights;
- a rank reads only its slice of MXFP4 experts, its features' blocks (which need not start
  at a block's edge) and no others.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton.moe_route import moe_route
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.checkpoint.mxfp4 import dequantize_mxfp4
from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.llm_engine import LLMEngine
from engine.models import load_checkpoint
from engine.models.gpt_oss import GptOssExperts
from engine.models.yarn import yarn_attention_factor, yarn_inverse_frequencies
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_model_parity import engine_prefill_logits, hf_prefill_logits
from tests.engine.test_moe import Slices


@pytest.mark.parametrize(
    "rope",
    [
        # gpt-oss's own
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
        # the band's ends rounded; an explicit attention factor
        dict(factor=4.0, truncate=True, attention_factor=1.3),
        # DeepSeek's mscale pair
        dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707),
    ],
)
def test_yarn_equals_transformers_rope_init(rope: dict[str, float]) -> None:
    parameters = {"rope_type": "yarn", "rope_theta": 150_000.0} | rope
    parameters["original_max_position_embeddings"] = 4096
    config = GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=parameters)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    fields = hf_config_fields(config.to_dict() | {"architectures": ["x"]}, Path("yarn"))
    yarn = fields["rope_yarn"]
    assert fields["rope_theta"] == 150_000.0
    torch.testing.assert_close(
        yarn_inverse_frequencies(64, 150_000.0, yarn), inv_freq, rtol=0, atol=0
    )
    assert yarn_attention_factor(yarn) == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("route", [TorchLayerOps().moe_route, moe_route], ids=["torch", "triton"])
def test_routing_equals_transformers(
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Top 4 of 8 logits, then a softmax over those four: the softmax renormalized over the
    top 4, as the other families route (the torch reference and the Triton kernel)."""
    config = GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=4)
    router = GptOssTopKRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = torch.randn(6, 16)
    _, scores, indices = router(x)
    logits = torch.nn.functional.linear(x, router.weight, router.bias)
    if route is moe_route and torch.cuda.is_available():  # else Triton's interpreter
        logits = logits.cuda()
    weights, ids = (t.cpu() for t in route(logits, 4, True))
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), indices)
    torch.testing.assert_close(weights, scores)


def random_mxfp4(
    generator: torch.Generator, *shape: int, columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 4-bit codes packed two a byte (the even value in the low nibble) as
    ``*_blocks`` [*shape, columns / 32, 16], and scales (2 ** -6 to 2 ** -3) as ``*_scales``
    [*shape, columns / 32]."""
    codes = torch.randint(0, 16, (*shape, columns // 32, 32), generator=generator)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    scales = torch.randint(121, 125, (*shape, columns // 32), generator=generator)
    return blocks, scales.to(torch.uint8)


def test_mxfp4_dequantizes_to_transformers_values() -> None:
    blocks, scales = random_mxfp4(torch.Generator().manual_seed(0), 3, 10, columns=96)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 255  # e8m0's extremes: 2 ** -127 and 2 ** 128
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    # transformers' returns [E, columns, rows], its experts' layout; ours is as stored.
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)
    bf16 = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16), bf16)


def write_mxfp4_checkpoint(directory: Path) -> torch.nn.Module:
    """The tiny gpt-oss checkpoint with its experts replaced by random MXFP4 ones, stored as
    published: ``*_blocks`` and ``*_scales``, quantization_config mxfp4, in two shards; the
    transformers model returned holds the same experts dequantized."""
    model = saved_tiny_model("gpt-oss", directory)
    generator = torch.Generator().manual_seed(1)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    config = model.config
    experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    for layer, decoder in enumerate(model.model.layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for name, rows, columns in (
            ("gate_up_proj", 2 * inter, hidden),
            ("down_proj", hidden, inter),
        ):
            blocks, scales = random_mxfp4(generator, experts, rows, columns=columns)
            del tensors[f"{prefix}.{name}"]
            tensors[f"{prefix}.{name}_blocks"], tensors[f"{prefix}.{name}_scales"] = blocks, scales
            dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            getattr(decoder.mlp.experts, name).data.copy_(dequantized)
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, directory / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config_file = directory / "config.json"
    saved = json.loads(config_file.read_text())
    saved["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    config_file.write_text(json.dumps(saved))
    return model


def test_a_sharded_mxfp4_checkpoint_generates_as_transformers(tmp_path: Path) -> None:
    hf_model = write_mxfp4_checkpoint(tmp_path)
    prompts = random_prompts(4, seed=2)
    torch.testing.assert_close(
        engine_prefill_logits(tmp_path, prompts),
        hf_prefill_logits(hf_model, prompts),
        rtol=1e-4,
        atol=1e-4,
    )
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = random_prompts(2)
    assert run_engine(engine, prompts, max_tokens=6) == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_a_rank_reads_its_slice_of_mxfp4_experts(tmp_path: Path) -> None:
    """Rank 1 of 2 with 96 intermediate features: its 48 start mid-block (block 1 of the
    down projection's three holds both ranks' features). Its experts equal its slice of the
    experts loaded whole, from MXFP4 as from the dequantized tensors."""
    saved_tiny_model("gpt-oss", tmp_path, intermediate_size=96)
    config = load_checkpoint(str(tmp_path)).config
    generator = torch.Generator().manual_seed(2)
    experts, hidden, inter = config.num_experts, config.hidden_size, 96
    gate_up = random_mxfp4(generator, experts, 2 * inter, columns=hidden)
    down = random_mxfp4(generator, experts, hidden, columns=inter)

    def loaded(rank: int, size: int, packed: bool) -> GptOssExperts:
        module = GptOssExperts(config, TorchLayerOps(), TensorParallel(rank=rank, size=size))
        filled: set[str] = set()
        for name, (blocks, scales) in (("gate_up_proj", gate_up), ("down_proj", down)):
            if packed:
                for part, tensor in (("_blocks", blocks), ("_scales", scales)):
                    filled.update(module.load_tensor(name + part, Slices(tensor), name + part))
            else:  # transformers' layout: [E, in, out]
                tensor = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                filled.update(module.load_tensor(name, Slices(tensor), name))
        for name, shape in (
            ("gate_up_proj_bias", (experts, 2 * inter)),
            ("down_proj_bias", (experts, hidden)),
        ):
            filled.update(module.load_tensor(name, Slices(torch.zeros(shape)), name))
        assert module.missing(filled) == []
        return module

    whole, rank1 = loaded(0, 1, packed=False), loaded(1, 2, packed=True)
    assert torch.equal(loaded(1, 2, packed=False).w13, rank1.w13)
    assert torch.equal(loaded(1, 2, packed=False).w2, rank1.w2)
    half = slice(inter // 2, inter)
    gate, up = whole.w13[:, :inter], whole.w13[:, inter:]
    assert torch.equal(rank1.w13, torch.cat([gate[:, half], up[:, half]], dim=1))
    assert torch.equal(rank1.w2, whole.w2[:, :, half])
