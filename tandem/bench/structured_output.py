"""What structured outputs cost: offline throughput with a share of the requests constrained by
a JSON schema, against the same requests unconstrained, in one process.

    tandem bench structured-output --model DIR [--structured-fraction 0.5]
                                   [--repeats 3] [--num-requests 256]

The workload is tandem/bench/offline.py's (random prompts, lengths uniform in [100, 1024]). A
constrained request stops where its JSON is complete, so the two runs would not generate the
same tokens; each constrained run therefore records how many tokens every request generated,
and the unconstrained run that follows it asks for exactly those (ignore_eos): the two runs
differ only in the grammars. Runs alternate, --repeats of each; the table gives the median
and the range, and the host's time per step in the engine's phases
(which of them the device waits through is what the grammar costs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import xgrammar as xgr

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling.structured_output import GrammarBitmask
from protocol import StructuredOutput
from tandem.bench.offline import (
    compile_times,
    constrained_indices,
    json_schema_constraint,
    submit,
    workload,
)


class PhaseTimer:
    """Host seconds spent in chosen methods, by run and method, while ``run`` names one."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.run: str | None = None

    def wrap(self, owner: Any, method: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.run is None:
                return inner(*args, **kwargs)
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[self.run][name] += time.perf_counter() - started

        setattr(owner, method, timed)


def run(
    engine: LLMEngine,
    requests: list[tuple[list[int], int]],
    constrained: set[int],
    constraint: StructuredOutput,
) -> tuple[list[int], float, int]:
    """Every request at once; the tokens each generated, the seconds, the steps."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    submit(engine, requests, constrained, constraint)
    generated = [0] * len(requests)
    steps = 0
    while engine.has_work:
        steps += 1
        for _, output in engine.step():
            generated[int(output.request_id)] += len(output.new_token_ids)
    return generated, time.perf_counter() - started, steps


def fill_times(
    engine: LLMEngine,
    requests: list[tuple[list[int], int]],
    constrained: set[int],
    constraint: StructuredOutput,
    steps: int,
) -> tuple[int, dict[str, float]]:
    """Milliseconds to fill the masks of the live grammars after ``steps`` steps of a run, by
    the library's thread count, each fill after every grammar took one more token (the
    library answers a repeated fill from its cache): what one step pays, measured apart."""
    submit(engine, requests, constrained, constraint)
    for _ in range(steps):
        engine.step()
    engine.sync()
    matchers = [r.grammar for r in engine.requests.values() if r.grammar is not None]
    matchers = [m for m in matchers if not m.is_terminated()]
    bitmask = xgr.allocate_token_bitmask(len(matchers), engine.vocab_size)
    bits = torch.arange(32, dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    times = {}
    for threads in (1, 2, 4, 8, "auto"):
        filler = xgr.BatchGrammarMatcher(max_threads=threads)
        seconds = 0.0
        for _ in range(10):
            started = time.perf_counter()
            filler.batch_fill_next_token_bitmask(matchers, bitmask)
            seconds += time.perf_counter() - started
            allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, : engine.vocab_size]
            scores = torch.rand(allowed.shape, generator=generator).masked_fill_(allowed == 0, -1)
            for matcher, token in zip(matchers, scores.argmax(1).tolist(), strict=True):
                if not matcher.is_terminated():
                    matcher.accept_token(token)
        times[f"threads={threads}"] = seconds / 10 * 1e3
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    return len(matchers), times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--structured-fraction", type=float, default=0.5)
    parser.add_argument("--schema", default="builtin", help="a JSON schema file, or builtin")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            max_model_len=2 * args.max_len + 16,
        )
    )
    constraint = json_schema_constraint(args.schema)
    vocabulary_s, schema_s = compile_times(engine, constraint)
    requests = workload(args.num_requests, engine.vocab_size, args.min_len, args.max_len)
    indices = constrained_indices(args.num_requests, args.structured_fraction)

    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "forward", "pack + launch forward")
    timer.wrap(engine, "sync", "wait + read results")
    timer.wrap(engine.runner, "sample", "mask + launch sample")
    timer.wrap(GrammarBitmask, "apply", "of which: fill + apply mask")
    timer.wrap(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", "  of which: fill")
    timer.wrap(xgr, "apply_token_bitmask_inplace", "  of which: apply")
    if engine.device.type == "cuda":
        timer.wrap(torch.cuda.Event, "synchronize", "event waits (all)")

    run(
        engine, requests[:8], indices, constraint
    )  # warm-up: first-use costs stay out of the timing
    timings: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    steps_seen: list[int] = []
    for _ in range(args.repeats):
        timer.run = "constrained"
        generated, seconds, steps = run(engine, requests, indices, constraint)
        steps_seen.append(steps)
        timings["constrained"].append(sum(generated) / seconds)
        replay = [(prompt, n) for (prompt, _), n in zip(requests, generated, strict=True) if n]
        timer.run = "unconstrained"
        generated_again, seconds, _ = run(engine, replay, set(), constraint)
        timer.run = None
        assert sum(generated_again) == sum(generated)
        timings["unconstrained"].append(sum(generated) / seconds)
        finished_early = sum(
            1 for i in indices if generated[i] < requests[i][1]
        )  # their JSON was complete

    print(
        f"\n{args.model}: {args.num_requests} requests, {len(indices)} constrained by a JSON "
        f"schema; vocabulary read in {vocabulary_s:.2f} s, schema compiled (cold) in "
        f"{schema_s * 1e3:.0f} ms; {finished_early} constrained requests completed their JSON "
        f"early; {sum(generated)} output tokens a run"
    )
    print(f"{'run':16} {'tok/s median':>13} {'min':>9} {'max':>9}")
    for name, values in timings.items():
        print(f"{name:16} {statistics.median(values):13.0f} {min(values):9.0f} {max(values):9.0f}")
    cost = 1 - statistics.median(timings["constrained"]) / statistics.median(
        timings["unconstrained"]
    )
    print(f"cost of the grammars: {cost:.1%} of the unconstrained throughput")
    total_steps = sum(steps_seen)
    rows, fills = fill_times(engine, requests, indices, constraint, steps=300)
    print(
        f"filling {rows} live grammars' masks after 300 steps, ms: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in fills.items())
    )
    print(f"host ms per step ({total_steps / args.repeats:.0f} steps a run):")
    print(f"  {'':28} {'constrained':>12} {'unconstrained':>14}")
    for name, seconds in timer.seconds["constrained"].items():
        other = timer.seconds["unconstrained"].get(name, 0.0)
        print(f"  {name:28} {seconds * 1e3 / total_steps:12.3f} {other * 1e3 / total_steps:14.3f}")


if __name__ == "__main__":
    main()
