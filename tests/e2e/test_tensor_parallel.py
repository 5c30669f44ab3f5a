"""A tensor-parallel engine as a user runs it: scripts/start_distributed.sh with
--tensor-parallel-size 2 (an engine process and the worker it starts, over gloo on the CPU),
a real server, the openai client; its greedy answers are transformers' on the same weights."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import openai
from tokenizers import Tokenizer

from tandem.testing.processes import REPO_ROOT, engine_stats, free_port, spawn, stop, wait_healthy
from tandem.testing.random_checkpoint import VOCAB, random_prompts, save_word_tokenizer
from tandem.testing.reference import hf_greedy
from tests.engine.test_model_families import saved_tiny_model


def test_two_rank_engine_answers_the_openai_client_as_transformers_does(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    model_dir = tmp_path / "model"
    hf_model = saved_tiny_model("qwen2-biases-tied", model_dir)
    save_word_tokenizer(model_dir, VOCAB)  # every id decodes to text
    port = free_port()
    log_path = tmp_path / "cluster.log"
    script = spawn(
        [
            "bash",
            str(REPO_ROOT / "scripts/start_distributed.sh"),
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--engine-address",
            f"ipc://{tmp_path}/engine.sock",
            "--tensor-parallel-size",
            "2",
        ],
        log_path,
    )
    subprocess_cleanup.append(script)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, [script], log_path)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    for prompt in random_prompts(3)[1:]:  # 5 and 17 tokens
        expected = hf_greedy(hf_model, prompt, 10)
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        # The server's incremental text of the new tokens: what follows the prompt's text.
        whole = tokenizer.decode(prompt + expected)
        assert reply.choices[0].text == whole[len(tokenizer.decode(prompt)) :]
        assert reply.usage.completion_tokens == 10
        streamed = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == reply.choices[0].text

    stats = engine_stats(url)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    stop(script, signal.SIGTERM)
    log = log_path.read_text()
    assert "tensor parallelism over 2 cpu ranks" in log
    assert "rank 1 of 2" in log  # the worker loaded its half
