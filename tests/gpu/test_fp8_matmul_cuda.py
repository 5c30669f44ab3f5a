"""The Triton backend's W8A8 FP8 products (engine/backends/triton/fp8_matmul.py) on CUDA:
both products it chooses between equal the float32 product of the dequantized operands
within fast accumulation's error, at shapes either side of its rule, and replay alike from
a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton.fp8_matmul import (
    fp8_matmul,
    rowwise_product,
    scaled_after_product,
    takes_unscaled_product,
)

FP8 = torch.float8_e4m3fn


def operands(rows: int, columns: int, depth: int) -> tuple:
    generator = torch.Generator(device="cuda").manual_seed(rows * columns + depth)
    codes = torch.randn(rows, depth, device="cuda", generator=generator).to(FP8)
    token_scale = torch.rand(rows, 1, device="cuda", generator=generator) + 0.5
    weight = (torch.randn(columns, depth, device="cuda", generator=generator) * 0.05).to(FP8)
    channel_scale = torch.rand(columns, device="cuda", generator=generator) + 0.5
    return codes, token_scale, weight, channel_scale, torch.bfloat16


def exact(codes, token_scale, weight, channel_scale, _dtype) -> torch.Tensor:  # noqa: ANN001
    return (codes.float() * token_scale) @ (weight.float() * channel_scale[:, None]).t()


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(autouse=True)
def fp8_device() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")


@pytest.mark.parametrize("rows", [17, 64, 256, 600])
@pytest.mark.parametrize(("columns", "depth"), [(512, 256), (4096, 14336), (12288, 4096)])
def test_both_products_equal_the_float32_product(rows: int, columns: int, depth: int) -> None:
    args = operands(rows, columns, depth)
    reference = exact(*args)
    for product in (rowwise_product, scaled_after_product, fp8_matmul):
        out = product(*args)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, columns)
        assert relative_error(out, reference) < 2e-2, product.__name__


def test_the_rule_takes_each_product_somewhere() -> None:
    assert takes_unscaled_product(256, 4096)
    assert not takes_unscaled_product(256, 28672)
    assert not takes_unscaled_product(8192, 4096)


@pytest.mark.parametrize("rows", [64, 600])
def test_a_cuda_graph_replays_the_product(rows: int) -> None:
    args = operands(rows, 4096, 4096)
    codes = args[0]
    eager = fp8_matmul(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_matmul(*args)
    new_codes = torch.randn_like(codes, dtype=torch.float32).to(FP8)
    codes.copy_(new_codes)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(replayed, exact(*args)) < 2e-2
    assert not torch.equal(replayed, eager)  # it read the new codes
