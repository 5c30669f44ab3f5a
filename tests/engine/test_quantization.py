"""--quantization fp8 / int8 and pre-quantized FP8 checkpoints
   (engine/quantization/linear_methods.py).

- A quantized linear layer is within the error its format's rounding allows of the float
  product, bound element by element (not a flat tolerance): int8 codes are off by at most half
  a step of their row's scale, float8 e4m3 ones by 2^-4 of their value (3 mantissa bits,
  rounded to nearest) or half a subnormal step; for W8A8 the activations' error adds in. The
  Triton kernel is held to the same bound (in Triton's interpreter on the CPU).
- An engine so quantized generates, step by step, mostly transformers' greedy choice after the
  same tokens, for several tiny families (a wrong scale or a weight read wrong would not).
- A pre-quantized FP8 safetensors checkpoint, made here as vLLM's format has it, loads its codes
  and scales as stored and generates as the same model quantized at load.
- Bad values are refused with messages that say what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from engine.backends import create_backend
from engine.backends.pytorch import TorchLayerOps, quantize_per_token_fp8
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import Quantization
from engine.quantization.linear_methods import (
    FP8,
    Fp8Linear,
    Int8Linear,
    QuantizedLinear,
    quantize_per_channel,
    require_fp8,
    resolve_quantization,
)
from tandem.testing.random_checkpoint import random_prompts
from tandem.testing.reference import run_engine, stepwise_agreement
from tests.engine.test_model_families import saved_tiny_model

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
FP8_RELATIVE = 2.0**-4  # half a unit in the last place of 3 mantissa bits
FP8_SUBNORMAL = 2.0**-10  # half the subnormal step, 2^-9, in units of the scale
CPU = torch.device("cpu")


def weight_error_bound(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest error quantizing ``weight`` [N, K] per channel to ``dtype`` may make,
    element by element."""
    amax = weight.abs().amax(dim=1, keepdim=True)
    if dtype == torch.int8:
        return (amax / 127 / 2).expand_as(weight)
    return FP8_RELATIVE * weight.abs() + FP8_SUBNORMAL * amax / 448


def product_bound(
    x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, w8a8: bool
) -> torch.Tensor:
    """|quantized product - x @ weight.T| at most, element by element, plus DTYPE's rounding
    of the result and float32's of the sum."""
    weight_error = weight_error_bound(weight, dtype)
    bound = x.abs() @ weight_error.T
    if w8a8:
        x_error = weight_error_bound(x, FP8)  # per token, as per channel
        bound += x_error @ (weight.abs() + weight_error).T
    magnitude = x.abs() @ weight.abs().T
    rounding = 4 * torch.finfo(DTYPE).eps + 64 * torch.finfo(torch.float32).eps
    return bound + rounding * magnitude


class Layer(torch.nn.Module):
    """A bare layer for a method to hold its weights on."""


@pytest.mark.parametrize("tokens", [3, 37])  # the weight-only and (FP8) the W8A8 paths
@pytest.mark.parametrize("method_class", [Int8Linear, Fp8Linear], ids=["int8", "fp8"])
def test_quantized_linear_is_within_its_formats_rounding(
    method_class: type[QuantizedLinear], tokens: int
) -> None:
    # With the device's default backend's ops: the Triton kernels on CUDA, PyTorch's on CPU.
    method = method_class(create_backend(None, DEVICE).ops)
    torch.manual_seed(0)
    x = torch.randn(tokens, 96, device=DEVICE)
    weight = torch.randn(48, 96, device=DEVICE) * torch.rand(
        48, 1, device=DEVICE
    )  # rows' ranges differ
    weight[0, :5] = 1e-4  # a subnormal or two in FP8
    layer = Layer()
    method.create_weights(layer, 48, 96)
    layer.to_empty(device=DEVICE)
    method.load_weight(layer, slice(None), weight)
    bias = torch.randn(48, device=DEVICE)
    out = method.apply(layer, x.to(DTYPE), bias.to(DTYPE)).float() - bias
    reference = x @ weight.T
    w8a8 = isinstance(method, Fp8Linear) and tokens > 16
    bound = product_bound(x, weight, method.dtype, w8a8)
    error = (out - reference).abs()
    assert (error <= bound).all(), f"worst error/bound {(error / bound).max():.3f}"
    assert error.max() > 0  # the weights were quantized


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 21])
def test_triton_weight_only_kernel_is_within_its_formats_rounding(
    dtype: torch.dtype, tokens: int
) -> None:
    from engine.backends.triton.quantized_matmul import weight_only_matmul as triton_matmul

    torch.manual_seed(1)
    # Sizes off the kernel's tiles, so that every mask counts.
    x = torch.randn(tokens, 72, device=DEVICE)
    weight = torch.randn(40, 72, device=DEVICE)
    codes, scale = quantize_per_channel(weight, dtype)
    out = triton_matmul(x.to(DTYPE), codes, scale).float()
    error = (out - x @ weight.T).abs()
    assert (error <= product_bound(x, weight, dtype, w8a8=False)).all()
    # And against the dequantized weight itself, far tighter than the format's bound.
    exact = x.to(DTYPE).float() @ (codes.float() * scale[:, None]).T
    torch.testing.assert_close(out, exact, rtol=4 * torch.finfo(DTYPE).eps, atol=1e-4)


