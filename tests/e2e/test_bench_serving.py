"""scripts/bench_serving.py against a real engine and servers it starts (tiny model, CPU):
every request answered, the streamed tokens counted as the usage says, each of --runs with
prompts of its own and the median and range over them, and the chat workload's later turns
sending their history, found in the prefix cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.testing.processes import REPO_ROOT
from tandem.testing.random_checkpoint import VOCAB, save_tiny_llama, save_word_tokenizer


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    save_word_tokenizer(directory, VOCAB)  # a chat template, and words for every id
    return directory


def bench(model: Path, out: Path, *args: str) -> dict:
    """The script's --json: every run's figures ("levels") and each level's ("medians")."""
    command = [sys.executable, "scripts/bench_serving.py", "--model", str(model)]
    command += ["--device", "cpu", "--max-token-id", str(VOCAB - 1), "--client-processes", "2"]
    command += ["--json", str(out), *args]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    print(completed.stdout)
    return json.loads(out.read_text())


def test_random_workload_at_two_rates_through_two_servers_twice(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    figures = bench(
        tiny_chat_model,
        tmp_path / "random.json",
        *("--servers", "2", "--num-requests", "6", "--min-len", "17", "--max-len", "24"),
        *("--rates", "20", "inf", "--runs", "2"),
    )
    runs = figures["levels"]
    assert [(r["level"], r["run"]) for r in runs] == [
        ("rate 20/s", 1),
        ("rate 20/s", 2),
        ("rate inf/s", 1),
        ("rate inf/s", 2),
    ]
    for run in runs:
        assert run["requests"] == 6 and run["errors"] == 0
        # ignore_eos: every request streams its whole length, uniform in [17, 24].
        assert 6 * 17 <= run["output_tokens"] <= 6 * 24
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
        assert run["output_tok_s"] > 0
        # The client's and the servers' cost, from their processes' CPU time.
        assert run["client_us_per_chunk"] > 0 and 0 < run["client_busy"] <= 2
        assert run["server_us_per_chunk"] > 0 and 0 < run["server_busy"] <= 2
        assert run["server_us_per_token"] > 0
        # Prompts of every run's own (each at least a block of 16): none found in the cache.
        assert run["prefix_cache_hit"] == 0
    for level, (first, second) in zip(figures["medians"], (runs[:2], runs[2:]), strict=True):
        # A level's runs: the same lengths, other prompts.
        assert first["output_tokens"] == second["output_tokens"]
        assert first["prompt_tokens"] == second["prompt_tokens"]
        assert level["level"] == first["level"] and level["runs"] == 2
        speeds = sorted((first["output_tok_s"], second["output_tok_s"]))
        assert level["output_tok_s_min"] == speeds[0] and level["output_tok_s_max"] == speeds[1]
        assert level["output_tok_s_median"] == level["output_tok_s"] == sum(speeds) / 2


def test_chat_workload_sends_history_that_the_prefix_cache_finds(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    (level,) = bench(
        tiny_chat_model,
        tmp_path / "chat.json",
        *("--workload", "chat", "--num-requests", "6", "--turns", "3"),
        *("--system-words", "40", "--user-words", "5", "--chat-output-len", "4"),
        *("--concurrency", "2", "--engine-args", "--max-model-len 256"),
    )["levels"]
    assert level["requests"] == 6 and level["errors"] == 0
    assert level["output_tokens"] == 6 * 4
    # Two conversations of three turns: the system prompt and earlier turns are cached.
    assert level["prefix_cache_hit"] > 0.5
