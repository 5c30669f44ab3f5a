"""The ``tandem`` command: a supervised deployment, and the benchmarks.

    tandem serve [--model M] [--servers N] [--port P] ... [-- ENGINE_ARGS...]
    tandem serve --rolling-restart [--port P]        # restart the servers in turn
    tandem serve --status [--port P]
    tandem bench NAME [ARGS...]                      # tandem bench NAME --help: its options

``tandem serve`` is tandem/supervisor.py (scripts/start_distributed.sh runs it too);
``tandem bench NAME`` is tandem/bench/NAME.py (a hyphen in NAME for each underscore), which
``python scripts/bench_NAME.py`` also runs. Everything after the subcommand's name is that
command's own: its options, its ``--help``.

A subcommand's module is imported only once it is chosen, so that ``tandem --help`` and
``tandem serve`` load neither torch nor transformers (the supervisor starts as fast as a
plain script; its engines load torch in their own processes).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name: one line for the help. The modules are imported only when run.
BENCHMARKS: dict[str, str] = {
    "offline": "offline throughput in one process, against its roofline",
    "latency": "start-up time and batch-1 latency of an engine process",
    "serving": "streamed requests through HTTP servers: TTFT, TPOT",
    "data-parallel": "engine replicas behind the servers' pool, against one",
    "tensor-parallel": "tensor parallelism on GPUs: correct first, then fast",
    "quantization": "what --quantization costs in accuracy, buys in speed",
    "speculative": "speculative decoding (n-gram, draft model) against none",
    "structured-output": "JSON-constrained requests' cost in offline throughput",
    "host-step": "the host's share of a decode step, without the model",
    "all-reduce": "the all-reduce: NCCL's ring against symmetric memory",
    "kernels": "decode attention's share of the copy bandwidth",
}


def parser() -> argparse.ArgumentParser:
    """For ``--help`` and for wrong arguments: the subcommands' own options are theirs."""
    top = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: an LLM inference server, its deployment and its benchmarks.",
        epilog="`tandem COMMAND --help` (and `tandem bench NAME --help`) show a command's options.",
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "serve",
        add_help=False,
        help="start engine replicas and HTTP servers, keep them running",
    )
    bench = commands.add_parser(
        "bench",
        help="run a benchmark: tandem bench NAME [ARGS]",
        description="Run a benchmark: `tandem bench NAME --help` shows its options.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=26),
    )
    names = bench.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, line in BENCHMARKS.items():
        names.add_parser(name, add_help=False, help=line)
    return top


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["serve"]:
        from tandem import supervisor

        sys.argv = ["tandem serve", *args[1:]]  # its usage line names the command
        supervisor.main(args[1:])
        return
    if args[:1] == ["bench"] and len(args) > 1 and args[1] in BENCHMARKS:
        module = importlib.import_module(f"tandem.bench.{args[1].replace('-', '_')}")
        sys.argv = [f"tandem bench {args[1]}", *args[2:]]
        module.main(args[2:])
        return
    top = parser()
    top.parse_args(args)  # prints the help, or why the arguments are wrong, and exits
    top.error(f"cannot run {' '.join(args)!r}")


if __name__ == "__main__":
    main()
