"""A mixture of experts served as a user runs it: a tiny Qwen3-MoE checkpoint in an engine
process, a real server, the openai client; its greedy answers are transformers' on the same
weights, whole and streamed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import openai
from tokenizers import Tokenizer

from tandem.testing.processes import SMALL_KV_CACHE, free_port, start_engine, start_server
from tandem.testing.random_checkpoint import VOCAB, random_prompts, save_word_tokenizer
from tandem.testing.reference import hf_greedy
from tests.engine.test_model_families import saved_tiny_model


def test_a_mixture_of_experts_answers_the_openai_client_as_transformers_does(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    model_dir = tmp_path / "model"
    hf_model = saved_tiny_model("qwen3-moe-dense-middle", model_dir)
    save_word_tokenizer(model_dir, VOCAB)  # every id decodes to text
    address = f"ipc://{tmp_path}/engine.sock"
    log = tmp_path / "engine.log"
    subprocess_cleanup.append(
        start_engine(address, log, "--model", str(model_dir), *SMALL_KV_CACHE)
    )
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, tmp_path / "server.log"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    prompt = random_prompts(3)[2]  # 17 tokens
    expected = hf_greedy(hf_model, prompt, 8)
    arguments = dict(
        model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    reply = client.completions.create(**arguments)
    # The server's incremental text of the new tokens: what follows the prompt's text.
    whole = tokenizer.decode(prompt + expected)
    assert reply.choices[0].text == whole[len(tokenizer.decode(prompt)) :]
    assert reply.usage.completion_tokens == 8
    streamed = client.completions.create(**arguments, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == reply.choices[0].text
