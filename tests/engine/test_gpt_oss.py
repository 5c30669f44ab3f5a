"""gpt-oss (engine/models/gpt_oss.py) beyond its parity tests in test_model_families.py
(TP=1, the torch and Triton backends) and test_tensor_parallel.py (TP=2):

- YaRN's RoPE frequencies and attention factor equal transformers' rope init;
- routing (top-4 logits, then their softmax) equals transformers' router;
- MXFP4 blocks and scales dequantize to transformers' values;
- a sharded MXFP4 checkpoint, as published, loads and generates as transformers does with
  the same dequantized weights;
- a rank reads only its slice of MXFP4 experts, its features' blocks (which need not start
  at a block's edge) and no others;
- under ``--quantization mxfp4`` the experts stay MXFP4 (uint8) and the Triton backend's
  MXFP4 kernels (in the interpreter off CUDA) generate as transformers does, at TP=1 and
  TP=2; the roofline counts them at half a byte a value and a byte a scale; and the option
  is refused, in one line, for another family, experts not in MXFP4, a GGUF file, and a
  tensor-parallel split that cuts a block.
"""

from __future__ import annotations

import dataclasses
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

from engine.backends import create_backend
from engine.backends.mxfp4 import dequantize_mxfp4
from engine.backends.pytorch import TorchLayerOps
from engine.backends.triton.moe_route import moe_route
from engine.checkpoint.hf_checkpoint import hf_config_fields
from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.execution.model_runner import quantized_config
from engine.llm_engine import LLMEngine
from engine.models import build_model, load_checkpoint
from engine.models.gpt_oss import GptOssExperts, check_mxfp4_experts
from engine.models.yarn import yarn_attention_factor, yarn_inverse_frequencies
from engine.roofline import ModelCost
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_model_families import saved_tiny_model
from tests.engine.test_model_parity import engine_prefill_logits, hf_prefill_logits
from tests.engine.test_moe import Slices
from tests.engine.test_tensor_parallel import prefill_logits


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


def mxfp4_engine(directory: Path, tensor_parallel_size: int = 1) -> LLMEngine:
    """The engine on the Triton backend with --quantization mxfp4."""
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cpu",
            backend="triton",
            quantization="mxfp4",
            block_size=4,
            kv_cache_memory_gb=0.01,
            tensor_parallel_size=tensor_parallel_size,
        )
    )


