"""Start-up time and single-request latency of a real engine process, over its socket.

    python scripts/bench_latency.py [--model M] [--device cpu|cuda] [--prompt-len 128]
                                    [--output-len 256] [--peer] [--enforce-eager]
                                    [--tensor-parallel-size N] [--load-format dummy]
                                    [--json-out FILE]

Measures, for one `python -m engine` process: start time (process start to the
handshake reply, i.e. weights loaded and serving), time to first token, and time
per output token for one request of random token ids (seeds 0, 1, …: a new prompt each
run, so no run finds another's prefix cached; ignore_eos). With
--peer, Hugging Face transformers' own generate() runs on the same weights and
device in the same run, for comparison. On CUDA it also prints the decode step's
memory-bandwidth floor and TPOT as a fraction of it; at --tensor-parallel-size N the floor
is that of N GPUs, each reading its share of the weights. --json-out writes the figures to
FILE too (scripts/bench_tensor_parallel.py reads them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq
from tokenizers import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    SamplingParams,
    TokenOutputs,
    decode_message,
)


def random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def bench_engine(args: argparse.Namespace) -> dict[str, float]:
    workdir = tempfile.mkdtemp(prefix="tandem-bench-")
    address = f"ipc://{workdir}/engine.sock"
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
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    started = time.perf_counter()
    engine = subprocess.Popen(command, cwd=REPO_ROOT)
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
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median(r[1] for r in runs)
    result = {"start_s": start_s, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3}
    if prefix:
        result["cold_ttft_ms"] = runs[0][0] * 1e3
        result["cached_ttft_ms"] = statistics.median(r[0] for r in runs[1:]) * 1e3
    return result


def _one_request(
    socket: zmq.Socket, prompt: list[int], output_len: int, request_id: str
) -> tuple[float, float]:
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sent = time.perf_counter()
    socket.send(GenerateRequest(request_id, prompt, sampling).encode())
    token_times: list[float] = []
    while True:
        message = decode_message(socket.recv())
        if isinstance(message, ErrorReply):
            raise RuntimeError(message.message)
        assert isinstance(message, TokenOutputs)
        now = time.perf_counter()
        for output in message.outputs:
            token_times.extend(now for _ in output.new_token_ids)
            if output.finish_reason is not None:
                assert len(token_times) == output_len, (len(token_times), output.finish_reason)
                ttft = token_times[0] - sent
                return ttft, (token_times[-1] - token_times[0]) / (output_len - 1)


def bench_transformers(args: argparse.Namespace) -> dict[str, float]:
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
    return {
        "start_s": load_s,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": (total - ttft) / (args.output_len - 1) * 1e3,
    }


def bandwidth_floor_ms(model: str, num_gpus: int = 1) -> tuple[float, float]:
    """The least time a decode step can take on ``num_gpus`` of these GPUs: every weight the
    step reads (all but the embedding table, of which it reads one row per token; a tied
    table is read whole as the LM head), in bf16, split evenly over the GPUs, each reading
    its share at the device-to-device copy bandwidth measured here on one. Returns (floor
    in ms, one GPU's bandwidth in GB/s)."""
    from engine.backends import create_backend
    from engine.models import build_model, load_checkpoint

    config = load_checkpoint(model).config
    meta_device = torch.device("meta")
    backend = create_backend("torch", meta_device)
    meta = build_model(config, *backend, 1, meta_device, torch.bfloat16)
    params = sum(p.numel() for p in meta.parameters())
    if not config.tie_word_embeddings:
        params -= meta.embed_tokens.weight.numel()
    weight_bytes = params * torch.bfloat16.itemsize

    source = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    target = torch.empty_like(source)
    target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    copies = 20
    for _ in range(copies):
        target.copy_(source)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    bandwidth = 2 * source.nbytes * copies / seconds  # each copy reads and writes
    return weight_bytes / num_gpus / bandwidth * 1e3, bandwidth / 1e9


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
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
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (engine's)")
    parser.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"], help="the engine's"
    )
    parser.add_argument("--json-out", type=Path, help="also write the figures here")
    args = parser.parse_args()

    if args.shared_prefix_len and args.runs < 2:
        parser.error("--shared-prefix-len needs --runs 2 or more: the first run is the cold one")
    rows = [("tandem engine", bench_engine(args))]
    if args.shared_prefix_len:
        ours = rows[0][1]
        print(
            f"\nshared prefix of {args.shared_prefix_len} tokens + {args.prompt_len} new: "
            f"tandem TTFT {ours['cold_ttft_ms']:.1f} ms cold, "
            f"{ours['cached_ttft_ms']:.1f} ms with the prefix cached (median of {args.runs - 1})"
        )
    if args.peer:
        rows.append(("transformers generate", bench_transformers(args)))
    print(
        f"\nmodel {args.model}, device {args.device}, tensor parallel {args.tensor_parallel_size}"
        f", prompt {args.prompt_len} tokens, {args.output_len} new tokens, "
        f"median of {args.runs} runs"
    )
    print(f"{'':24} {'start (s)':>10} {'TTFT (ms)':>10} {'TPOT (ms)':>10} {'tok/s':>8}")
    for name, r in rows:
        print(
            f"{name:24} {r['start_s']:10.2f} {r['ttft_ms']:10.1f} {r['tpot_ms']:10.2f} "
            f"{1e3 / r['tpot_ms']:8.1f}"
        )
    print(
        "(transformers' start is its from_pretrained time in this process, not a process start)"
        if args.peer
        else ""
    )
    ours = rows[0][1]
    if args.device == "cuda":
        floor_ms, bandwidth = bandwidth_floor_ms(args.model, args.tensor_parallel_size)
        ours |= {"floor_ms": floor_ms, "floor_share": floor_ms / ours["tpot_ms"]}
        print(
            f"bandwidth floor: {floor_ms:.2f} ms per token (weights over "
            f"{args.tensor_parallel_size} x {bandwidth:.0f} GB/s measured copy bandwidth); "
            f"tandem TPOT at {ours['floor_share']:.0%} of the floor"
        )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(ours))


if __name__ == "__main__":
    main()
