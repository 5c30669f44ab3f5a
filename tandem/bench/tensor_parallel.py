"""Tensor parallelism on the GPU machine: correct first, then fast. Each part fits one call.

    tandem bench tensor-parallel --part check   # TP=2 greedy tokens equal TP=1's
    tandem bench tensor-parallel --part 8b      # Llama-3.1-8B shape, TP=1 and TP=2
    tandem bench tensor-parallel --part 70b     # Llama-3.1-70B shape, TP=2
    tandem bench tensor-parallel --part 70b --tensor-parallel-size 4   # or 8

check: small real-shaped random checkpoints (Qwen2.5-0.5B: biases, 2 KV heads; Llama-3.2-1B:
tied head), saved as safetensors and loaded from them, each rank reading its slices; 16
prompts' greedy generations (32 tokens, decode graphs on), then the first prompt's alone (a
batch of one: the one-row kernel), at TP=1 and TP=2 must be equal,
in float32 so that rounding does not decide near-ties of random weights. Fails loudly.

8b / 70b: random bf16 weights of the shape made on the GPUs (--load-format dummy: no 16 or
141 GB file to write), through tandem/bench/latency.py (a real engine process over its
socket: time to ready, batch-1 TPOT and its share of the N-GPU bandwidth floor) and
tandem/bench/offline.py (256 requests, in-process: load time, output tokens per second and
their share of the N-GPU roofline, each rank's share of the work read and computed at once).
Targets: 8B TPOT at TP=2 at most 60% of TP=1's; 70B TPOT at least 70% of the floor (65% at
TP=8). Each run is a child process, so every one starts on empty GPUs. A table ends each part.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHECK_SHAPES = ("qwen2.5-0.5b", "llama-3.2-1b")
PROMPTS, PROMPT_LEN, OUTPUT_LEN = 16, 64, 32


def greedy_tokens(model: str, tensor_parallel_size: int, out: Path) -> None:
    """(In a child process.) The check's greedy generations, written to ``out``."""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tandem.testing.reference import run_engine

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=0.5,
            max_model_len=1024,
        )
    )
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, engine.vocab_size, (PROMPTS, PROMPT_LEN), generator=generator)
    tokens = run_engine(engine, prompts.tolist(), OUTPUT_LEN)
    # And the first prompt alone: a batch of one takes the one-row kernel on every rank.
    tokens += run_engine(engine, prompts[:1].tolist(), OUTPUT_LEN)
    out.write_text(json.dumps(tokens))
    engine.close()


def run_child(module: str, args: list[str]) -> None:
    """``python -m module args`` in a child process: every run starts on empty GPUs."""
    print("$ python -m", module, " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", module, *args], check=True)


def check(workdir: Path) -> list[tuple[str, str]]:
    import torch

    from tandem.testing.random_checkpoint import save_random_model

    rows = []
    for shape in CHECK_SHAPES:
        directory = workdir / shape
        if not (directory / "config.json").is_file():
            save_random_model(directory, shape, torch.bfloat16)
        results = {}
        for size in (1, 2):
            out = workdir / f"{shape}-tp{size}.json"
            run_child(
                "tandem.bench.tensor_parallel", ["--greedy", str(directory), str(size), str(out)]
            )
            results[size] = json.loads(out.read_text())
        diverged = [
            (i, next(j for j, (a, b) in enumerate(zip(one, two, strict=True)) if a != b))
            for i, (one, two) in enumerate(zip(results[1], results[2], strict=True))
            if one != two
        ]
        verdict = "equal" if not diverged else f"DIFFER (request, first token): {diverged}"
        print(f"{shape}: TP=2 greedy tokens vs TP=1: {verdict}", flush=True)
        compared = f"{PROMPTS} + 1 x {OUTPUT_LEN} greedy tokens at TP=2 vs TP=1"
        rows.append((shape, f"{compared}: {verdict}"))
        if diverged:
            raise SystemExit(f"{shape}: tensor parallelism changed the greedy tokens")
    return rows


def shape_figures(workdir: Path, shape: str, size: int) -> dict[str, float]:
    """Latency (engine process) and offline throughput (in-process) of ``shape`` at TP
    ``size``, random weights made at start-up."""
    from tandem.testing.random_checkpoint import save_random_config

    directory = workdir / f"{shape}-config"
    if not (directory / "config.json").is_file():
        save_random_config(directory, shape)
    common = ["--model", str(directory), "--tensor-parallel-size", str(size)]
    common += ["--load-format", "dummy"]
    latency, offline = workdir / f"latency-{shape}-tp{size}.json", workdir / "offline.json"
    run_child("tandem.bench.latency", [*common, "--json-out", str(latency)])
    run_child("tandem.bench.offline", [*common, "--json-out", str(offline)])
    served = json.loads(latency.read_text())
    ran = json.loads(offline.read_text())
    return served | {"ready_s": served["start_s"], "in_process_s": ran.pop("start_s")} | ran


def speed(workdir: Path, shape: str, sizes: list[int]) -> list[tuple[str, str]]:
    figures = {size: shape_figures(workdir, shape, size) for size in sizes}
    rows = []
    for size, f in figures.items():
        rows.append(
            (
                f"{shape} TP={size}",
                f"load {f['load_s']:.1f} s, ready {f['ready_s']:.1f} s (engine process; "
                f"in-process {f['in_process_s']:.1f} s), TPOT {f['tpot_ms']:.2f} ms "
                f"({f['floor_share']:.0%} of the {size}-GPU floor {f['floor_ms']:.2f} ms), "
                f"offline {f['tok_s']:.0f} tok/s ({f['roofline_share']:.0%} of the {size}-GPU "
                f"roofline of its steps, {f['workload_roofline_share']:.0%} of the workload's)",
            )
        )
    if 1 in figures and 2 in figures:
        ratio = figures[2]["tpot_ms"] / figures[1]["tpot_ms"]
        verdict = "meets" if ratio <= 0.60 else "MISSES"
        rows.append((f"{shape} TP=2/TP=1 TPOT", f"{ratio:.0%} ({verdict} the 60% target)"))
    for size, f in figures.items():
        if shape == "llama-3.1-70b":
            goal = 0.65 if size == 8 else 0.70
            verdict = "meets" if f["floor_share"] >= goal else "MISSES"
            rows.append((f"{shape} TP={size} floor share", f"{verdict} the {goal:.0%} goal"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=["check", "8b", "70b"])
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="70b: GPUs (default 2)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tp-bench")
    # A child's run of the check: MODEL TENSOR_PARALLEL_SIZE OUT.
    parser.add_argument("--greedy", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.greedy:
        model, size, out = args.greedy
        greedy_tokens(model, int(size), Path(out))
        return
    if args.part is None:
        parser.error("--part is required")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.part == "check":
        rows = check(args.workdir)
    elif args.part == "8b":
        rows = speed(args.workdir, "llama-3.1-8b", [1, 2])
    else:
        rows = speed(args.workdir, "llama-3.1-70b", [args.tensor_parallel_size])
    print(f"\ntensor parallelism, part {args.part}")
    for name, result in rows:
        print(f"  {name:32} {result}")


if __name__ == "__main__":
    main()
