"""Where a decode step's time goes: wall time, device kernel time, and the host's share.

    python scripts/profile_step.py --model DIR [--batch 1 --batch 256] [--context 512]
                                   [--steps 20] [--rounds 1] [--prefill]
                                   [--quantization fp8] [--load-format dummy]
                                   [--tensor-parallel-size N]

For each batch size, BATCH requests of CONTEXT random prompt tokens are prefilled, then
decode steps run through the engine as in serving (scheduler, input packing, CUDA-graph
replay, sampling, the one read-back). Prints, per step: the wall time (unprofiled; with
--rounds R, the median of R rounds of STEPS steps and their range, the device synchronized
around each round: a batch-1 step's time to compare two trees by), the host's time by
phase (unprofiled, timed around the engine's methods; with overlapped steps the host is the
bottleneck when it waits for the device less than it works: a large batch's step can be), how
many forward passes the host launched only after the device had finished the step before
(the device idle until then: those steps' pace is the host's), the device's step by CUDA
events without the profiler (the forward pass, the sampling, and from there to the next
forward pass: what a graph's launch and the inputs' copy cost outside the profiler; the
events may cut a dependent launch's overlap around them by a few µs),
the device's kernel time (from torch.profiler, over as many more steps), the difference
(host work and launch gaps the GPU waits through), where the device sits idle (its gaps
between kernels, by the kernel after each), the kernels that take the most device time, and
the host functions that take the most time under cProfile. Where kernels are launched dependent
(the Triton backend on compute capability 9.0 and up), each kernel's time includes its wait
for the one before, so they sum to more than the step and a kernel after a long one looks
long: ``TANDEM_PDL=0`` launches them plainly, to time each alone. There a last table gives
each kernel's share of the device's span instead (from the latest end of a kernel before it
to its own end), which adds up to the step: what each kernel's place in the chain costs.
On CPU only host times exist. With tensor parallelism the kernels are rank 0's (the
engine's process), its all-reduces' time including its waits for the other ranks.

--prefill profiles time to first token instead: BATCH requests (default 1) of CONTEXT new
random tokens admitted together, from their admission to the last one's first token, as many
times (``--prefill --batch 16 --context 512``: one step of 8,192 prompt tokens).
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine.backends.triton.dependent_launch import launch_options
from engine.config import EngineConfig
from engine.execution.model_runner import LaunchedStep
from engine.llm_engine import LLMEngine
from engine.quantization.linear_methods import QUANTIZATION_METHODS
from protocol import SamplingParams

# New tokens a request may make: more than prefilling the whole batch and the profiled
# steps take, so the batch stays whole.
MAX_NEW_TOKENS = 1024


def dependent_launches(device: torch.device) -> bool:
    """Whether the Triton backend's kernels are launched dependent on this device."""
    return bool(launch_options(device))


def start_requests(engine: LLMEngine, batch: int, context: int) -> None:
    """Admit ``batch`` requests and run their prefills, leaving them all decoding."""
    generator = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (context,), generator=generator).tolist()
        sampling = SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        engine.add_request(b"profile", f"{batch}-{i}", prompt, sampling)
    # Until every prompt is computed (a request has its first token), chunks and all.
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()  # no step left in flight


def profile_batch(
    engine: LLMEngine, batch: int, context: int, steps: int, rounds: int, top: int
) -> None:
    start_requests(engine, batch, context)
    for _ in range(steps):  # warm-up decodes: the first few after the prefills run slow
        engine.step()
    activities = [ProfilerActivity.CPU]
    cuda = engine.device.type == "cuda"
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    # Wall time unprofiled: the profiler's own bookkeeping slows the host side.
    timed_from = contexts(engine)
    round_ms = []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize(engine.device)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(engine.device)
        round_ms.append((time.perf_counter() - started) * 1e3 / steps)
    wall_ms = statistics.median(round_ms)
    phase_ms, late_launches, launches = host_phases(engine, steps)
    device_ms = device_phases(engine, steps) if cuda else None
    profiled_from = contexts(engine)
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            engine.step()
    host_profile = cProfile.Profile()
    with host_profile:
        for _ in range(steps):
            engine.step()
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    spread = f", median of {rounds} rounds: {min(round_ms):.4f}-{max(round_ms):.4f}"
    print(
        f"\nbatch {batch}, context {context}: {wall_ms:.4f} ms per decode step "
        f"(wall{spread if rounds > 1 else ''})"
    )
    # Each step adds a token to every context: the kernels below ran at longer contexts than
    # the prompts' (a decode's attention reads that many more keys).
    print(
        f"  contexts: {timed_from} tokens at the timed rounds' start, {profiled_from} at the "
        f"profiled steps' start, {steps} more at their end"
    )
    waiting = phase_ms.pop("waiting for the device")
    busy = sum(phase_ms.values())
    print(
        f"  the host busy {busy:.3f} ms per step, waiting for the device {waiting:.3f}: "
        + ", ".join(f"{name} {ms:.3f}" for name, ms in phase_ms.items())
    )
    if cuda and engine.overlap_steps:
        print(
            f"  {late_launches} of {launches} forward passes launched after the device had "
            "finished the step in flight (the host set their pace)"
        )
    if device_ms is not None:
        print(
            "  the device's step by CUDA events (no profiler): "
            + ", ".join(f"{name} {ms:.4f}" for name, ms in device_ms.items())
        )
    report(profiler, host_profile, wall_ms, steps, top, cuda)


