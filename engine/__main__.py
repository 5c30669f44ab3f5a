"""``python -m engine --model M --address ipc://… | tcp://…``: load a model and serve it."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.checkpoint import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a Hugging Face directory, a .gguf file, or the default model's name",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the checkpoint's)",
    )
    parser.add_argument(
        "--address",
        default="ipc:///tmp/tandem-engine.sock",
        help="ZeroMQ address to bind: ipc://PATH or tcp://HOST:PORT",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="auto",
        help="weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="memory for the KV cache (default: 1 GiB on CPU; on CUDA, what "
        "--gpu-memory-utilization leaves)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact KV cache size in blocks"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: no CUDA graphs for decode steps (faster start, slower decode)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of prompts' common prefixes (default: on)",
    )
    parser.add_argument(
        "--overlap-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each step before reading the last one's tokens, hiding the host's "
        "work behind the device's (default: on for CUDA, off on CPU)",
    )
    parser.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between throughput log lines (0: none)",
    )
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s",
    )
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.service import EngineService

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching,
            served_model_name=args.served_model_name,
            overlap_steps=args.overlap_steps,
        )
    )
    service = EngineService(engine, args.address, args.stats_interval)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: service.stop_event.set())
    service.serve_forever()
    logging.getLogger("engine").info("engine stopped")
    sys.exit(0)


if __name__ == "__main__":
    main()
