"""What a speculative verify step costs the device: the verify graph of BATCH requests with
DRAFTS drafts each (1 + DRAFTS query tokens a sequence), and the kernels that take its time.

    python scripts/time_verify_steps.py --model DIR [--load-format dummy] [--dtype auto]
                                        [--batches 1 8] [--drafts 16] [--context 600]
                                        [--repeats 50]

For each batch size an engine with fixed-k prompt lookup (k = DRAFTS, verify graphs captured
at start-up) prefills BATCH requests of CONTEXT random tokens; each is then given DRAFTS
draft tokens and the scheduler makes the verify step. Its graph is replayed REPEATS times,
the device synchronized after each (the medians of the host's time, its launch, and the
wall's, until the device is done, in ms), then once more under the torch profiler for the
kernels' shares. On the CPU (no graphs) the step runs op by op: a check of the script alone.
The adaptive policy drafts where a verify step costs less than the plain steps its accepted
drafts save (``engine/speculative/step_costs.py``): a verify step slower than it should be
makes drafting pay less, or not at all.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tandem.bench.step_timing import add_engine_arguments, engine_config, synchronize, timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", type=int, default=16)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        engine = LLMEngine(
            engine_config(
                args,
                max_model_len=max(4096, 2 * args.context),
                max_num_seqs=max(16, batch),
                speculative_method="ngram",
                num_speculative_tokens=args.drafts,
                speculative_adaptive=False,
            )
        )
        vocab = engine.vocab_size
        for i in range(batch):
            prompt = torch.randint(5, vocab - 5, (args.context,), generator=generator).tolist()
            engine.add_request(
                b"t", f"r{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True)
            )
        while any(not r.output_token_ids for r in engine.requests.values()):
            engine.step()
        engine.sync()  # no step left in flight
        runner = engine.runner
        for request in engine.scheduler.running:
            request.draft_token_ids = [7 + d for d in range(args.drafts)]
        verify = runner.step_inputs(engine.scheduler.schedule())
        assert verify.uniform_query_len == 1 + args.drafts
        graphs = runner.verify_graphs
        assert graphs is not None or args.device == "cpu", "verify graphs are captured on CUDA"
        run = runner.forward_eager if graphs is None else graphs.run
        activities = [ProfilerActivity.CPU if graphs is None else ProfilerActivity.CUDA]
        with torch.inference_mode():
            host_ms, wall_ms = timed(partial(run, verify), args.repeats)
            with profile(activities=activities) as profiled:
                run(verify)
                synchronize()
        how = "op by op" if graphs is None else "graph"
        print(
            f"batch {batch}, {args.drafts} drafts, context {args.context}: verify step ({how}) "
            f"host {host_ms:.3f} ms, wall {wall_ms:.3f} ms",
            flush=True,
        )
        sort = "self_cpu_time_total" if graphs is None else "self_cuda_time_total"
        print(profiled.key_averages().table(sort_by=sort, row_limit=8))
        del engine, runner, graphs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
