"""Start-up time and single-request latency of a real engine process, over its socket.

    tandem bench latency [--model M] [--device cpu|cuda] [--prompt-len 128]
                         [--output-len 256] [--peer] [--enforce-eager]
                         [--tensor-parallel-size N] [--load-format dummy]
                         [--kv-cache-dtype fp8] [--quantization fp8|int8]
                         [--json-out FILE]

Measures, for one `python -m engine` process: start time (process start to the
handshake reply, i.e. weights loaded and serving), time to first token, and time
per output token for one request of random token ids (seeds 0, 1, …: a new prompt each
run, so no run finds another's prefix cached; ignore_eos), --runs times one after the
other: the first run, the median and the range of each figure over the runs (least to
greatest; a figure alike in every run printed once) are printed. With --peer, Hugging Face
transformers' own generate() runs on the same weights and device in the same run, for
comparison.

The roofline (engine/roofline.py): the device's copy bandwidth and GEMM rate are measured
before the engine starts; the engine writes the shape of every step it ran
(``--step-record``); each run's TTFT and TPOT are printed against the least time its own
steps can take (per step the larger of bytes over bandwidth and FLOPs over GEMM rate). At
--tensor-parallel-size N the bound is that of N GPUs, each reading and computing its share
in parallel (the collectives between them are not counted). --json-out writes the median
run's figures to FILE too, and their least and greatest over the runs (ttft_ms_min,
ttft_ms_max, tpot_ms_min, tpot_ms_max, floor_share_min, floor_share_max;
tandem/bench/tensor_parallel.py reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from tokenizers import Tokenizer

from engine.execution.model_runner import resolve_kv_cache_dtype
from engine.quantization.linear_methods import QUANTIZATION_METHODS
from engine.roofline import (
    DeviceRates,
    ModelCost,
    StepShape,
    load_steps,
    measure_rates,
    run_bound,
    uneven_routing_note,
)
from protocol import (
    PROTOCOL_VERSION,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    SamplingParams,
    TokenOutputs,
    build_codecs,
    decode_message,
)
from tandem.bench.offline import extremes, spread


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@dataclass
class Latency:
    ttft_s: float
    tpot_s: float

    @property
    def tokens_per_s(self) -> float:
        return 1 / self.tpot_s


def bench_engine(args: argparse.Namespace) -> tuple[float, list[Latency], list[StepShape]]:
    """Start an engine process, time --runs requests one after the other, stop it: its start
    time, each run's latencies, and the steps it ran."""
    workdir = tempfile.mkdtemp(prefix="tandem-bench-")
    address = f"ipc://{workdir}/engine.sock"
    step_record = f"{workdir}/steps.json"
    command = [
        sys.executable,
        "-m",
        "engine",
        "--address",
        address,
        "--model",
        args.model,
        "--device",
        args.device,
        "--log-level",
        "warning",
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--load-format",
        args.load_format,
        "--step-record",
        step_record,
        *(["--enforce-eager"] if args.enforce_eager else []),
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        *(["--quantization", args.quantization] if args.quantization else []),
    ]
    build_codecs()  # as a server does at start: the first run's TTFT is the engine's
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    started = time.perf_counter()
    engine = subprocess.Popen(command)
    try:
        socket.send(HandshakeRequest(PROTOCOL_VERSION, "bench").encode())
        reply = decode_message(socket.recv())
        start_s = time.perf_counter() - started
        assert isinstance(reply, HandshakeReply), reply
        vocab_size = Tokenizer.from_str(reply.tokenizer_json).get_vocab_size()
        # A new prompt each run (a repeated one would find its prefix in the engine's
        # cache), after the shared prefix, if any: that one is cached from the second run on.
        prefix = random_prompt(vocab_size, args.shared_prefix_len, seed=12345)
        runs = [
            _one_request(
                socket,
                prefix + random_prompt(vocab_size, args.prompt_len, i),
                args.output_len,
                f"r{i}",
            )
            for i in range(args.runs)
        ]
    finally:
        engine.terminate()
        engine.wait()
    return start_s, runs, load_steps(step_record)


