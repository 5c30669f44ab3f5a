"""The ``tandem`` console command as installed (pyproject's [project.scripts]): its help lists
the subcommands, ``tandem serve`` reaches the supervisor without loading torch, and
``tandem bench offline`` runs the offline benchmark on a tiny model (CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tandem.cli import BENCHMARKS
from tandem.testing.processes import free_port
from tandem.testing.random_checkpoint import save_tiny_llama


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tandem ARGS`` from the tests' own environment, run from a directory outside the
    checkout (the command must not need it as its working directory)."""
    beside = Path(sys.executable).parent / "tandem"
    command = str(beside) if beside.is_file() else shutil.which("tandem")
    assert command is not None, "the tandem command is installed by pip install -e '.[dev]'"
    return subprocess.run(
        [command, *args],
        cwd=Path("/"),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_the_commands_and_the_benchmarks() -> None:
    top = tandem("--help")
    assert top.returncode == 0, top.stderr
    assert "serve" in top.stdout and "bench" in top.stdout
    bench = tandem("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    for name, line in BENCHMARKS.items():
        assert name in bench.stdout and line in bench.stdout
    unknown = tandem("bench", "no-such-benchmark")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr
    assert tandem().returncode == 2  # a command is required


def test_serve_is_the_supervisor_and_loads_no_torch() -> None:
    # Python's import log (PYTHONPROFILEIMPORTTIME) names every module imported.
    helped = tandem("serve", "--help", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: tandem serve")
    for option in ("--rolling-restart", "--status", "--data-parallel-size", "ENGINE_ARGS"):
        assert option in helped.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in helped.stderr.splitlines()}
    assert "tandem.supervisor" in imported
    assert not {"torch", "transformers", "engine", "server"} & imported
    # Nothing listens at this port's control socket: the supervisor says so.
    port = str(free_port())
    status = tandem("serve", "--status", "--port", port)
    assert status.returncode == 1 and "no supervisor answers" in status.stderr


def test_bench_offline_on_a_tiny_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    save_tiny_llama(model, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    out = tmp_path / "figures.json"
    helped = tandem("bench", "offline", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: tandem bench offline")
    args = ["--model", str(model), "--device", "cpu", "--num-requests", "20"]
    args += ["--min-len", "10", "--max-len", "40", "--max-num-seqs", "16", "--runs", "1"]
    ran = tandem("bench", "offline", *args, "--json-out", str(out))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert 20 * 10 <= figures["output_tokens"] <= 20 * 40  # ignore_eos: every length in full
    # Sampled, as a served model's clients sample by default: the same lengths in full.
    sampled = ["--temperature", "1", "--top-p", "0.9", "--top-k", "20", "--num-requests", "6"]
    sampled += ["--repetition-penalty", "1.05"]
    ran = tandem("bench", "offline", *args, *sampled, "--json-out", str(out))
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    header = "sampled at temperature 1 within top-p 0.9 and top-k 20, repetition penalty 1.05"
    assert header in ran.stdout
    assert 6 * 10 <= json.loads(out.read_text())["output_tokens"] <= 6 * 40
