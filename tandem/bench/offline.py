"""Offline throughput: the workload the small engines publish, against its roofline.

    tandem bench offline --model DIR [--num-requests 256] [--runs 3] [--peer]
                         [--peer-requests N] [--enforce-eager]
                         [--structured-fraction F [--schema FILE|builtin]]
                         [--tensor-parallel-size N] [--load-format dummy]
                         [--kv-cache-dtype fp8] [--quantization fp8|int8]
                         [--repeat-prompts] [--num-kv-blocks N] [--max-num-batched-tokens N]
                         [--json-out FILE]
                         [--profile-steps] [--temperature T [--top-p P] [--top-k K]]
                         [--repetition-penalty R]

256 requests with input and output lengths uniform in [100, 1024] (random token
ids; the lengths from seed 0, each run's prompts from a seed of its own, so that no run
finds another's prompts in the prefix cache), ignore_eos, all submitted at once to an
in-process engine, --runs times in one process, with no warm-up of its own: the first run
shows what a fresh engine's first users get. Prints each run's output tokens, seconds and
output tokens per second and how many times the scheduler preempted a request (its blocks
freed for an older one's, its tokens computed again later: a cache that cannot hold the
batch, whose cost the figures then include; the header gives the cache's tokens), and what
may have stalled a step (``Stalls``: the CUDA allocator's retries, full collections), then a
table of the first run, the median run and the range (least to greatest over the runs, a
figure alike in every run printed once) of each figure. --num-kv-blocks sizes the cache
exactly, --max-num-batched-tokens sets a step's token budget (the engine's options: the
prompt steps' size, which `--profile-steps` shows against their roofline).

With --repeat-prompts every run submits the first run's prompts, so the runs after the first
find them in the prefix cache and compute one token of each: a benchmark that drives an
engine with the same requests in every run measures that, not the workload.

The roofline (engine/roofline.py): the copy bandwidth and bf16 GEMM rate (and FP8's, on
GPUs with FP8 products) are measured on the device before the engine starts; the engine
records the shape of every step it runs; each step's bound is the larger of its bytes
(weights, K/V read and written) over the bandwidth and its FLOPs over the GEMM rate (FP8
weights' over the FP8 rate); a run's is the sum over its steps, printed as
the run's time against it ("% of roofline"). That bound follows the steps the engine chose:
an engine that split the work into more steps (more weight reads) would raise its own bound.
The workload's roofline (``workload_bound``), the least any schedule can take (the weights
read once a token position of the longest request, every K/V byte, every FLOP, reading and
computing overlapped across the run), and the run's share of it are printed beside it.

Greedy by default; with --temperature T every token is sampled at T (and within top-p P
and top-k K with --top-p and --top-k), each request seeded by the engine: what a served
model's clients get, whose OpenAI API samples at temperature 1 unless a request says
otherwise, within the model's generation config's top-p and top-k where it sets them.
With --repetition-penalty R each request's prompt and output tokens are penalized (vLLM's
repetition penalty, greedy or sampled), as Qwen2.5's generation config asks of every request.

With --peer, Hugging Face transformers' own batched generate() runs on the same weights
and GPU in the same run: prompts left-padded in batches of --peer-batch-size, each batch
generating as many tokens as its longest request; only the requested tokens are counted.
With --peer-requests N it runs the first N requests only (a random sample of the workload),
to keep its time in bounds; its tokens per second are then over those.

With --structured-fraction F, that share of the requests (spread evenly) is constrained by a
JSON schema (--schema: a file, or the builtin one, an object of string, number, enum, array
and boolean fields); its compile time, cold, is printed first, and the run finds it compiled
(one short constrained request warms it up). The tokenizer must spell JSON:
scripts/make_random_checkpoint.py's do. A constrained request stops where its JSON is
complete, ignore_eos or not; with random weights few complete, and most run to their
length, masked at every step.

Last, where the median run's time went: its steps by kind (those that prefill, with the
decodes beside them; decodes alone by batch size), each kind's time, roofline, share and the
seconds lost to the bound, and the first run's seconds in each kind (every run has the same
lengths, so the same steps): where a fresh engine's first run pays for what the warm-up left.
Each kind's slowest step, in the median run and in the first, shows a one-off stall.
A step's time is the wall time from the previous step's results being read to its own: with
overlapped steps, the device's time for it while the device is the bottleneck, the host's
when the host is.

With --profile-steps, one more run follows under the torch profiler (a fresh seed's prompts,
untimed: the profiler slows the host), and a last table says which: for each kind of step,
its wall time a step, the time its kernels kept the device busy and the time from its first
kernel to its last (each kernel charged to the step whose host call launched it,
``tandem/bench/step_kernels.py``), and its costliest kernels. Device busy well under the wall
time is a step that waited on the host.

--json-out writes the engine's figures to FILE too: its start-up (the in-process
engine's construction: load, cache sizing, graphs), load time, the median run's figures, their
least and greatest over the runs (seconds_min, seconds_max, tok_s_min, tok_s_max,
roofline_share_min, roofline_share_max), the median run's preemptions and their range
(preemptions_min, preemptions_max), each run's stalls ("stalls": allocator_retries,
collections, collection_s), the cache's tokens (kv_cache_tokens), the first run's
speed and time (first_tok_s, first_seconds), and the median and first runs' steps by kind
("steps", "first_steps": kind -> steps, seconds, bound_s, slowest_s).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.quantization.linear_methods import QUANTIZATION_METHODS
from engine.roofline import (
    DeviceRates,
    ModelCost,
    StepShape,
    cache_read_bytes,
    measure_rates,
    run_bound,
    step_bound,
    uneven_routing_note,
    workload_bound,
)
from protocol import SamplingParams, StructuredOutput, StructuredOutputKind
from protocol.flags import bounded
from tandem.bench.step_kernels import device_time_by_step, label_step, load_trace

GREEDY = SamplingParams()  # the requests' sampling unless --temperature says otherwise

BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "price": {"type": "number"},
        "category": {"enum": ["book", "music", "film", "game"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "in_stock": {"type": "boolean"},
    },
    "required": ["id", "name", "price", "category", "tags", "in_stock"],
}


Requests = list[tuple[list[int], int]]  # each request's prompt and output length


def workload(
    num_requests: int, vocab_size: int, low: int, high: int, prompt_seed: int = 0
) -> Requests:
    """Requests of lengths uniform in [low, high] (always the same), prompts of random ids
    drawn with ``prompt_seed``."""
    lengths = torch.randint(low, high + 1, (num_requests, 2), generator=_seeded(0)).tolist()
    ids = _seeded(prompt_seed + 1)
    return [
        (torch.randint(0, vocab_size, (input_len,), generator=ids).tolist(), output_len)
        for input_len, output_len in lengths
    ]


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def constrained_indices(num_requests: int, fraction: float) -> set[int]:
    """``fraction`` of the request indices, spread evenly: i where floor(i * fraction) steps."""
    return {i for i in range(num_requests) if int((i + 1) * fraction) > int(i * fraction)}


def compile_times(engine: LLMEngine, constraint: StructuredOutput) -> tuple[float, float]:
    """Seconds to read the vocabulary (the engine's first compile, of a trivial grammar) and
    then to compile ``constraint``, cold; the run then finds it compiled."""
    timings = []
    for grammar in (StructuredOutput(StructuredOutputKind.REGEX, "x"), constraint):
        started = time.perf_counter()
        engine.compiling.compiler.compile(grammar).result()
        timings.append(time.perf_counter() - started)
    return timings[0], timings[1]


@dataclass
class Stalls:
    """What can stall a run's steps beyond their work, counted over the run: the CUDA
    caching allocator's retries (an allocation it could not serve, every cached block freed
    back to the device, a synchronization, then tried again) and the garbage collector's
    full (oldest-generation) collections, with the time they took. A step much slower than
    its kind's others (the table's "slowest ms") is then one of these or not."""

    allocator_retries: int = 0
    collections: int = 0
    collection_s: float = 0.0

    def __str__(self) -> str:
        return (
            f"{self.allocator_retries} allocator retries, {self.collections} full collections"
            f" ({self.collection_s * 1e3:.1f} ms)"
        )


def _allocator_retries(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


@contextmanager
def counted_stalls(device: torch.device) -> Iterator[Stalls]:
    """``Stalls`` while the block runs: the allocator's retries on ``device`` (none off
    CUDA) and the full collections, timed by the collector's own callbacks."""
    stalls = Stalls()
    collection_started: list[float] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            collection_started.append(time.perf_counter())
        elif collection_started:
            stalls.collections += 1
            stalls.collection_s += time.perf_counter() - collection_started.pop()

    retries_before = _allocator_retries(device)
    gc.callbacks.append(on_collection)
    try:
        yield stalls
    finally:
        gc.callbacks.remove(on_collection)
        stalls.allocator_retries = _allocator_retries(device) - retries_before


