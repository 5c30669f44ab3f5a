"""The supervisor's command line, as `tandem serve` parses it into the processes it starts."""

from __future__ import annotations

import pytest

from tandem.supervisor import build_children, parse_args


@pytest.mark.parametrize(
    ("engine_args", "stop_timeout_s"), [([], 30.0), (["--drain-timeout", "600"], 600.0)]
)
def test_an_engine_is_given_its_drain_timeout_to_exit(
    engine_args: list[str], stop_timeout_s: float
) -> None:
    """An engine told to drain for longer than the supervisor's usual wait for its exit is
    let finish: killed at the usual wait, its last requests would end without an answer."""
    args, rest = parse_args(["--device", "cpu", "--data-parallel-size", "2", "--", *engine_args])
    supervisor = build_children(args, rest)
    for engine in supervisor.engines:
        assert engine.argv[len(engine.argv) - len(engine_args) :] == engine_args
        assert engine.stop_timeout_s == stop_timeout_s
