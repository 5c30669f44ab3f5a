"""What --quantization costs in accuracy and buys in speed: bf16 against int8 and fp8.

    tandem bench quantization [--models smollm2,gemma3-270m,qwen2.5-coder-0.5b]
                              [--methods bf16,int8,fp8] [--device cpu|cuda]
                              [--prompts 16] [--tokens 64]
    tandem bench quantization --kernels [--rows 1 16]  # CUDA: the GEMM paths, 8B shapes
    tandem bench quantization --speed-model DIR [--load-format dummy]  # CUDA: speed

Accuracy, on the real GGUF models of shared/MODELS.md (dequantized to bfloat16 as they load,
then quantized by the engine): for each method (the first is the reference; float32, the
unquantized model in float32, shows how far bf16's own rounding moves greedy tokens),
- greedy agreement with bf16: the same 16 text prompts, 64 tokens each (EOS ignored); the
  share of tokens identical to bf16's up to the first that differs (averaged over prompts),
  and the share identical position by position overall;
- perplexity of a fixed English text (scripts/data/perplexity.txt) from its prompt
  log-probabilities, scored in one prefill.
Models not fetched yet (scripts/fetch_test_gguf.py) are skipped with a line saying so.

Speed, on CUDA, for each method: batch-1 time per output token (128-token prompt, 128 tokens)
and one decode step at batch 64 (through the engine's CUDA graphs), as medians.

--kernels (CUDA) times the linear layers' GEMMs at the Llama-3.1-8B shapes for 1 to 256 rows:
bf16 F.linear, the int8 and fp8 weight-only Triton kernel and fp8 W8A8 (per-token activation
quantization and torch._scaled_mm), each first checked against the float product, and says
at which row counts weight-only beats W8A8: ``WEIGHT_ONLY_MAX_TOKENS`` (16) should sit at the
crossover. Each GEMM is timed as a step runs it: replayed from a CUDA graph (no launch
timed), with the L2 cache evicted before each call; with the weight-only kernel's share of
the copy bandwidth its bytes would take (``GB/s``, the weight's bytes over the time).

Every figure is printed as a table last; nothing is compared across machines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from engine.backends.pytorch import quantize_per_token_fp8
from engine.checkpoint.resolve import DEFAULT_MODEL
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.quantization.linear_methods import (
    FP8,
    WEIGHT_ONLY_MAX_TOKENS,
    quantize_per_channel,
)
from protocol import SamplingParams
from tandem import REPO_ROOT
from tandem.testing.gguf_models import TEST_MODELS

# In the checkout (tandem/bench/ is two floors down), beside the scripts.
PERPLEXITY_TEXT = REPO_ROOT / "scripts" / "data" / "perplexity.txt"
PROMPTS = [
    "The capital of France is",
    "Here is a short story about a lighthouse keeper:",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The main difference between TCP and UDP is",
    "Photosynthesis is the process by which",
    "import numpy as np\n\n# Compute the mean of each row\n",
    "The French Revolution began in",
    "A good way to learn a new language is",
    "SELECT name, COUNT(*) FROM orders",
    "The theory of relativity says that",
    "Dear hiring manager, I am writing to",
    "The largest planet in the solar system is",
    "Water boils at 100 degrees Celsius because",
]
# 8B's linear layers: (name, output features, input features).
LINEARS = {  # (name, output size, input size) of each linear layer of a decoder layer
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)],
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def model_path(name: str) -> str | None:
    """The GGUF to load for ``name``; None if it is not fetched yet."""
    if name == "smollm2":
        return DEFAULT_MODEL  # the engine fetches it itself
    path = TEST_MODELS[name].path
    return str(path) if path.exists() else None


def engine_for(model: str, method: str, device: str, **options: object) -> LLMEngine:
    """``method``: bf16, float32 (unquantized: the rounding noise floor against bf16), or a
    --quantization of bf16."""
    unquantized = method in ("bf16", "float32")
    return LLMEngine(
        EngineConfig(
            model=model,
            device=device,
            dtype="float32" if method == "float32" else "bfloat16",
            quantization=None if unquantized else method,
            kv_cache_memory_gb=0.5 if device == "cpu" else None,
            max_num_seqs=64,
            max_model_len=4096,
            **options,  # type: ignore[arg-type]
        )
    )


def run(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """Each request's outputs, all added at once and stepped to the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(b"bench", str(i), prompt, sampling)
    outputs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outputs = run(engine, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return [[t for o in outputs[str(i)] for t in o.new_token_ids] for i in range(len(prompts))]


def perplexity(engine: LLMEngine, text_ids: list[int]) -> float:
    sampling = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = run(engine, [text_ids], sampling)["0"]  # the prompt's in pieces, in order
    logprobs = [entry.logprob for output in outputs for entry in output.prompt_logprobs or []]
    return float(torch.tensor(logprobs).mean().neg().exp())


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(identical up to the first difference, identical position by position), as shares."""
    prefix, same, total = [], 0, 0
    for a, b in zip(ours, reference, strict=True):
        first_difference = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b)
        )
        prefix.append(first_difference / len(b))
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(b)
    return statistics.mean(prefix), same / total


@dataclass
class Speed:
    tpot_ms: float
    batch64_step_ms: float


def decode_speed(engine: LLMEngine, vocab_size: int) -> Speed:
    """Median batch-1 time per output token, and a batch-64 decode step's."""
    generator = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list[list[int]]:
        return torch.randint(0, vocab_size, (count, 128), generator=generator).tolist()

    def timed_steps(count: int, tokens: int) -> list[float]:
        sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts(count)):
            engine.add_request(b"bench", f"speed-{time.monotonic_ns()}-{i}", prompt, sampling)
        gaps, last = [], None
        while engine.has_work:
            engine.step()
            torch.cuda.synchronize()
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        return gaps[2:-2]  # past the prefill, before the drain

    timed_steps(1, 16)  # warm
    tpot = statistics.median(timed_steps(1, 128)) * 1e3
    step = statistics.median(timed_steps(64, 64)) * 1e3
    return Speed(tpot, step)