def assert_generates_as_transformers(engine: LLMEngine, hf_model: torch.nn.Module) -> None:
    """Packed prefill's last-token logits within the dequantizing path's tolerance of
    transformers', and greedy generations token for token."""
    prompts = random_prompts(4, seed=2)
    last_tokens = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    torch.testing.assert_close(
        prefill_logits(engine, prompts),
        hf_prefill_logits(hf_model, prompts)[last_tokens],
        rtol=1e-4,
        atol=1e-4,
    )
    prompts = random_prompts(2)
    assert run_engine(engine, prompts, max_tokens=6) == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_mxfp4_experts_stay_packed_and_generate_as_transformers(tmp_path: Path) -> None:
    hf_model = write_mxfp4_checkpoint(tmp_path)
    engine = mxfp4_engine(tmp_path)
    experts = [m for m in engine.runner.model.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == hf_model.config.num_hidden_layers
    for module in experts:  # as published: not dequantized on load
        tensors = (module.w13, module.w2, module.w13_scale, module.w2_scale)
        assert all(tensor.dtype == torch.uint8 for tensor in tensors)
        assert module.w13.shape == (8, 2 * 64, 64 // 2) and module.w2_scale.shape == (8, 64, 2)
    assert_generates_as_transformers(engine, hf_model)


def test_mxfp4_experts_at_two_ranks_generate_as_transformers(tmp_path: Path) -> None:
    """Each rank's 32 of the 64 intermediate features: one block of the down projection."""
    hf_model = write_mxfp4_checkpoint(tmp_path)
    engine = mxfp4_engine(tmp_path, tensor_parallel_size=2)
    try:
        assert_generates_as_transformers(engine, hf_model)
    finally:
        engine.close()


def test_random_mxfp4_experts_load_format_dummy(tmp_path: Path) -> None:
    """--load-format dummy: random codes, every scale 2 ** -7 (0.02 over the codes' root mean
    square, 2.9, to the nearest power of two), and the engine generates."""
    write_mxfp4_checkpoint(tmp_path)
    config = EngineConfig(
        model=str(tmp_path),
        device="cpu",
        backend="triton",
        quantization="mxfp4",
        load_format="dummy",
        block_size=4,
        kv_cache_memory_gb=0.01,
    )
    engine = LLMEngine(config)
    for module in engine.runner.model.modules():
        if isinstance(module, GptOssExperts):
            assert (module.w13_scale == 127 - 7).all() and (module.w2_scale == 127 - 7).all()
            assert module.w13.unique().numel() > 200
    assert len(run_engine(engine, random_prompts(1), max_tokens=3)[0]) == 3


def test_the_roofline_counts_mxfp4_experts_at_half_a_byte_a_value(tmp_path: Path) -> None:
    write_mxfp4_checkpoint(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path))
    meta = torch.device("meta")

    def cost(quantization: str | None) -> ModelCost:
        config = EngineConfig(model=str(tmp_path), device="cpu", quantization=quantization)
        model_config = quantized_config(config, checkpoint, meta)
        model = build_model(model_config, create_backend("torch", meta), 16, meta, torch.bfloat16)
        return ModelCost.of_model(model, torch.bfloat16)

    bf16, mxfp4 = cost(None), cost("mxfp4")
    values = 3 * 8 * 3 * 64 * 64  # layers, experts, gate + up + down, hidden x intermediate
    assert bf16.expert_matmul_params == mxfp4.expert_matmul_params == values
    assert bf16.expert_weight_bytes == 2 * values
    assert mxfp4.expert_weight_bytes == values // 2 + values // 32


def test_mxfp4_is_refused_where_the_experts_cannot_stay_mxfp4(tmp_path: Path) -> None:
    """Another family, gpt-oss with bf16 experts, a GGUF file, and a split that cuts a block
    (64 features over 4 ranks, before any worker starts; gpt-oss-20b's 90 blocks over 4 but
    not over 2): each refused in one line saying what to do instead."""
    saved_tiny_model("mixtral", tmp_path / "mixtral")
    with pytest.raises(ValueError, match="MixtralForCausalLM is not gpt-oss") as refused:
        mxfp4_engine(tmp_path / "mixtral")
    assert "\n" not in str(refused.value)
    saved_tiny_model("gpt-oss", tmp_path / "bf16")
    with pytest.raises(ValueError, match=r"experts are not MXFP4.*leave --quantization out"):
        mxfp4_engine(tmp_path / "bf16")
    write_mxfp4_checkpoint(tmp_path / "mxfp4")
    with pytest.raises(ValueError, match=r"over 4 ranks.*not whole blocks"):
        mxfp4_engine(tmp_path / "mxfp4", tensor_parallel_size=4)
    checkpoint = load_checkpoint(str(tmp_path / "mxfp4"))
    with pytest.raises(ValueError, match="not from a GGUF file"):
        check_mxfp4_experts("mxfp4", dataclasses.replace(checkpoint, gguf=True), 1)
    config = dataclasses.replace(checkpoint.config, moe_intermediate_size=2880)
    gpt_oss_20b = dataclasses.replace(checkpoint, config=config)
    check_mxfp4_experts("mxfp4", gpt_oss_20b, 2)
    with pytest.raises(ValueError, match="over 4 ranks"):
        check_mxfp4_experts("mxfp4", gpt_oss_20b, 4)
    check_mxfp4_experts(None, dataclasses.replace(checkpoint, gguf=True), 4)  # not asked