def split_runs(steps: list[StepShape]) -> list[list[StepShape]]:
    """The steps of one request after another: a request's first step starts below where
    the last step left the cache (its prompt is new), every other step where it left it."""
    runs: list[list[StepShape]] = []
    last_context = None
    for step in steps:
        assert len(step.query_lens) == 1, "one request at a time"
        cached = int(step.context_lens[0] - step.query_lens[0])
        if last_context is None or cached < last_context:
            runs.append([])
        runs[-1].append(step)
        last_context = int(step.context_lens[0])
    return runs


def roofline_latency(
    steps: list[StepShape], cost: ModelCost, rates: DeviceRates, output_len: int
) -> Latency:
    """The least TTFT (the steps up to the one that samples the first token) and TPOT (the
    rest, a token each) of one request's steps."""
    first = next(i for i, s in enumerate(steps) if s.num_logits) + 1
    decode = steps[first:]
    assert len(decode) == output_len - 1, (len(decode), output_len)
    return Latency(
        run_bound(steps[:first], cost, rates), run_bound(decode, cost, rates) / len(decode)
    )


def _one_request(
    socket: zmq.Socket, prompt: list[int], output_len: int, request_id: str
) -> Latency:
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sent = time.perf_counter()
    socket.send(GenerateRequest(request_id, prompt, sampling).encode())
    token_times: list[float] = []
    while True:
        message = decode_message(socket.recv())
        if isinstance(message, ErrorReply):
            raise RuntimeError(message.message)
        if isinstance(message, EngineStats):  # the engine's heartbeat, every second
            continue
        assert isinstance(message, TokenOutputs), message
        now = time.perf_counter()
        for output in message.outputs:
            token_times.extend(now for _ in output.new_token_ids)
            if output.finish_reason is not None:
                assert len(token_times) == output_len, (len(token_times), output.finish_reason)
                ttft = token_times[0] - sent
                return Latency(ttft, (token_times[-1] - token_times[0]) / (output_len - 1))