@pytest.mark.parametrize("product", ["rowwise", "scaled_after"])
def test_triton_fp8_products_are_within_their_formats_rounding(product: str) -> None:
    """Both W8A8 products the Triton backend chooses between (``fp8_matmul.py``; the scaling
    kernel in Triton's interpreter on the CPU), as the layer's bound holds them, and against
    the dequantized operands' product within bf16's rounding."""
    from engine.backends.triton import fp8_matmul

    torch.manual_seed(2)
    x = torch.randn(37, 96, device=DEVICE)
    weight = torch.randn(48, 96, device=DEVICE) * torch.rand(48, 1, device=DEVICE)
    codes, scale = quantize_per_channel(weight, FP8)
    x_codes, x_scale = quantize_per_token_fp8(x.to(DTYPE))
    multiply = getattr(fp8_matmul, f"{product}_product")
    out = multiply(x_codes, x_scale, codes, scale, DTYPE)
    assert out.dtype == DTYPE and out.shape == (37, 48)
    out = out.float()
    error = (out - x @ weight.T).abs()
    assert (error <= product_bound(x, weight, FP8, w8a8=True)).all()
    exact = (x_codes.float() * x_scale) @ (codes.float() * scale[:, None]).T
    torch.testing.assert_close(out, exact, rtol=4 * torch.finfo(DTYPE).eps, atol=1e-4)


