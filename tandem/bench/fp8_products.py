"""The W8A8 FP8 products at a model's shapes: ``tandem bench kernels --fp8-products SHAPE``.

Each linear layer of one rank at TP=1 (Q/K/V, o, gate/up, down), random FP8 codes with
per-channel and per-token scales, at each row count given, by the two products that
``engine.backends.triton.fp8_matmul`` chooses between: the rowwise-scaled ``_scaled_mm`` and
the unscaled tensor-wide product scaled after, which is checked against the first. Also
timed for reference: the tensor-wide product alone and bf16 ``torch.mm`` of the same shape.
Each timing is a CUDA graph's replay after an L2 flush (``time_ms``). "rule" is the product
``fp8_matmul`` takes; the TFLOP/s are the rowwise product's and the faster one's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.backends.triton.fp8_matmul import (
    rowwise_product,
    scaled_after_product,
    takes_unscaled_product,
)
from tandem.testing.random_checkpoint import shape_dims

ROWS = (32, 64, 128, 192, 256, 512, 2048)


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the shape's linear layers at TP=1."""
    d = shape_dims(shape)
    q_width = d.heads * d.head_dim
    return [
        ("qkv", q_width + 2 * d.kv_heads * d.head_dim, d.hidden),
        ("o", d.hidden, q_width),
        ("gate_up", 2 * d.intermediate, d.hidden),
        ("down", d.hidden, d.intermediate),
    ]


def run_fp8_products(
    shapes: list[str], rows: list[int], time_ms: Callable[[Callable[[], None]], float]
) -> None:
    print(
        f"\n{'shape':14} {'layer':8} {'rows':>5} {'rowwise us':>10} {'scaled after':>12} "
        f"{'tensor-wide':>11} {'bf16 mm':>8} {'rule':>12} {'TFLOP/s':>13} {'max err':>8}"
    )
    for shape in shapes:
        for name, n, k in layer_shapes(shape):
            weight = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
            channel_scale = torch.rand(n, device="cuda") + 0.5
            for m in rows:
                print(f"{shape:14} {name:8} {m:5d} " + time_case(m, weight, channel_scale, time_ms))


def time_case(
    m: int,
    weight: torch.Tensor,
    channel_scale: torch.Tensor,
    time_ms: Callable[[Callable[[], None]], float],
) -> str:
    """One layer's row of the table at ``m`` rows (after its shape, layer and rows)."""
    n, k = weight.shape
    codes = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    token_scale = torch.rand(m, 1, device="cuda") + 0.5
    args = (codes, token_scale, weight, channel_scale, torch.bfloat16)
    reference = rowwise_product(*args).float()
    error = (scaled_after_product(*args).float() - reference).abs().max() / reference.abs().max()
    one = torch.ones((), device="cuda")
    x_bf16, weight_bf16 = codes.to(torch.bfloat16), weight.to(torch.bfloat16)
    rowwise = time_ms(lambda: rowwise_product(*args)) * 1e3
    after = time_ms(lambda: scaled_after_product(*args)) * 1e3
    tensor_wide = 1e3 * time_ms(
        lambda: torch._scaled_mm(
            codes,
            weight.t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
    )
    bf16 = time_ms(lambda: torch.mm(x_bf16, weight_bf16.t())) * 1e3
    rule = "scaled after" if takes_unscaled_product(m, n) else "rowwise"
    tflops = 2 * m * n * k / 1e6
    rates = f"{tflops / rowwise:.0f}/{tflops / min(rowwise, after):.0f}"
    return (
        f"{rowwise:10.1f} {after:12.1f} {tensor_wide:11.1f} {bf16:8.1f} {rule:>12} "
        f"{rates:>13} {error.item():8.1e}"
    )