def bench_transformers(args: argparse.Namespace) -> tuple[float, Latency]:
    """transformers' generate() on the same weights: the peer."""
    from transformers import AutoModelForCausalLM

    from engine.checkpoint.resolve import CheckpointFormat, resolve_model

    resolved = resolve_model(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    started = time.perf_counter()
    if resolved.format is CheckpointFormat.GGUF:
        model = AutoModelForCausalLM.from_pretrained(
            str(resolved.path.parent), gguf_file=resolved.path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=dtype)
    model = model.to(args.device).eval()
    load_s = time.perf_counter() - started
    prompt = torch.tensor(
        [random_prompt(model.config.vocab_size, args.prompt_len)], device=args.device
    )

    def generate(new_tokens: int) -> float:
        _synchronize(args.device)
        begin = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        _synchronize(args.device)
        return time.perf_counter() - begin

    generate(8)  # warm-up
    ttft = statistics.median(generate(1) for _ in range(args.runs))
    total = statistics.median(generate(args.output_len) for _ in range(args.runs))
    return load_s, Latency(ttft, (total - ttft) / (args.output_len - 1))


def model_cost(
    model: str, dtype: torch.dtype, kv_dtype: torch.dtype, quantization: str | None
) -> ModelCost:
    """The cost of the model the engine loads, built on the meta device: no weights read
    (quantized linear layers: one byte a weight)."""
    from engine.backends import create_backend
    from engine.models import build_model, load_checkpoint
    from engine.quantization.linear_methods import resolve_quantization

    config = load_checkpoint(model).config
    meta = torch.device("meta")
    config = dataclasses.replace(
        config, quantization=resolve_quantization(quantization, config.quantization, meta)
    )
    return ModelCost.of_model(
        build_model(config, create_backend("torch", meta), 1, meta, dtype), kv_dtype
    )


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="put a prefix of this many tokens, the same in every run, before each prompt, "
        "and report TTFT with it cold (first run) and cached (the others)",
    )
    parser.add_argument("--peer", action="store_true", help="also time transformers")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, help="the engine's")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (engine's)")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="the engine's"
    )
    parser.add_argument(
        "--json-out", type=Path, help="also write the median's figures and their range here"
    )
    args = parser.parse_args(argv)

    if args.shared_prefix_len and args.runs < 2:
        parser.error("--shared-prefix-len needs --runs 2 or more: the first run is the cold one")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = measure_rates(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine process sizes its cache from what is free
    start_s, runs, steps = bench_engine(args)
    cost = model_cost(
        args.model, dtype, resolve_kv_cache_dtype(args.kv_cache_dtype, dtype), args.quantization
    )
    gpus = args.tensor_parallel_size
    bounds = [
        Latency(bound.ttft_s / gpus, bound.tpot_s / gpus)
        for bound in (roofline_latency(s, cost, rates, args.output_len) for s in split_runs(steps))
    ]
    assert len(bounds) == len(runs), (len(bounds), len(runs))

    def median(values: list[Latency]) -> Latency:
        return Latency(
            statistics.median(v.ttft_s for v in values),
            statistics.median(v.tpot_s for v in values),
        )

    # Each row's runs and their rooflines: its figures are the spread of those (one run: its own).
    rows: list[tuple[str, float, list[Latency], list[Latency] | None]] = [
        ("tandem, first run", start_s, runs[:1], bounds[:1]),
        (f"tandem, median of {len(runs)}", start_s, [median(runs)], [median(bounds)]),
        (f"tandem, range of {len(runs)}", start_s, runs, bounds),
    ]
    if args.peer:
        load_s, peer = bench_transformers(args)
        rows.append(("transformers generate", load_s, [peer], None))
    if args.shared_prefix_len:
        cached = [r.ttft_s * 1e3 for r in runs[1:]]
        print(
            f"\nshared prefix of {args.shared_prefix_len} tokens + {args.prompt_len} new: "
            f"tandem TTFT {runs[0].ttft_s * 1e3:.1f} ms cold, "
            f"{statistics.median(cached):.1f} ms with the prefix cached (median of "
            f"{args.runs - 1}, range {spread(cached, '.1f')})"
        )
    print(
        f"\nmodel {args.model}, device {args.device}, tensor parallel {gpus}, prompt "
        f"{args.prompt_len} tokens, {args.output_len} new tokens; measured {rates.describe()}"
    )
    print(
        f"{'':28} {'start (s)':>10} {'TTFT (ms)':>13} {'TPOT (ms)':>13} {'tok/s':>13}"
        f" {'TTFT roofline':>14} {'TPOT roofline':>14}"
    )
    for name, start, rs, bs in rows:
        line = (
            f"{name:28} {start:10.2f} {spread([r.ttft_s * 1e3 for r in rs], '.2f'):>13} "
            f"{spread([r.tpot_s * 1e3 for r in rs], '.3f'):>13} "
            f"{spread([r.tokens_per_s for r in rs], '.1f'):>13}"
        )
        if bs is not None:
            pairs = list(zip(rs, bs, strict=True))
            line += (
                f" {spread([b.ttft_s / r.ttft_s for r, b in pairs], '.0%'):>14}"
                f" {spread([b.tpot_s / r.tpot_s for r, b in pairs], '.0%'):>14}"
            )
        print(line)
    pairs = list(zip(runs, bounds, strict=True))
    shares = [b.ttft_s / r.ttft_s for r, b in pairs] + [b.tpot_s / r.tpot_s for r, b in pairs]
    note = uneven_routing_note(cost, shares)
    if note is not None:
        print(note)
    least, ours = median(bounds), median(runs)
    if args.json_out is not None:
        figures = {"start_s": start_s, "ttft_ms": ours.ttft_s * 1e3, "tpot_ms": ours.tpot_s * 1e3}
        figures |= {"floor_ms": least.tpot_s * 1e3, "floor_share": least.tpot_s / ours.tpot_s}
        figures |= extremes("ttft_ms", [r.ttft_s * 1e3 for r in runs])
        figures |= extremes("tpot_ms", [r.tpot_s * 1e3 for r in runs])
        shares = [b.tpot_s / r.tpot_s for r, b in zip(runs, bounds, strict=True)]
        figures |= extremes("floor_share", shares)
        args.json_out.write_text(json.dumps(figures))
    print(
        f"roofline: TTFT {least.ttft_s * 1e3:.2f} ms, TPOT {least.tpot_s * 1e3:.3f} ms "
        "(the least time the steps each run ran can take; % of roofline = that over the time)"
    )
    if args.peer:
        print(
            "(transformers' start is its from_pretrained time in this process, not a process start)"
        )


if __name__ == "__main__":
    main()
