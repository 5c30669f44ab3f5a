"""What a sampled step's draw costs: ``tandem bench kernels --sampler``.

A step whose rows sample (temperature above 0: an OpenAI client's default) draws each row's
token by the exponential race over float32 logits [B, V] (``StepOps.sample_rows``). The
torch backend's reference (``sampling_draw.race_sample``) hashes the random numbers as
int64 tensors, some thirty [B, V] passes and as many kernel launches, and sorts each row
where top-k or top-p cut it; the Triton backend's kernels hash them in registers as they
read the logits (``triton/argmax.py``: once; ``triton/nucleus.py``, with cuts: a few times,
no sort). Both, and the greedy argmax beside them, at the vocabularies of the default shapes
and batch sizes 1-256, every row at temperature 1 and then cut as a generation config cuts
(``CUTS``: top-p 0.9 and top-k 20, and min-p beside them):

- device: the draw replayed from a CUDA graph after an L2 flush (``time_ms``), and its
  logits' bytes over that time against the measured copy bandwidth;
- wall: the draw launched eagerly and waited for, as the engine launches it after each
  step's graph (the host's launches included), median of ``WALL_REPEATS``.

Each case first checks that the kernel draws the reference's tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from engine.backends.sampling_draw import Cuts, race_sample
from engine.backends.triton.argmax import argmax_rows
from engine.backends.triton.nucleus import draw_tokens

# Llama 3's (the 1B and 8B shapes), Qwen3's and SmolLM2's vocabularies.
VOCABULARIES = (128256, 151936, 49152)
WALL_REPEATS = 20
CUDA = torch.device("cuda")
CUTS = {"none": None, "top-p 0.9, top-k 20": (0.9, 20, None), "and min-p 0.05": (0.9, 20, 0.05)}


def _wall_ms(run: Callable[[], object], device: torch.device) -> float:
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    timings = []
    for _ in range(WALL_REPEATS):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        timings.append((time.perf_counter() - started) * 1e3)
    return statistics.median(timings)


def sampler_case(
    vocab: int,
    batch: int,
    cut: tuple[float, int, float | None] | None,
    bytes_per_s: float,
    time_ms: Callable[[Callable[[], None]], float],
    device: torch.device = CUDA,
) -> str:
    """One row of the table: the draw of ``batch`` rows of ``vocab`` logits cut as ``cut``
    says (top-p, top-k, min-p), checked first (on the CPU, in Triton's interpreter, for a
    test)."""
    logits = torch.randn(batch, vocab, device=device) * 4
    logits[:, :16] += 8.0  # a head of likely tokens, as a language model's
    params = (
        torch.ones(batch, device=device),  # temperature
        torch.arange(batch, device=device) * 7919 + 1,  # seed
        torch.full((batch,), 100, device=device),  # step
    )
    cuts = None
    if cut is not None:
        top_p, top_k, min_p = cut
        cuts = Cuts(
            torch.full((batch,), top_p, device=device),
            torch.full((batch,), top_k, device=device),
            None if min_p is None else torch.full((batch,), min_p, device=device),
        )
    got, expected = draw_tokens(logits, *params, cuts), race_sample(logits, *params, cuts)
    # Equal but where two scores tie within float32 rounding: none should, at random.
    assert torch.equal(got, expected), (vocab, batch, (got != expected).sum().item())

    def reference() -> None:
        race_sample(logits, *params, cuts)

    def kernel() -> None:
        draw_tokens(logits, *params, cuts)

    greedy_us = time_ms(lambda: argmax_rows(logits)) * 1e3
    torch_us, kernel_us = time_ms(reference) * 1e3, time_ms(kernel) * 1e3
    share = logits.numel() * logits.element_size() / (kernel_us / 1e6) / bytes_per_s
    torch_wall, kernel_wall = _wall_ms(reference, device) * 1e3, _wall_ms(kernel, device) * 1e3
    return (
        f"{vocab:7d} {batch:6d} {greedy_us:10.1f} {torch_us:9.1f} {kernel_us:10.1f} "
        f"{share:8.0%} {torch_wall:9.0f}us {kernel_wall:10.0f}us"
    )


def run_sampler(
    batches: list[int],
    bytes_per_s: float,
    time_ms: Callable[[Callable[[], None]], float],
) -> None:
    for name, cut in CUTS.items():
        print(f"\nsampling's draw, every row at temperature 1, cut: {name} (greedy: the argmax)")
        print(
            f"{'vocab':>7} {'batch':>6} {'greedy us':>10} {'torch us':>9} {'kernel us':>10} "
            f"{'of copy':>8} {'torch wall':>11} {'kernel wall':>12}"
        )
        for vocab in VOCABULARIES:
            for batch in batches:
                print(sampler_case(vocab, batch, cut, bytes_per_s, time_ms), flush=True)
                torch.cuda.empty_cache()