def contexts(engine: LLMEngine) -> str:
    """The running requests' context lengths (tokens), as "least-most" or one number."""
    lengths = [request.num_tokens for request in engine.requests.values()]
    least, most = min(lengths), max(lengths)
    return str(least) if least == most else f"{least}-{most}"


@contextmanager
def _replaced(owner: object, name: str, replacement: Callable[..., object]) -> Iterator[None]:
    """``owner.name`` is ``replacement`` until the block ends."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if isinstance(owner, type):
            setattr(owner, name, original)
        else:
            delattr(owner, name)  # the instance's own attribute: its class's method again


def _timed(owner: object, name: str, add: Callable[[float], None]) -> Iterator[None]:
    """Time each call of ``owner.name`` into ``add``, until the block ends."""
    original = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        result = original(*args, **kwargs)
        add(time.perf_counter() - started)
        return result

    return _replaced(owner, name, timed)


def host_phases(engine: LLMEngine, steps: int) -> tuple[dict[str, float], int, int]:
    """ms per step over ``steps`` steps: the host's time in each phase of a step (the rest of
    ``step()`` as "other"), and its wait for the step in flight's results, apart; then how
    many of the steps' forward passes were launched after the device had finished the step in
    flight (on CUDA with overlapped steps: the host set the pace of those), of how many."""
    totals = dict.fromkeys(
        ["schedule", "pack", "launch", "sample", "read results", "waiting for the device"], 0.0
    )
    # Launches that found the device done with the step in flight (its results' copy to
    # the host complete): it sat idle from then until this launch, but for the step's input
    # copy and pending-token fill, which packing queued just before. Counted at
    # ``run_model``'s entry.
    launches = {"found it done": 0, "all": 0}

    def adder(phase: str) -> Callable[[float], None]:
        def add(seconds: float) -> None:
            totals[phase] += seconds

        return add

    run_model = engine.runner.run_model

    def launch(inputs: object) -> object:
        """``run_model``, timed as "launch", its launches counted."""
        started = time.perf_counter()
        in_flight = engine.in_flight
        launches["all"] += 1
        if in_flight is not None and in_flight.copied is not None and in_flight.copied.query():
            launches["found it done"] += 1
        logits = run_model(inputs)
        totals["launch"] += time.perf_counter() - started
        return logits

    result = LaunchedStep.result

    def waited_result(step: LaunchedStep) -> object:
        if step.copied is not None:  # the wait apart, before the read finds it done
            started = time.perf_counter()
            step.copied.synchronize()
            totals["waiting for the device"] += time.perf_counter() - started
        return result(step)

    runner = engine.runner
    with (
        _timed(engine.scheduler, "schedule", adder("schedule")),
        _timed(runner, "step_inputs", adder("pack")),
        _replaced(runner, "run_model", launch),
        _timed(runner, "sample", adder("sample")),
        _timed(engine, "_read_results", adder("read results")),
        _replaced(LaunchedStep, "result", waited_result),
    ):
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        elapsed = time.perf_counter() - started
    # Reading results includes the wait, which is not the host's work.
    totals["read results"] -= totals["waiting for the device"]
    totals["other"] = elapsed - sum(totals.values())
    phase_ms = {phase: seconds * 1e3 / steps for phase, seconds in totals.items()}
    return phase_ms, launches["found it done"], launches["all"]


def device_phases(engine: LLMEngine, steps: int) -> dict[str, float]:
    """ms per step on the device's own clock, from CUDA events recorded in the stream around
    the forward pass (``run_model``: a decode step's graph inputs filled and its graph
    replayed) and after the sampling (its kernels and the tokens' copy to the host): the
    forward pass, the sampling, and from one step's sampling to the next one's forward pass
    (the inputs' copy, the pending tokens' fill, and any time the device waited for the
    host). No profiler runs: a graph's launch costs what it costs in serving."""
    runner = engine.runner
    marks: list[tuple[str, torch.cuda.Event]] = []

    def mark(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    run_model, sample = runner.run_model, runner.sample

    def marked_run_model(inputs: object) -> object:
        mark("forward")
        logits = run_model(inputs)
        mark("sampling")
        return logits

    def marked_sample(*args: object) -> object:
        launched = sample(*args)
        mark("to the next step")
        return launched

    with (
        _replaced(runner, "run_model", marked_run_model),
        _replaced(runner, "sample", marked_sample),
    ):
        for _ in range(steps):
            engine.step()
    torch.cuda.synchronize(engine.device)
    # Each mark starts the phase it names, which the next mark ends (the last one's, no mark).
    phases: dict[str, list[float]] = {"forward": [], "sampling": [], "to the next step": []}
    for (name, start), (_, end) in itertools.pairwise(marks):
        phases[name].append(start.elapsed_time(end))
    return {name: statistics.mean(ms) for name, ms in phases.items() if ms}


def first_tokens(engine: LLMEngine, prompts: list[list[int]], name: str) -> None:
    """Requests admitted together, from admission to the last one's first token (then
    aborted)."""
    keys = [(b"profile", f"{name}-{i}") for i in range(len(prompts))]
    for (client, request_id), prompt in zip(keys, prompts, strict=True):
        sampling = SamplingParams(max_tokens=2, ignore_eos=True)
        engine.add_request(client, request_id, prompt, sampling)
    while not all(engine.requests[key].output_token_ids for key in keys):
        engine.step()
    for client, request_id in keys:
        engine.abort(client, request_id)
    engine.sync()


def profile_prefill(engine: LLMEngine, context: int, batch: int, repeats: int, top: int) -> None:
    """Time to first token of ``batch`` CONTEXT-token prompts admitted together (the steps
    that prefill them, in chunks of the step's token budget), nothing cached (random
    tokens)."""
    generator = torch.Generator().manual_seed(1)

    def prompts() -> list[list[int]]:
        return [
            torch.randint(0, engine.vocab_size, (context,), generator=generator).tolist()
            for _ in range(batch)
        ]

    first_tokens(engine, prompts(), "warm-up")
    timings = []
    for i in range(repeats):
        started = time.perf_counter()
        first_tokens(engine, prompts(), f"timed-{i}")
        timings.append((time.perf_counter() - started) * 1e3)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        for i in range(repeats):
            first_tokens(engine, prompts(), f"profiled-{i}")
    host_profile = cProfile.Profile()
    with host_profile:
        for i in range(repeats):
            first_tokens(engine, prompts(), f"cprofiled-{i}")
    wall_ms = statistics.median(timings)
    print(
        f"\nprefill of {batch} x {context} tokens to the first tokens: {wall_ms:.3f} ms (wall, "
        f"median of {repeats}; {min(timings):.3f}-{max(timings):.3f})"
    )
    report(profiler, host_profile, wall_ms, repeats, top, cuda)


def report(
    profiler: profile,
    host_profile: cProfile.Profile,
    wall_ms: float,
    steps: int,
    top: int,
    cuda: bool,
) -> None:
    """Per step: kernel time against the wall time, the top kernels, the top host functions."""
    events = profiler.key_averages()
    if cuda:  # the kernels themselves: the ops that launched them would count them again
        events = [e for e in events if e.device_type == DeviceType.CUDA]
    if cuda:
        kernel_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
        print(
            f"  device kernels {kernel_ms:.3f} ms per step; host and launch gaps "
            f"{wall_ms - kernel_ms:.3f} ms ({(wall_ms - kernel_ms) / wall_ms:.0%} of the step)"
        )
        key = "self_device_time_total"
    else:
        key = "self_cpu_time_total"
    if cuda:
        kernels = [
            (event.name, event.time_range.start, event.time_range.end)
            for event in profiler.events()
            if event.device_type == DeviceType.CUDA
        ]
        print_idle_gaps(kernels, steps, top)
        if dependent_launches(torch.device("cuda")):
            # Kernels launched dependent start before the one ahead ends and wait for it:
            # their spans overlap and sum to more than the step.
            print(
                "  (kernels launched dependent: each one's time includes its wait for the "
                "kernel before; TANDEM_PDL=0 times them one after another)"
            )
            print_chain_shares(kernels, steps, top)
    print(f"  {'ms per step':>11}  {'calls':>6}  name")
    for event in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]:
        print(
            f"  {getattr(event, key) / 1e3 / steps:11.4f}  {event.count // steps:6d}  "
            f"{event.key[:90]}"
        )
    print_host_functions(host_profile, steps, top)


def idle_before(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """The device's idle time (no kernel running) before each kernel, summed by the kernel's
    name: ``kernels`` are (name, start, end), in any order. A kernel that starts while another
    still runs (dependent launches, other streams) waits for nothing."""
    idle: dict[str, float] = {}
    busy_until: float | None = None
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        if busy_until is not None and start > busy_until:
            idle[name] = idle.get(name, 0.0) + start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    return idle


def chain_shares(kernels: list[tuple[str, float, float]]) -> dict[str, tuple[float, int]]:
    """What each kernel adds to the device's span, summed by name, with the count of kernels
    of that name: ``kernels`` are (name, start, end), in any order. Taken in the order they
    end, each adds the time from the latest end before its own to its end (idle time before it
    included), nothing if it ends within a kernel that ended later. Where kernels are launched
    dependent, their own spans include their waits for the kernel before and overlap; these
    shares do not, and add up to the device's span: a kernel's share is what removing its
    place in the chain could save, at most."""
    shares: dict[str, tuple[float, int]] = {}
    done_at: float | None = None
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[2]):
        share = max(end - (start if done_at is None else done_at), 0.0)
        total, count = shares.get(name, (0.0, 0))
        shares[name] = (total + share, count + 1)
        done_at = end if done_at is None else max(done_at, end)
    return shares


def print_chain_shares(kernels: list[tuple[str, float, float]], steps: int, top: int) -> None:
    """Each kernel's share of the step's span (``chain_shares``), the largest first, with the
    mean share of one launch: the kernels whose place in a batch-1 chain costs the most."""
    shares = chain_shares(kernels)
    span = sum(total for total, _ in shares.values())
    print(f"  the kernels' shares of the device's span, {span / 1e3 / steps:.3f} ms per step:")
    print(f"  {'ms per step':>11}  {'calls':>6}  {'us a call':>9}  name")
    for name, (total, count) in sorted(shares.items(), key=lambda item: -item[1][0])[:top]:
        print(
            f"  {total / 1e3 / steps:11.4f}  {count // steps:6d}  {total / count:9.2f}  {name[:80]}"
        )


def print_idle_gaps(kernels: list[tuple[str, float, float]], steps: int, top: int) -> None:
    """Where the device waits: its idle time per step, by the kernel that ends each wait (the
    first kernel of a step after the host's work, a kernel launched without dependence after
    the one before it drained). ``kernels`` are (name, start, end)."""
    idle = idle_before(kernels)
    print(
        f"  the device idle between kernels {sum(idle.values()) / 1e3 / steps:.3f} ms per "
        "step; by the kernel after the wait:"
    )
    for name, idle_us in sorted(idle.items(), key=lambda item: item[1], reverse=True)[:top]:
        print(f"  {idle_us / 1e3 / steps:11.4f}          {name[:90]}")


def print_host_functions(host_profile: cProfile.Profile, steps: int, top: int) -> None:
    """The host's own time per step by function (cProfile's, which inflates it)."""
    stats = pstats.Stats(host_profile).stats  # (file, line, name) -> (cc, calls, tottime, ...)
    total_ms = sum(row[2] for row in stats.values()) * 1e3 / steps
    print(f"  host time per step under cProfile: {total_ms:.3f} ms; functions by own time:")
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (file, line, name), (_, calls, own_s, *_) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        print(f"  {own_s * 1e3 / steps:11.4f}  {calls // steps:6d}  {where[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--batch", type=int, action="append", help="repeatable (default 1, 256; --prefill: 1)"
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds of STEPS steps")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, help="the engine's")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--prefill", action="store_true", help="time to first token instead")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="profiles rank 0, the engine's"
    )
    args = parser.parse_args()
    batches = args.batch or [1, 256]
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=max(batches),
            max_model_len=args.context + MAX_NEW_TOKENS,
            enforce_eager=args.enforce_eager,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            load_format=args.load_format,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    )
    if args.prefill:
        for batch in args.batch or [1]:
            profile_prefill(engine, args.context, batch, args.steps, args.top)
        return
    for batch in batches:
        profile_batch(engine, batch, args.context, args.steps, args.rounds, args.top)


if __name__ == "__main__":
    main()