@dataclass
class Run:
    tokens: int
    seconds: float
    bound_s: float  # the roofline: the least time the steps it ran can take
    steps: list[StepShape]
    # Each step's share of the wall time: from the previous step's results being read to its
    # own. With overlapped steps that is the device's time for it while the device is the
    # bottleneck, and the host's for its call when the host is.
    step_seconds: list[float]
    # The workload's own roofline (``workload_bound``), whatever steps the engine chose.
    needed_s: float = 0.0
    # Requests the scheduler preempted during the run (their tokens computed again).
    preemptions: int = 0
    stalls: Stalls = field(default_factory=Stalls)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def spread(values: Sequence[float], spec: str) -> str:
    """The least and greatest of ``values`` formatted by ``spec`` ("1298.4-1585.6"), or one
    figure where both print alike."""
    low, high = f"{min(values):{spec}}", f"{max(values):{spec}}"
    return low if low == high else f"{low}-{high}"


def extremes(key: str, values: Sequence[float]) -> dict[str, float]:
    """``key``_min and ``key``_max: the least and greatest of ``values``, for --json-out."""
    return {f"{key}_min": min(values), f"{key}_max": max(values)}


def json_schema_constraint(schema: str) -> StructuredOutput:
    """--schema's constraint: a JSON schema file, or ``builtin`` for BUILTIN_SCHEMA."""
    spec = BUILTIN_SCHEMA if schema == "builtin" else json.loads(Path(schema).read_text())
    return StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(spec))


