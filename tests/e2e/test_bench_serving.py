"""scripts/bench_serving.py against a real engine and servers it starts (tiny model, CPU):
every request answered, the streamed tokens counted as the usage says, and the chat
workload's later turns sending their history, found in the prefix cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO_ROOT
from tests.random_checkpoint import VOCAB, save_tiny_llama, save_word_tokenizer


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    save_word_tokenizer(directory, VOCAB)  # a chat template, and words for every id
    return directory


def bench(model: Path, out: Path, *args: str) -> list[dict]:
    command = [sys.executable, "scripts/bench_serving.py", "--model", str(model)]
    command += ["--device", "cpu", "--max-token-id", str(VOCAB - 1), "--client-processes", "2"]
    command += ["--json", str(out), *args]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    print(completed.stdout)
    return json.loads(out.read_text())["levels"]


def test_random_workload_at_two_rates_through_two_servers(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    levels = bench(
        tiny_chat_model,
        tmp_path / "random.json",
        *("--servers", "2", "--num-requests", "6", "--min-len", "5", "--max-len", "12"),
        *("--rates", "20", "inf"),
    )
    assert [level["level"] for level in levels] == ["rate 20/s", "rate inf/s"]
    for level in levels:
        assert level["requests"] == 6 and level["errors"] == 0
        # ignore_eos: every request streams its whole length, uniform in [5, 12].
        assert 6 * 5 <= level["output_tokens"] <= 6 * 12
        assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
        assert level["output_tok_s"] > 0


def test_chat_workload_sends_history_that_the_prefix_cache_finds(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    (level,) = bench(
        tiny_chat_model,
        tmp_path / "chat.json",
        *("--workload", "chat", "--num-requests", "6", "--turns", "3"),
        *("--system-words", "40", "--user-words", "5", "--chat-output-len", "4"),
        *("--concurrency", "2", "--engine-args", "--max-model-len 256"),
    )
    assert level["requests"] == 6 and level["errors"] == 0
    assert level["output_tokens"] == 6 * 4
    # Two conversations of three turns: the system prompt and earlier turns are cached.
    assert level["prefix_cache_hit"] > 0.5