def accuracy(args: argparse.Namespace) -> list[str]:
    rows = [
        "| model | method | greedy: identical to first difference | identical overall | "
        "perplexity | batch-1 TPOT (ms) | batch-64 step (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    text = PERPLEXITY_TEXT.read_text()
    for name in args.models.split(","):
        model = model_path(name)
        if model is None:
            print(f"{name}: not fetched (python scripts/fetch_test_gguf.py {name}); skipped")
            continue
        reference: list[list[int]] | None = None
        for method in args.methods.split(","):
            started = time.perf_counter()
            engine = engine_for(model, method, args.device)
            tokenizer = Tokenizer.from_str(engine.tokenizer.tokenizer_json)
            prompts = [tokenizer.encode(p).ids for p in PROMPTS[: args.prompts]]
            tokens = greedy_tokens(engine, prompts, args.tokens)
            reference = reference or tokens
            text_ids = tokenizer.encode(text).ids[:2048]
            ppl = perplexity(engine, text_ids)
            prefix, overall = agreement(tokens, reference)
            speed = "| – | –"
            if args.device == "cuda":
                measured = decode_speed(engine, tokenizer.get_vocab_size())
                speed = f"| {measured.tpot_ms:.3f} | {measured.batch64_step_ms:.3f}"
            rows.append(f"| {name} | {method} | {prefix:.3f} | {overall:.3f} | {ppl:.3f} {speed} |")
            print(rows[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
            engine.close()
    return rows


def speed_only(args: argparse.Namespace) -> list[str]:
    rows = [
        "| model | method | batch-1 TPOT (ms) | batch-64 step (ms) |",
        "| --- | --- | ---: | ---: |",
    ]
    for method in args.methods.split(","):
        engine = engine_for(args.speed_model, method, "cuda", load_format=args.load_format)
        measured = decode_speed(engine, engine.vocab_size)
        rows.append(
            f"| {Path(args.speed_model).name} | {method} | {measured.tpot_ms:.3f} | "
            f"{measured.batch64_step_ms:.3f} |"
        )
        print(rows[-1], flush=True)
        engine.close()
    return rows


def graphed_us(fn: Callable[[], object], repeats: int = 20) -> float:
    """Microseconds of one ``fn()`` on the GPU: ``repeats`` calls, each after a 256 MB write
    that evicts the L2 cache (as the other layers of a step do), replayed from one CUDA graph
    (so no launch is timed: a step replays them too), less the writes alone; median of 5."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def replay_ms(with_fn: bool) -> float:
        fn()  # compiled and tuned outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return (replay_ms(True) - replay_ms(False)) / repeats * 1e3


def gemm_paths(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways to multiply by ``weight`` [N, K]: bf16 (cuBLAS, and the weight-only kernel
    over the bf16 weight as its codes), the weight-only kernel over int8 and fp8 codes, and
    fp8 W8A8 (the activation quantized per token, then torch._scaled_mm)."""
    from engine.backends.triton.one_row_matmul import one_row_matmul
    from engine.backends.triton.quantized_matmul import tiled_matmul, weight_only_matmul

    bf16_weight = weight.bfloat16()
    int8_codes, int8_scale = quantize_per_channel(weight, torch.int8)
    fp8_codes, fp8_scale = quantize_per_channel(weight, FP8)
    ones = torch.ones(weight.shape[0], device=weight.device)

    def bf16_triton(x: torch.Tensor) -> torch.Tensor:
        # One row takes the one-row kernel, which reads a weight in x's dtype without scales.
        if x.shape[0] == 1:
            return one_row_matmul(x, bf16_weight)
        return tiled_matmul(x, bf16_weight, ones)

    def w8a8(x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_per_token_fp8(x)
        return torch._scaled_mm(
            codes, fp8_codes.t(), scale_a=scale, scale_b=fp8_scale.view(1, -1), out_dtype=x.dtype
        )

    return {
        "bf16": lambda x: F.linear(x, bf16_weight),
        "bf16-triton": bf16_triton,
        "int8": lambda x: weight_only_matmul(x, int8_codes, int8_scale),
        "fp8-wo": lambda x: weight_only_matmul(x, fp8_codes, fp8_scale),
        "fp8-w8a8": w8a8,
    }


def kernels(row_counts: tuple[int, ...], shapes: list[str]) -> list[str]:
    device = torch.device("cuda")
    rows = [
        "| layer | rows | bf16 (us) | bf16 Triton (us) | int8 weight-only (us) | "
        "fp8 weight-only (us) | fp8 W8A8 (us) | bf16 GB/s | fp8 weight-only GB/s | "
        "faster fp8 path | rule says |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    disagreements = 0
    linears = [(f"{shape} {name}", n, k) for shape in shapes for name, n, k in LINEARS[shape]]
    for name, output_size, input_size in linears:
        weight = torch.randn(output_size, input_size, device=device) * 0.02
        paths = gemm_paths(weight)
        for count in row_counts:
            x = torch.randn(count, input_size, device=device).bfloat16()
            reference = x.float() @ weight.T
            largest = reference.abs().max()
            us = {}
            for path, multiply in paths.items():  # correctness first: a few % of the largest
                error = (multiply(x).float() - reference).abs().max() / largest
                assert error < 0.08, f"{name} rows {count} {path}: error {error:.3f} of the largest"
                us[path] = graphed_us(lambda multiply=multiply: multiply(x))  # noqa: B023
            faster = "weight-only" if us["fp8-wo"] <= us["fp8-w8a8"] else "W8A8"
            rule = "weight-only" if count <= WEIGHT_ONLY_MAX_TOKENS else "W8A8"
            disagreements += faster != rule
            elements = output_size * input_size
            bf16_us = min(us["bf16"], us["bf16-triton"])
            rows.append(
                f"| {name} {output_size}x{input_size} | {count} | {us['bf16']:.1f} | "
                f"{us['bf16-triton']:.1f} | {us['int8']:.1f} | {us['fp8-wo']:.1f} | "
                f"{us['fp8-w8a8']:.1f} | {2 * elements / bf16_us / 1e3:.0f} | "
                f"{elements / us['fp8-wo'] / 1e3:.0f} | {faster} | {rule} |"
            )
            print(rows[-1], flush=True)
    rows.append(
        f"\nthe rule (rows <= {WEIGHT_ONLY_MAX_TOKENS}: weight-only) picks the slower "
        f"fp8 path in {disagreements} of {len(rows) - 2} cases"
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument("--methods", default="bf16,int8,fp8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kernels", action="store_true", help="CUDA: time the GEMM paths")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS), help="--kernels: the row counts"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["8b"], choices=sorted(LINEARS), help="--kernels: layers"
    )
    parser.add_argument("--speed-model", help="CUDA: decode speed of this checkpoint only")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="with --speed-model"
    )
    args = parser.parse_args(argv)
    print(
        f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    )
    if args.kernels:
        table = kernels(tuple(args.rows), args.shapes)
    elif args.speed_model:
        table = speed_only(args)
    else:
        table = accuracy(args)
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