def submit(
    engine: LLMEngine,
    requests: list[tuple[list[int], int]],
    constrained: set[int],
    constraint: StructuredOutput | None,
    prefix: str = "",
    sampling_template: SamplingParams = GREEDY,
) -> None:
    """Add every request (ignore_eos, sampled as ``sampling_template`` says; those in
    ``constrained`` under ``constraint``), request i's id ``prefix`` + i."""
    for i, (prompt, output_len) in enumerate(requests):
        sampling = replace(sampling_template, max_tokens=output_len, ignore_eos=True)
        if i in constrained:
            sampling.structured_output = constraint
        engine.add_request(b"bench", f"{prefix}{i}", prompt, sampling)


def bench_engine(
    engine: LLMEngine,
    requests: list[tuple[list[int], int]],
    constrained: set[int],
    constraint: StructuredOutput | None,
    cost: ModelCost,
    rates: DeviceRates,
    run: int,
    label_steps: bool = False,
    sampling_template: SamplingParams = GREEDY,
) -> Run:
    """One run of ``requests`` (sampled as ``submit`` samples them); with ``label_steps``,
    each step's host call labelled for the profiler (``step_kernels.label_step``)."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    engine.step_shapes = []
    preempted_before = engine.scheduler.num_preemptions
    with counted_stalls(engine.device) as stalls:
        started = time.perf_counter()
        submit(engine, requests, constrained, constraint, f"{run}-", sampling_template)
        generated = 0
        read_at = [started]  # when each step's results were read, after the run's start
        while engine.has_work:
            with label_step(len(engine.step_shapes)) if label_steps else nullcontext():
                outputs = engine.step()
            for _, output in outputs:
                generated += len(output.new_token_ids)
            num_read = len(engine.step_shapes) - (engine.in_flight is not None)
            read_at += [time.perf_counter()] * (num_read + 1 - len(read_at))
        seconds = time.perf_counter() - started
    steps, engine.step_shapes = engine.step_shapes, None
    step_seconds = [b - a for a, b in itertools.pairwise(read_at)]
    preemptions = engine.scheduler.num_preemptions - preempted_before
    bound_s = run_bound(steps, cost, rates)
    return Run(
        generated, seconds, bound_s, steps, step_seconds, preemptions=preemptions, stalls=stalls
    )


# Kernels named a step kind under --profile-steps, the costliest first.
PROFILED_KERNELS = 4

# Decode steps are grouped by their batch: at most this many sequences.
BATCH_BUCKETS = (1, 16, 64, 128, 256)


def step_kind(step: StepShape) -> str:
    """A step's row in the breakdown: "prefill" when any sequence computes more than one
    token (a prompt's chunk, with the decodes beside it), else its decode batch's bucket."""
    if not step.is_decode:
        return "prefill (and decodes)"
    batch = len(step.query_lens)
    low = 1
    for high in BATCH_BUCKETS:
        if batch <= high:
            return f"decode, batch {low}-{high}" if low < high else f"decode, batch {high}"
        low = high + 1
    return f"decode, batch > {BATCH_BUCKETS[-1]}"


@dataclass
class StepKindTotals:
    steps: int
    seconds: float
    bound_s: float
    slowest_s: float  # the kind's longest step: a stall (a compile, a collection) stands out


def step_breakdown(run: Run, cost: ModelCost, rates: DeviceRates) -> dict[str, StepKindTotals]:
    """The run's steps by kind (``step_kind``): how many, their time and their roofline;
    prefill first, then decodes by batch."""
    kinds: dict[str, StepKindTotals] = {}
    for step, seconds in zip(run.steps, run.step_seconds, strict=True):
        totals = kinds.setdefault(step_kind(step), StepKindTotals(0, 0.0, 0.0, 0.0))
        totals.steps += 1
        totals.seconds += seconds
        totals.bound_s += step_bound(step, cost, rates)
        totals.slowest_s = max(totals.slowest_s, seconds)
    return {kind: kinds[kind] for kind in sorted(kinds, key=kind_order)}


def kind_order(kind: str) -> tuple[bool, int, str]:
    """The breakdown's order of step kinds: prefill first, then decodes by batch."""
    return not kind.startswith("prefill"), len(kind), kind


def print_step_breakdown(
    breakdown: dict[str, StepKindTotals], first: dict[str, StepKindTotals]
) -> None:
    """Where the median run's time went against its roofline (which kinds of step lose the
    most), and the first run's time in each kind: where a fresh engine's first run is slower
    (what the warm-up left to it). The slowest step of a kind, in both runs, shows a one-off
    stall, such as a fresh engine's first full garbage collection, which once took a prompt
    step several times its neighbours' (docs/history/benchmarks-lab-notebook.md)."""
    print(
        f"\n{'steps of the median run':28} {'steps':>6} {'seconds':>8} {'roofline s':>11} "
        f"{'% of roofline':>14} {'ms a step':>10} {'slowest ms':>11} {'lost s':>7} "
        f"{'first run s':>12} {'its slowest ms':>15}"
    )
    for kind, t in breakdown.items():
        if kind in first:
            first_s = f"{first[kind].seconds:12.3f} {1e3 * first[kind].slowest_s:15.3f}"
        else:
            first_s = f"{'-':>12} {'-':>15}"
        print(
            f"{kind:28} {t.steps:6d} {t.seconds:8.3f} {t.bound_s:11.3f} "
            f"{t.bound_s / t.seconds:14.0%} {1e3 * t.seconds / t.steps:10.3f} "
            f"{1e3 * t.slowest_s:11.3f} {t.seconds - t.bound_s:7.3f} {first_s}"
        )


def profile_steps(labelled_run: Callable[[], Run], cost: ModelCost, rates: DeviceRates) -> str:
    """``labelled_run`` (a run whose steps are labelled, ``bench_engine``'s ``label_steps``)
    under the torch profiler, and a table of where each kind of step's device time went
    (``--profile-steps``): its wall time a step (profiled, so slower than the timed runs'),
    how long its kernels kept the device busy, how long from its first kernel to its last,
    the least time its attention can take (the K/V it reads from the cache at copy
    bandwidth: its decode attention kernel's time against this is that kernel's share of
    copy bandwidth), and its costliest kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        profiled = labelled_run()
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        device = device_time_by_step(load_trace(trace))
    kinds: dict[str, list[int]] = {}
    for index, step in enumerate(profiled.steps):
        kinds.setdefault(step_kind(step), []).append(index)
    lines = [
        f"\n{'device time, a profiled run':28} {'steps':>6} {'wall ms':>8} {'busy ms':>8} "
        f"{'span ms':>8} {'busy / wall':>12} {'cache ms':>9}  costliest kernels, ms a step"
    ]
    for kind in sorted(kinds, key=kind_order):
        indices = kinds[kind]
        times = [device[i] for i in indices if i in device]
        wall_ms = 1e3 * sum(profiled.step_seconds[i] for i in indices) / len(indices)
        busy_ms = sum(t.busy_us for t in times) / 1e3 / len(indices)
        span_ms = sum(t.span_us for t in times) / 1e3 / len(indices)
        cache_bytes = sum(cache_read_bytes(profiled.steps[i], cost) for i in indices)
        cache_ms = 1e3 * cache_bytes / rates.bytes_per_s / len(indices)
        by_kernel: dict[str, float] = {}
        for t in times:
            for name, us in t.by_kernel.items():
                by_kernel[name] = by_kernel.get(name, 0.0) + us
        costliest = sorted(by_kernel.items(), key=lambda item: -item[1])[:PROFILED_KERNELS]
        kernels = "; ".join(f"{name[:40]} {us / 1e3 / len(indices):.3f}" for name, us in costliest)
        lines.append(
            f"{kind:28} {len(indices):6d} {wall_ms:8.3f} {busy_ms:8.3f} {span_ms:8.3f} "
            f"{busy_ms / wall_ms:12.0%} {cache_ms:9.3f}  {kernels}"
        )
    return "\n".join(lines)


def warm_up_grammar(engine: LLMEngine, prompt: list[int], constraint: StructuredOutput) -> None:
    """One short constrained request, so that the grammar's first-use costs stay out."""
    sampling = SamplingParams(max_tokens=4, structured_output=constraint)
    engine.add_request(b"bench", "warmup", prompt[:16], sampling)
    while engine.has_work:
        engine.step()


def bench_transformers(
    model_dir: str, requests: list[tuple[list[int], int]], batch_size: int
) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    # Similar lengths share a batch, as a fair user of generate() would arrange.
    ordered = sorted(requests, key=lambda r: len(r[0]))
    torch.cuda.synchronize()
    started = time.perf_counter()
    for start in range(0, len(ordered), batch_size):
        batch = ordered[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new_tokens = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(
                ids.cuda(),
                attention_mask=mask.cuda(),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
    torch.cuda.synchronize()
    return sum(n for _, n in requests), time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3, help="timed runs in this process")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument(
        "--max-num-seqs", type=int, help="the engine's (default: its own, 256 a GPU)"
    )
    parser.add_argument("--peer", action="store_true", help="also time transformers (CUDA)")
    parser.add_argument("--peer-batch-size", type=int, default=64)
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="time transformers on the first N requests only (default: all)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, help="the engine's")
    parser.add_argument(
        "--structured-fraction",
        type=float,
        default=0.0,
        help="share of the requests constrained by --schema (default: none)",
    )
    parser.add_argument(
        "--schema", default="builtin", help="a JSON schema file, or builtin (default)"
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (engine's)")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="the engine's"
    )
    parser.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="every run submits the first run's prompts (the later runs find them cached)",
    )
    parser.add_argument(
        "--num-kv-blocks",
        type=bounded(int, at_least=1),
        help="the engine's: the KV cache's size in blocks",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=bounded(int, at_least=1),
        help="the engine's: the tokens a step computes at most (default: its own)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every token at this temperature (default 0: greedy); 1 is what an OpenAI "
        "client gets from a server when it names none",
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="and within this nucleus (default 1: all)"
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="and among this many tokens (default 0: all)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="vLLM's, on every token of a request's prompt and output (default 1: none; "
        "Qwen2.5's generation config sets 1.05)",
    )
    parser.add_argument("--json-out", type=Path, help="also write the engine's figures here")
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="then one more run under the torch profiler: each kind of step's device time",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.structured_fraction <= 1:
        parser.error("--structured-fraction must be in [0, 1]")

    device = torch.device(args.device)
    rates = measure_rates(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the measurement's buffers are the KV cache's again
    # The engine's own default unless asked: the option takes no None.
    budget: dict[str, int] = {}
    if args.max_num_batched_tokens is not None:
        budget["max_num_batched_tokens"] = args.max_num_batched_tokens
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            max_model_len=2 * args.max_len + 16,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            load_format=args.load_format,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            num_kv_blocks=args.num_kv_blocks,
            **budget,
        )
    )
    start_s = time.perf_counter() - started
    # Under tensor parallelism rank 0's share of the model: each GPU's bound, run in parallel.
    cost = engine.runner.model_cost
    sampling = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
    )
    constrained = constrained_indices(args.num_requests, args.structured_fraction)
    constraint = None
    if constrained:
        constraint = json_schema_constraint(args.schema)
        vocabulary_s, schema_s = compile_times(engine, constraint)
        print(
            f"structured outputs: {len(constrained)} of {args.num_requests} requests; reading "
            f"the vocabulary {vocabulary_s:.3f} s, compiling the schema (cold) {schema_s:.3f} s"
        )

    def run_workload(run: int, label_steps: bool = False) -> tuple[Requests, Run]:
        """Run ``run``'s requests (the first run's again with --repeat-prompts)."""
        prompt_seed = 0 if args.repeat_prompts else run
        requests = workload(
            args.num_requests, engine.vocab_size, args.min_len, args.max_len, prompt_seed
        )
        if constraint is not None and run == 0:
            warm_up_grammar(engine, requests[0][0], constraint)
        timed = bench_engine(
            engine, requests, constrained, constraint, cost, rates, run, label_steps, sampling
        )
        return requests, timed

    runs = []
    for run in range(args.runs):
        requests, r = run_workload(run)
        runs.append(r)
        lengths = [len(prompt) for prompt, _ in requests], [n for _, n in requests]
        cached = args.repeat_prompts and run > 0
        batch = engine.scheduler.max_num_seqs
        r.needed_s = workload_bound(*lengths, batch, cost, rates, cached)
        print(
            f"run {run + 1}: {r.tokens} tokens in {r.seconds:.2f} s, {r.tokens_per_s:.1f} tok/s; "
            f"roofline {r.bound_s:.2f} s ({r.bound_s / r.seconds:.0%}), the workload's "
            f"{r.needed_s:.2f} s ({r.needed_s / r.seconds:.0%}); {r.preemptions} preemptions, "
            f"{r.stalls}"
        )
    median = sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]
    cache_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    breakdown = step_breakdown(median, cost, rates)
    first_breakdown = step_breakdown(runs[0], cost, rates)
    if args.json_out is not None:  # the median run's, their range, the first's, both by kind
        figures = {"start_s": start_s, "load_s": engine.runner.load_seconds}
        figures |= {"output_tokens": median.tokens, "seconds": median.seconds}
        figures |= {"tok_s": median.tokens_per_s, "roofline_share": median.bound_s / median.seconds}
        figures |= {"workload_roofline_share": median.needed_s / median.seconds}
        figures |= {"preemptions": median.preemptions, "kv_cache_tokens": cache_tokens}
        figures |= extremes("preemptions", [r.preemptions for r in runs])
        figures |= {"stalls": [vars(r.stalls) for r in runs]}  # each run's, in order
        figures |= extremes("seconds", [r.seconds for r in runs])
        figures |= extremes("tok_s", [r.tokens_per_s for r in runs])
        figures |= extremes("roofline_share", [r.bound_s / r.seconds for r in runs])
        figures |= {"first_tok_s": runs[0].tokens_per_s, "first_seconds": runs[0].seconds}
        figures |= {"steps": {kind: vars(t) for kind, t in breakdown.items()}}
        figures |= {"first_steps": {kind: vars(t) for kind, t in first_breakdown.items()}}
        args.json_out.write_text(json.dumps(figures))
    profile_table = None
    if args.profile_steps:
        profile_table = profile_steps(
            lambda: run_workload(args.runs, label_steps=True)[1], cost, rates
        )
    engine.close()
    peer = None
    if args.peer:
        vocab_size = engine.vocab_size
        del engine
        torch.cuda.empty_cache()
        requests = workload(args.num_requests, vocab_size, args.min_len, args.max_len)
        peer = bench_transformers(args.model, requests[: args.peer_requests], args.peer_batch_size)
    how_sampled = f", {len(constrained)} constrained by a JSON schema" if constrained else ""
    if sampling.temperature > 0:
        how_sampled += f", sampled at temperature {sampling.temperature:g}"
        how_sampled += f" within top-p {sampling.top_p:g}" if sampling.top_p < 1 else ""
        how_sampled += f" and top-k {sampling.top_k}" if sampling.top_k else ""
    if sampling.repetition_penalty != 1:
        how_sampled += f", repetition penalty {sampling.repetition_penalty:g}"
    print(
        f"\n{args.model}: {args.num_requests} requests, lengths uniform in "
        f"[{args.min_len}, {args.max_len}], ignore_eos{how_sampled}, device {args.device}, "
        f"tensor parallel {args.tensor_parallel_size}; engine start {start_s:.1f} s; "
        f"KV cache {cache_tokens} tokens; measured {rates.describe()}"
    )
    print(
        f"{'':28} {'output tokens':>14} {'seconds':>11} {'tok/s':>15} {'% of roofline':>14} "
        f"{'% of the workload':>18}"
    )
    rows = [
        ("tandem, first run", runs[:1]),
        (f"tandem, median of {len(runs)}", [median]),
        (f"tandem, range of {len(runs)}", runs),
    ]
    for name, rs in rows:
        print(
            f"{name:28} {spread([r.tokens for r in rs], 'd'):>14} "
            f"{spread([r.seconds for r in rs], '.2f'):>11} "
            f"{spread([r.tokens_per_s for r in rs], '.1f'):>15} "
            f"{spread([r.bound_s / r.seconds for r in rs], '.0%'):>14} "
            f"{spread([r.needed_s / r.seconds for r in rs], '.0%'):>18}"
        )
    note = uneven_routing_note(cost, [r.bound_s / r.seconds for r in runs])
    if note is not None:
        print(note)
    if peer is not None:
        tokens, seconds = peer
        print(f"{'transformers generate':28} {tokens:14d} {seconds:11.2f} {tokens / seconds:15.1f}")
    print_step_breakdown(breakdown, first_breakdown)
    if profile_table is not None:
        print(profile_table)


if __name__ == "__main__":
    main()
