"""Offline throughput: the workload the small engines publish.

    python scripts/bench_offline.py --model DIR [--num-requests 256] [--peer]
                                   [--peer-requests N] [--enforce-eager]
                                   [--structured-fraction F [--schema FILE|builtin]]
                                   [--tensor-parallel-size N] [--load-format dummy]
                                   [--json-out FILE]

256 requests with input and output lengths uniform in [100, 1024] (random token
ids, seed 0), ignore_eos, all submitted at once to an in-process engine. Prints
output tokens, seconds and output tokens per second. With --peer, Hugging Face
transformers' own batched generate() runs on the same weights and GPU in the same
run: prompts left-padded in batches of --peer-batch-size, each batch generating as
many tokens as its longest request; only the requested tokens are counted. With
--peer-requests N it runs the first N requests only (a random sample of the workload),
to keep its time in bounds; its tokens per second are then over those.

With --structured-fraction F, that share of the requests (spread evenly) is constrained by a
JSON schema (--schema: a file, or the builtin one, an object of string, number, enum, array
and boolean fields); its compile time, cold, is printed first, and the run finds it compiled.
The tokenizer must spell JSON: scripts/make_random_checkpoint.py's do. A constrained request
stops where its JSON is complete, ignore_eos or not; with random weights few complete, and
most run to their length, masked at every step.

--json-out writes the engine's figures to FILE too, with its start-up (the in-process
engine's construction: load, cache sizing, graphs) and load times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams, StructuredOutput, StructuredOutputKind

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


def workload(
    num_requests: int, vocab_size: int, low: int, high: int
) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(0)
    requests = []
    for _ in range(num_requests):
        input_len, output_len = torch.randint(low, high + 1, (2,), generator=generator).tolist()
        prompt = torch.randint(0, vocab_size, (input_len,), generator=generator).tolist()
        requests.append((prompt, output_len))
    return requests


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


def bench_engine(
    engine: LLMEngine,
    requests: list[tuple[list[int], int]],
    constrained: set[int],
    constraint: StructuredOutput | None,
) -> tuple[int, float]:
    # Warm-up: one short request (constrained too if any is), so first-use costs stay out
    # of the timing.
    warmup = SamplingParams(max_tokens=4, structured_output=constraint)
    engine.add_request(b"bench", "warmup", requests[0][0][:16], warmup)
    while engine.has_work:
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for i, (prompt, output_len) in enumerate(requests):
        sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
        if i in constrained:
            sampling.structured_output = constraint
        engine.add_request(b"bench", str(i), prompt, sampling)
    generated = 0
    while engine.has_work:
        for _, output in engine.step():
            generated += len(output.new_token_ids)
    return generated, time.perf_counter() - started


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--peer", action="store_true", help="also time transformers (CUDA)")
    parser.add_argument("--peer-batch-size", type=int, default=64)
    parser.add_argument(
        "--peer-requests",
        type=int,
        default=None,
        help="time transformers on the first N requests only (default: all)",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
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
    parser.add_argument("--json-out", type=Path, help="also write the engine's figures here")
    args = parser.parse_args()
    if not 0 <= args.structured_fraction <= 1:
        parser.error("--structured-fraction must be in [0, 1]")

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
        )
    )
    start_s = time.perf_counter() - started
    requests = workload(args.num_requests, engine.vocab_size, args.min_len, args.max_len)
    constrained = constrained_indices(args.num_requests, args.structured_fraction)
    constraint = None
    if constrained:
        schema = (
            BUILTIN_SCHEMA
            if args.schema == "builtin"
            else json.loads(Path(args.schema).read_text())
        )
        constraint = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema))
        vocabulary_s, schema_s = compile_times(engine, constraint)
        print(
            f"structured outputs: {len(constrained)} of {args.num_requests} requests; reading "
            f"the vocabulary {vocabulary_s:.3f} s, compiling the schema (cold) {schema_s:.3f} s"
        )
    rows = [("tandem", *bench_engine(engine, requests, constrained, constraint))]
    if args.json_out is not None:
        _, tokens, seconds = rows[0]
        figures = {"start_s": start_s, "load_s": engine.runner.load_seconds}
        figures |= {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
        args.json_out.write_text(json.dumps(figures))
    engine.close()
    if args.peer:
        del engine
        torch.cuda.empty_cache()
        rows.append(
            (
                "transformers generate",
                *bench_transformers(
                    args.model, requests[: args.peer_requests], args.peer_batch_size
                ),
            )
        )
    structured = f", {len(constrained)} constrained by a JSON schema" if constrained else ""
    print(
        f"\n{args.model}: {args.num_requests} requests, lengths uniform in "
        f"[{args.min_len}, {args.max_len}], ignore_eos{structured}, device {args.device}, "
        f"tensor parallel {args.tensor_parallel_size}"
    )
    print(f"{'':24} {'output tokens':>14} {'seconds':>9} {'tok/s':>10}")
    for name, tokens, seconds in rows:
        print(f"{name:24} {tokens:14d} {seconds:9.2f} {tokens / seconds:10.1f}")


if __name__ == "__main__":
    main()
