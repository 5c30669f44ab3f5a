"""The host's share of a decode step, without the model: what a GPU waits through.

    tandem bench host-step [--batch 1 --batch 256] [--context 500] [--model DIR]
                           [--num-speculative-tokens K] [--repetition-penalty R]

BATCH requests of CONTEXT tokens are prefilled on the CPU, then decode steps run with the
forward pass and the sampler replaced by constant outputs, timing the engine's own Python
and numpy parts: scheduling, packing the inputs, the sampling parameters, and taking in
the new tokens. The model only shapes the cache: by default a tiny random Llama, quick to
prefill; it runs on the CPU. With --repetition-penalty R every request is penalized, and
"sampling params" includes adding each step's tokens to the counts kept on the device
(``engine/execution/seen_tokens.py``; on the CPU, with the tiny model's small vocabulary).

With --num-speculative-tokens K, verify steps of n-gram speculation instead: the prompts
repeat eight tokens and the model is replaced by logits that pick the next of them, so every
step drafts K tokens for every request and accepts them all. Timed: whole ``LLMEngine.step``
calls, and within them proposing, scheduling, packing (the forward pass is the packing and
a constant), launching the verify sampler (VerifyLayout, sampling, acceptance; on the CPU
its small tensor ops run as they are called) and reading the results.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.execution.batch import StepInputs, sampling_tensors
from engine.execution.model_runner import LaunchedStep
from engine.llm_engine import LLMEngine
from protocol import SamplingParams


def time_host_step(
    engine: LLMEngine, batch: int, context: int, steps: int, repetition_penalty: float = 1.0
) -> dict[str, float]:
    for i in range(batch):
        sampling = SamplingParams(
            max_tokens=steps + 64, ignore_eos=True, repetition_penalty=repetition_penalty
        )
        engine.add_request(b"bench", str(i), [5] * context, sampling)
    # Until every prompt is computed (a request has its first token), chunks and all.
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()  # no step left in flight
    runner, scheduler = engine.runner, engine.scheduler
    next_tokens = torch.full((batch,), 5)
    parts = dict.fromkeys(["schedule", "pack inputs", "sampling params", "process tokens"], 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        requests = scheduler.schedule()
        t1 = time.perf_counter()
        runner.step_inputs(requests)
        t2 = time.perf_counter()
        sampling_tensors(
            requests, engine.device, next_tokens, runner.eos_token_ids, runner.seen_tokens
        )
        t3 = time.perf_counter()
        for row, request in enumerate(requests):  # as launch() leaves them
            request.num_cached_tokens += request.num_scheduled_tokens
            request.add_pending_token(row)
        engine._read_results(LaunchedStep(requests, requests, [next_tokens], None, [], None))
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[name] += seconds
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    return {name: seconds * 1e3 / steps for name, seconds in parts.items()}


def time_verify_step(engine: LLMEngine, batch: int, context: int, steps: int) -> dict[str, float]:
    """Host milliseconds per verify step (every request K drafts, all accepted), by part."""
    k = engine.runner.verify_query_len - 1
    # The prompts repeat a cycle of K + 1 tokens: prompt lookup drafts what followed the
    # latest earlier occurrence of the last tokens, so a shorter cycle gives fewer than K.
    period = k + 1
    cycle = torch.arange(10, 10 + period)
    for i in range(batch):
        sampling = SamplingParams(max_tokens=(steps + 4) * (k + 1), ignore_eos=True)
        engine.add_request(b"bench", str(i), cycle.repeat(context // period).tolist(), sampling)
    runner = engine.runner

    def next_in_cycle(inputs: StepInputs) -> torch.Tensor:
        """Logits that pick the cycle's next token after each sampled one: drafts taken
        from the repeating prompt are all accepted."""
        tokens = inputs.input_ids[inputs.logits_index]
        logits = torch.zeros(tokens.shape[0], engine.vocab_size)
        logits[torch.arange(tokens.shape[0]), 10 + (tokens - 10 + 1) % period] = 1.0
        return logits

    runner.run_model = next_in_cycle  # type: ignore[method-assign]
    # Until every prompt is computed (a request has its first token), chunks and all: a
    # batch's prompts over the step's token budget take several steps.
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.step()  # a verify step left in flight, as every timed step leaves one
    # Each part: the object whose method it is, and the method, wrapped in a timer here.
    parts: dict[str, tuple[object, str]] = {
        "propose": (engine, "_propose"),
        "schedule": (engine.scheduler, "schedule"),
        "pack inputs": (runner, "step_inputs"),
        "launch sampler": (runner, "sample"),
        "read results": (engine, "_read_results"),
    }
    seconds = dict.fromkeys([*parts, "whole step"], 0.0)
    for name, (owner, method) in parts.items():
        original = getattr(owner, method)

        def timed(*args: object, _name: str = name, _original: Any = original) -> object:
            started = time.perf_counter()
            result = _original(*args)
            seconds[_name] += time.perf_counter() - started
            return result

        setattr(owner, method, timed)
    drafts = engine.num_draft_tokens
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        seconds["whole step"] += time.perf_counter() - started
    for owner, method in parts.values():
        delattr(owner, method)
    engine.sync()  # untimed: the last step's verify step
    assert engine.num_draft_tokens - drafts == (steps + 1) * batch * k, "a step verified < K"
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    del runner.run_model
    return {name: value * 1e3 / steps for name, value in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a checkpoint (default: a tiny random Llama)")
    parser.add_argument("--batch", type=int, action="append", help="repeatable (default 1, 256)")
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="time n-gram verify steps of K drafts each, all accepted (default: decode steps)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="every request's, as Qwen2.5's generation config asks (1.05); decode steps only",
    )
    args = parser.parse_args(argv)
    k = args.num_speculative_tokens
    batches = args.batch or [1, 256]
    torch.set_num_threads(1)  # the host path is single-threaded Python
    if args.model is None:
        from tandem.testing.random_checkpoint import save_tiny_llama

        args.model = tempfile.mkdtemp(prefix="tandem-tiny-llama-")
        save_tiny_llama(Path(args.model), num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            max_num_seqs=max(batches),
            max_model_len=args.context + (args.steps + 64) * (k + 1),
            kv_cache_memory_gb=1,
            # Every prompt in one step: timed steps start with every request decoding.
            max_num_batched_tokens=max(batches) * args.context,
            speculative_method="ngram" if k else None,
            num_speculative_tokens=max(k, 1),
            speculative_disable_by_batch_size=0,  # verify steps at every batch timed
            speculative_adaptive=False,  # k drafts every step, whatever they cost
            overlap_steps=True,  # as on CUDA
        )
    )
    penalty = args.repetition_penalty
    timer = time_verify_step if k else partial(time_host_step, repetition_penalty=penalty)
    rows = [(batch, timer(engine, batch, args.context, args.steps)) for batch in batches]
    names = [name for name in rows[0][1] if name != "whole step"]
    kind = f"verify step ({k} drafts a request, all accepted)" if k else "decode step"
    if not k and args.repetition_penalty != 1:
        kind += f", repetition penalty {args.repetition_penalty:g}"
    print(f"\nhost ms per {kind}, context {args.context}")
    print(f"{'batch':>6} " + " ".join(f"{n:>16}" for n in names) + f" {'total':>8}")
    for batch, parts in rows:
        cells = " ".join(f"{parts[n]:16.3f}" for n in names)
        total = parts.get("whole step", sum(parts.values()))
        print(f"{batch:6d} {cells} {total:8.3f}")


if __name__ == "__main__":
    main()
