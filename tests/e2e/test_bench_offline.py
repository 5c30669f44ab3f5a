"""scripts/bench_offline.py on a tiny model (CPU): every requested token generated, prompts
computed within the step budget asked for, and the median run's steps by kind add up to the
run (its time and its roofline), as the first run's add up to the first run; each kind's
slowest step is one of its steps; --profile-steps adds a profiled run's table of the same
kinds (on the CPU, no device time). A cache too small for the batch shows as preemptions,
every token still generated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.testing.processes import REPO_ROOT
from tandem.testing.random_checkpoint import save_tiny_llama


def test_steps_by_kind_add_up_to_the_run(tmp_path: Path) -> None:
    model = tmp_path / "model"
    # Heads wide enough that a batch-1 step's cache (6 KiB a token) takes longer to read than
    # the table's 0.001 ms shows, at a CPU's copy bandwidth: the tiny default's 768 bytes a
    # token round to 0.000.
    save_tiny_llama(model, num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    out = tmp_path / "figures.json"
    command = [sys.executable, "scripts/bench_offline.py", "--model", str(model)]
    command += ["--device", "cpu", "--num-requests", "20", "--min-len", "10", "--max-len", "40"]
    command += ["--max-num-seqs", "16", "--runs", "2", "--json-out", str(out), "--profile-steps"]
    command += ["--max-num-batched-tokens", "32"]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    print(completed.stdout)
    figures = json.loads(out.read_text())
    # The profiled run's table comes last: a row of each kind (the same lengths, the same
    # steps), each with its wall time; no kernel on the CPU.
    profiled = completed.stdout.split("device time, a profiled run")[1].splitlines()[1:]
    rows = {line[:28].strip(): line[28:].split() for line in profiled if line.strip()}
    assert set(rows) == set(figures["steps"])
    for kind, cells in rows.items():
        assert int(cells[0]) == figures["steps"][kind]["steps"]
        assert float(cells[1]) > 0 and float(cells[2]) == 0
        # The least time to read each step's cache: every step of the kind reads some.
        assert float(cells[5]) > 0
    assert 20 * 10 <= figures["output_tokens"] <= 20 * 40  # ignore_eos: every length in full
    # The default cache (1 GiB on CPU) holds the batch: nothing preempted.
    assert figures["kv_cache_tokens"] >= 16 * 80 and figures["preemptions_max"] == 0
    assert "; 0 preemptions, 0 allocator retries, " in completed.stdout
    # Each run's stalls, in order: the CPU has no caching allocator to retry.
    assert [stalls["allocator_retries"] for stalls in figures["stalls"]] == [0, 0]
    steps = figures["steps"]
    kinds = list(steps)
    # 20 prompts prefill first; 16 sequences at most decode at once, then fewer as they end.
    assert kinds[0] == "prefill (and decodes)"
    # A step computes 32 tokens at most: the prompts' 200 or more take 7 steps or more.
    assert steps["prefill (and decodes)"]["steps"] >= 7
    assert set(kinds[1:]) <= {"decode, batch 1", "decode, batch 2-16"}
    assert "decode, batch 2-16" in kinds
    seconds = sum(kind["seconds"] for kind in steps.values())
    bound = sum(kind["bound_s"] for kind in steps.values())
    # Each step's time runs from the previous step's read to its own: together, the run less
    # the submission before the first step and the last read's bookkeeping.
    assert 0.8 * figures["seconds"] < seconds <= figures["seconds"]
    assert bound == pytest.approx(figures["roofline_share"] * figures["seconds"], rel=1e-9)
    for kind in [*steps.values(), *figures["first_steps"].values()]:
        assert kind["steps"] > 0 and kind["seconds"] > 0 and kind["bound_s"] > 0
        # The slowest step is one of the kind's: at least their mean, at most their sum.
        assert kind["seconds"] / kind["steps"] <= kind["slowest_s"] <= kind["seconds"]
        assert kind["steps"] == 1 or kind["slowest_s"] < kind["seconds"]
    # The first run's steps, by the same kinds (the same lengths), add up to the first run.
    first = figures["first_steps"]
    assert set(first) == set(steps)
    first_seconds = sum(kind["seconds"] for kind in first.values())
    assert 0.8 * figures["first_seconds"] < first_seconds <= figures["first_seconds"]
    # Where the first run and the median differ clearly (the first pays first-use costs),
    # the first run's table is the first run's, not the median's again.
    if abs(figures["first_seconds"] - figures["seconds"]) > 0.1 * figures["seconds"]:
        assert abs(first_seconds - figures["first_seconds"]) < abs(first_seconds - seconds)
    assert figures["first_tok_s"] == pytest.approx(
        figures["output_tokens"] / figures["first_seconds"], rel=1e-9
    )


def test_a_cache_too_small_for_the_batch_shows_as_preemptions(tmp_path: Path) -> None:
    """12 blocks of 16 tokens hold two of the 16 sequences' up to 80 tokens at once: the
    scheduler preempts, the run says so, and every requested token is still generated."""
    model = tmp_path / "model"
    save_tiny_llama(model, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    out = tmp_path / "figures.json"
    command = [sys.executable, "scripts/bench_offline.py", "--model", str(model)]
    command += ["--device", "cpu", "--num-requests", "20", "--min-len", "10", "--max-len", "40"]
    command += ["--max-num-seqs", "16", "--runs", "1", "--num-kv-blocks", "12"]
    command += ["--json-out", str(out)]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["kv_cache_tokens"] == 12 * 16
    assert figures["preemptions"] > 0
    assert f"; {figures['preemptions']} preemptions" in completed.stdout
    assert "KV cache 192 tokens" in completed.stdout
    assert 20 * 10 <= figures["output_tokens"] <= 20 * 40