def test_per_token_activation_codes_reconstruct_within_fp8s_rounding() -> None:
    x = torch.randn(5, 64) * torch.tensor([1.0, 1e-3, 10.0, 0.0, 1.0])[:, None]
    codes, scale = quantize_per_token_fp8(x)
    assert codes.dtype == FP8 and scale.shape == (5, 1)
    error = (codes.float() * scale - x).abs()
    assert (error <= weight_error_bound(x, FP8) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("width", [1500, 16500], ids=["one-pass", "chunked"])
def test_activation_kernel_quantizes_as_pytorch_bit_for_bit(
    dtype: torch.dtype, gated: bool, width: int
) -> None:
    """The one-kernel quantization of the W8A8 path makes PyTorch's codes and scales exactly,
    over rows of many magnitudes (an all-zero one, subnormal codes), held in registers whole or
    (wider than 16,384) read twice in chunks, neither a multiple of its chunk; gated, of
    silu(gate) * up as the activation's kernel rounds it."""
    from engine.backends.triton.activation import silu_and_mul
    from engine.backends.triton.fp8_quantize import quantize_rows_fp8

    torch.manual_seed(2)
    magnitudes = torch.tensor([1.0, 1e-3, 10.0, 0.0, 300.0, 1.0], device=DEVICE)[:, None]
    x = (torch.randn(6, 2 * width if gated else width, device=DEVICE) * magnitudes).to(dtype)
    x[5, :40] = 1e-4  # subnormal codes beside the row's largest value
    x[2, width - 1] = x[2, -1] = 50.0  # a row's largest in its last chunk (gated: gate and up)
    codes, scale = quantize_rows_fp8(x, gated=gated)
    expected_codes, expected_scale = quantize_per_token_fp8(silu_and_mul(x) if gated else x)
    assert codes.dtype == FP8 and scale.shape == (6, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert (codes.float() != 0).any(dim=1).tolist() == [True, True, True, False, True, True]


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_activation_kernel_computes_a_deferred_norm_bit_for_bit(with_residual: bool) -> None:
    """An FP8 layer's rows whose norm was left to it (DeferredNorm): the quantization kernel's
    codes and scales are those of the norm's kernel's output quantized, bit for bit, and it
    writes the same residual stream."""
    from engine.backends.deferred_norm import DeferredNorm
    from engine.backends.triton.backend import TritonLayerOps
    from engine.backends.triton.fp8_quantize import quantize_rows_fp8
    from engine.backends.triton.norm import add_rms_norm

    torch.manual_seed(3)
    rows, hidden = 20, 1000  # not a power of two: the row's mask counts
    # The model's dtype on CUDA; Triton's interpreter computes in bfloat16 wrongly.
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    x[4] *= 300.0
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    normalized, stream = add_rms_norm(x, residual, weight, 1e-5)
    expected_codes, expected_scale = quantize_rows_fp8(normalized)
    deferred = DeferredNorm(x, residual, weight, 1e-5, TritonLayerOps())
    codes, scale = quantize_rows_fp8(deferred)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert torch.equal(deferred.stream, stream)


def cpu_engine(directory: Path, quantization: str | None) -> LLMEngine:
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        block_size=4,
        kv_cache_memory_gb=0.001,
        quantization=quantization,
    )
    return LLMEngine(config)


# The least share of transformers' greedy choices each format keeps on these tiny models,
# whose random weights (initializer range 0.2) make them touchier than trained ones: set
# below the shares the test prints for the four families (run it with -s), fp8's coarser
# codes lower than int8's.
AGREEMENT = {"int8": 0.8, "fp8": 0.6}


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize(
    "family", ["llama-llama3-rope-untied", "qwen2-biases-tied", "qwen3-wide-heads", "gemma3-tied"]
)
def test_quantized_engine_generates_mostly_transformers_tokens(
    family: str, quantization: str, tmp_path: Path
) -> None:
    hf_model = saved_tiny_model(family, tmp_path)
    engine = cpu_engine(tmp_path, quantization)
    projection = engine.runner.model.layers[0].self_attn.qkv_proj
    assert projection.weight.dtype == {"int8": torch.int8, "fp8": FP8}[quantization]
    prompts = random_prompts(8)
    agreement = stepwise_agreement(hf_model, prompts, run_engine(engine, prompts, max_tokens=16))
    print(f"\n{family} {quantization}: {agreement:.2f} of greedy tokens are transformers' choice")
    assert agreement >= AGREEMENT[quantization]


def save_prequantized_fp8(source: Path, target: Path, per_tensor: tuple[str, ...]) -> None:
    """``source``'s float checkpoint as vLLM's pre-quantized FP8 format: each linear layer's
    ``weight`` float8 e4m3 with its ``weight_scale`` (per channel [N, 1], or one value for the
    projections named in ``per_tensor``), a static ``input_scale`` (which is not read), and
    ``quantization_config`` in config.json."""
    target.mkdir()
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        projection = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if not projection.endswith("_proj"):
            tensors[name] = tensor
            continue
        stem = name.removesuffix(".weight")
        if projection in per_tensor:
            scale = tensor.abs().max().float() / 448
            codes = (tensor.float() / scale).to(FP8)
        else:
            codes, channel_scales = quantize_per_channel(tensor, FP8)
            scale = channel_scales[:, None]
        tensors[name] = codes
        tensors[f"{stem}.weight_scale"] = scale
        tensors[f"{stem}.input_scale"] = torch.tensor(1.0)
    save_file(tensors, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (target / "config.json").write_text(json.dumps(config))
    for other in source.iterdir():
        if other.name not in ("model.safetensors", "config.json"):
            (target / other.name).write_bytes(other.read_bytes())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    directory = tmp_path_factory.mktemp("tiny")
    return directory, saved_tiny_model("llama-llama3-rope-untied", directory)


def test_prequantized_fp8_checkpoint_generates_as_load_time_fp8(
    tiny_llama: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    directory, _ = tiny_llama
    save_prequantized_fp8(directory, tmp_path / "fp8", per_tensor=())
    stored = cpu_engine(tmp_path / "fp8", None)
    at_load = cpu_engine(directory, "fp8")
    assert stored.runner.model_config.quantization == Quantization("fp8", checkpoint_scales=True)
    stored_state = stored.runner.model.state_dict()
    for name, tensor in at_load.runner.model.state_dict().items():
        assert torch.equal(stored_state[name].float(), tensor.float()), name
    prompts = random_prompts(8)
    assert run_engine(stored, prompts, 16) == run_engine(at_load, prompts, 16)


def test_prequantized_per_tensor_scales_load_into_their_parts_rows(
    tiny_llama: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    directory, hf_model = tiny_llama
    save_prequantized_fp8(directory, tmp_path / "fp8", per_tensor=("k_proj", "down_proj"))
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    engine = cpu_engine(tmp_path / "fp8", None)
    attention = engine.runner.model.layers[1].self_attn
    k_rows = slice(attention.q_size, attention.q_size + attention.kv_size)
    k_scale = stored["model.layers.1.self_attn.k_proj.weight_scale"]
    assert k_scale.dim() == 0
    assert (attention.qkv_proj.weight_scale[k_rows] == k_scale).all()
    q_scale = stored["model.layers.1.self_attn.q_proj.weight_scale"]
    assert torch.equal(attention.qkv_proj.weight_scale[: attention.q_size], q_scale[:, 0])
    codes = stored["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(attention.qkv_proj.weight[k_rows].view(torch.uint8), codes.view(torch.uint8))
    prompts = random_prompts(8)
    agreement = stepwise_agreement(hf_model, prompts, run_engine(engine, prompts, 16))
    assert agreement >= AGREEMENT["fp8"]


def test_a_prequantized_checkpoint_without_its_scales_is_refused(
    tiny_llama: tuple[Path, PreTrainedModel], tmp_path: Path
) -> None:
    directory, _ = tiny_llama
    save_prequantized_fp8(directory, tmp_path / "fp8", per_tensor=())
    weights = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.2.mlp.up_proj.weight_scale"]
    save_file(tensors, weights)
    with pytest.raises(
        ValueError, match=r"lacks 1 tensors.*layers\.2\.mlp\.gate_up_proj\.weight_scale"
    ):
        cpu_engine(tmp_path / "fp8", None)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            r"block-wise FP8 \(quantization_config's weight_block_size \[128, 128\]\) is not "
            "supported",
        ),
        (
            {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
            "partly unquantized",
        ),
    ],
)
def test_checkpoint_formats_not_taken_are_refused_by_name(
    tiny_llama: tuple[Path, PreTrainedModel],
    tmp_path: Path,
    quantization_config: dict,
    message: str,
) -> None:
    directory, _ = tiny_llama
    for source in directory.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        cpu_engine(tmp_path, None)


def test_bad_quantization_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'foo', not one of fp8, int8"):
        resolve_quantization("foo", None, CPU)
    stored = Quantization("fp8", checkpoint_scales=True)
    with pytest.raises(ValueError, match="quantized to fp8; it cannot load as int8"):
        resolve_quantization("int8", stored, CPU)
    assert resolve_quantization(None, stored, CPU) is stored
    assert resolve_quantization("int8", None, CPU) == Quantization("int8")
    # An Ampere GPU, which has no FP8 GEMMs.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ValueError, match=r"compute capability 8\.9 or later.*this one is 8\.0.*int8"
    ):
        require_fp8(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    require_fp8(torch.device("cuda"))


def test_the_command_line_refuses_an_unknown_quantization() -> None:
    import argparse

    from engine.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "foo"])


def test_dummy_weights_quantize_too(tiny_llama: tuple[Path, PreTrainedModel]) -> None:
    directory, _ = tiny_llama
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        kv_cache_memory_gb=0.001,
        quantization="int8",
        load_format="dummy",
    )
    engine = LLMEngine(config)
    mlp = engine.runner.model.layers[0].mlp
    assert mlp.down_proj.weight.dtype == torch.int8 and (mlp.down_proj.weight_scale > 0).all()
    assert len(run_engine(engine, random_prompts(2), 4)[0]) == 4


