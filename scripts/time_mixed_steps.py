"""What a step that admits prompts costs a busy engine: a decode batch with a few new prompts
mixed in, run split (the decode graph for the decodes, a prompt graph for the prompts:
engine/execution/mixed_steps.py) and as one pass op by op, on the same inputs.

    python scripts/time_mixed_steps.py --model DIR [--load-format dummy] [--dtype float32]
                                       [--batch 256] [--context 128] [--prompts 1 2 4]
                                       [--repeats 20]

BATCH requests of CONTEXT random tokens are prefilled and decoding; then for each count in
--prompts, that many new prompts of 30-200 random tokens arrive (at most the largest prompt
graph's tokens together) and the scheduler makes the step that admits them. First the
check: the split step's logits against the one pass's (the largest difference; the rows
whose argmax agree). Then each way's time, the median of
REPEATS: the host's (until the call returns: its launches) and the wall's (until the device
is done, the device synchronized after each), and the decode step alone (its graph) for
reference: what a busy engine's step costs when it admits nobody. Overlapped serving pays
about the larger of a step's host and device times; an eager step of a small model is its
host's.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from engine.execution.mixed_steps import is_mixed, split_mixed_step
from engine.execution.prompt_graphs import ALWAYS_CAPTURED_TOKENS
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tandem.bench.step_timing import add_engine_arguments, engine_config, timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    engine = LLMEngine(
        engine_config(
            args,
            max_num_seqs=args.batch + max(args.prompts),
            max_model_len=args.context + 512,
            split_mixed_steps="on",
        )
    )
    runner = engine.runner
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, engine.vocab_size, (count,), generator=generator).tolist()

    decoding = SamplingParams(max_tokens=256, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(b"mix", f"decode{i}", tokens(args.context), decoding)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()
    print(f"batch {args.batch} decoding at context ~{args.context}; times in ms, host / wall")
    print(f"{'step':34} {'split':>15} {'one pass':>15} {'decodes alone':>15}  check")
    for count in args.prompts:
        # Prompts that fit a prompt graph together, whatever the model (more run op by op,
        # unsplit).
        longest = min(200, ALWAYS_CAPTURED_TOKENS // count)
        lengths = torch.randint(30, longest + 1, (count,), generator=generator).tolist()
        for j, length in enumerate(lengths):
            engine.add_request(b"mix", f"new{j}", tokens(length), SamplingParams(max_tokens=1))
        inputs = runner.step_inputs(engine.scheduler.schedule())
        assert is_mixed(inputs.shape) and inputs.shape.num_leading_decodes == args.batch
        decodes, _ = split_mixed_step(inputs)
        with torch.inference_mode():
            splits = runner.num_split_steps
            split = runner.run_model(inputs).clone()
            assert runner.num_split_steps == splits + 1, "a part does not replay a graph"
            one_pass = runner.forward_eager(inputs)
            difference = (split - one_pass).abs().max().item()
            agree = (split.argmax(-1) == one_pass.argmax(-1)).sum().item()
            times = [
                timed(partial(runner.run_model, inputs), args.repeats),
                timed(partial(runner.forward_eager, inputs), args.repeats),
                timed(partial(runner.run_model, decodes), args.repeats),
            ]
        cells = " ".join(f"{host:6.2f} / {wall:6.2f}" for host, wall in times)
        check = f"max |diff| {difference:.2e}, argmax {agree}/{split.shape[0]}"
        print(f"{args.batch} + {count} prompt(s) {lengths!s:17} {cells}  {check}")
        for j in range(count):
            engine.abort(b"mix", f"new{j}")


if __name__ == "__main__":
    main()