def test_torch_weight_only_matmul_matches_the_dequantized_weight() -> None:
    x = torch.randn(4, 32)
    for dtype in (torch.int8, FP8):
        codes, scale = quantize_per_channel(torch.randn(16, 32), dtype)
        torch.testing.assert_close(
            TorchLayerOps().weight_only_matmul(x, codes, scale),
            x @ (codes.float() * scale[:, None]).T,
        )


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_tensor_parallel_ranks_quantize_their_own_slices(
    tiny_llama: tuple[Path, PreTrainedModel], quantization: str
) -> None:
    """At TP=2 (gloo, a worker process) each rank quantizes its slice: rank 0's column-parallel
    rows are the whole model's first rows, quantized alike; its row-parallel scales are those of
    its own half of the input columns. Generation stays close to transformers'."""
    directory, hf_model = tiny_llama
    config = EngineConfig(
        model=str(directory),
        device="cpu",
        block_size=4,
        kv_cache_memory_gb=0.01,
        tensor_parallel_size=2,
        quantization=quantization,
    )
    engine = LLMEngine(config)
    try:
        dtype = {"int8": torch.int8, "fp8": FP8}[quantization]
        layer = engine.runner.model.layers[0]
        hf_layer = hf_model.model.layers[0]
        codes, scale = quantize_per_channel(hf_layer.mlp.gate_proj.weight, dtype)
        half = codes.shape[0] // 2
        gate_rows = layer.mlp.gate_up_proj
        assert torch.equal(gate_rows.weight[:half].float(), codes[:half].float())
        assert torch.equal(gate_rows.weight_scale[:half], scale[:half])
        down = hf_layer.mlp.down_proj.weight
        columns = down[:, : down.shape[1] // 2]
        own_codes, own_scale = quantize_per_channel(columns, dtype)
        assert torch.equal(layer.mlp.down_proj.weight.float(), own_codes.float())
        assert torch.equal(layer.mlp.down_proj.weight_scale, own_scale)
        prompts = random_prompts(8)
        agreement = stepwise_agreement(hf_model, prompts, run_engine(engine, prompts, 16))
        assert agreement >= AGREEMENT[quantization]
    finally:
        engine.close()
