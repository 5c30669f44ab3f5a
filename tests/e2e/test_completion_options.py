"""vLLM's and OpenAI's further request options end to end: batched prompts, echo, best_of,
stop strings kept, truncated prompts, request ids, the version, unknown fields, and (slow,
on Qwen2.5-Coder) fill in the middle."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from tandem.testing.gguf_models import TEST_MODELS
from tandem.testing.processes import free_port, start_engine, start_server
from tests.conftest import Cluster

PROMPTS = ["The capital of France is", "One, two, three,"]


def _complete(cluster: Cluster, **request: object) -> openai.types.Completion:
    """A completion, greedy and 4 tokens long unless ``request`` says otherwise."""
    return cluster.client().completions.create(
        **{"model": cluster.model, "temperature": 0, "max_tokens": 4, **request}
    )


def _token_ids(cluster: Cluster, prompt: str) -> list[int]:
    return httpx.post(f"{cluster.urls[0]}/tokenize", json={"prompt": prompt}).json()["tokens"]


def test_batched_prompts_and_echo(cluster: Cluster) -> None:
    alone = [_complete(cluster, prompt=prompt).choices[0].text for prompt in PROMPTS]
    batch = _complete(cluster, prompt=PROMPTS, n=2)
    # Prompt i's n choices have the indexes i * n to i * n + n - 1.
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in batch.choices] == [alone[0]] * 2 + [alone[1]] * 2
    mixed = _complete(
        cluster, prompt=[_token_ids(cluster, PROMPTS[1]), PROMPTS[0]]
    )  # token ids and text together
    assert [choice.text for choice in mixed.choices] == [alone[1], alone[0]]

    echoed = _complete(cluster, prompt=PROMPTS, echo=True)
    assert [choice.text for choice in echoed.choices] == [
        p + a for p, a in zip(PROMPTS, alone, strict=True)
    ]
    streamed = ["", ""]
    for chunk in _complete(cluster, prompt=PROMPTS, echo=True, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [choice.text for choice in echoed.choices]


def test_a_completion_that_names_no_length_has_16_tokens(cluster: Cluster) -> None:
    """OpenAI's and vLLM's default for completions (the model sets none), not the context."""
    reply = cluster.client().completions.create(
        model=cluster.model, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_best_of_answers_with_the_likeliest_candidates(cluster: Cluster) -> None:
    request = dict(prompt=PROMPTS[0], temperature=1.0, seed=1, max_tokens=6)
    # best_of's candidates are the choices a request for that many makes (seeds 1, 2, 3).
    candidates = _complete(cluster, n=3, logprobs=0, **request).choices
    texts = [candidate.text for candidate in candidates]
    scores = [sum(candidate.logprobs.token_logprobs) for candidate in candidates]
    ranked = [texts[i] for i in sorted(range(3), key=scores.__getitem__, reverse=True)]
    assert len(set(texts)) == 3 and ranked[:2] != texts[:2]  # else the test could not tell
    best = _complete(cluster, best_of=3, **request)
    assert [choice.text for choice in best.choices] == ranked[:1]
    assert best.choices[0].logprobs is None  # not asked for, though ranked by them
    two = _complete(cluster, best_of=3, n=2, logprobs=0, **request)
    assert [choice.index for choice in two.choices] == [0, 1]
    assert [choice.text for choice in two.choices] == ranked[:2]
    assert two.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in candidates)
    with pytest.raises(openai.BadRequestError):
        _complete(cluster, best_of=2, stream=True, **request)


def test_stop_strings_kept_and_prompts_truncated(cluster: Cluster) -> None:
    client = cluster.client(1)
    request = dict(
        model=cluster.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
        stop=["Paris"],
    )
    cut = client.chat.completions.create(**request).choices[0].message.content
    kept = client.chat.completions.create(
        **request, extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == cut + "Paris"
    assert kept.choices[0].finish_reason == "stop"

    long = "Once upon a time, in a land far away, there lived a king. The capital of France is"
    truncated = _complete(cluster, prompt=long, extra_body={"truncate_prompt_tokens": 3})
    assert truncated.usage.prompt_tokens == 3
    last_three = _token_ids(cluster, long)[-3:]
    assert truncated.choices[0].text == _complete(cluster, prompt=last_three).choices[0].text


def test_request_ids_version_and_unknown_fields(cluster: Cluster) -> None:
    url = cluster.urls[0]
    version = httpx.get(f"{url}/version")
    assert version.status_code == 200 and version.json()["version"]
    body = {"model": cluster.model, "prompt": "Hi", "max_tokens": 2, "frobnicate_xyz": 1}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "req-42"})
    assert reply.status_code == 200, reply.text  # the unknown field is ignored
    assert reply.headers["x-request-id"] == "req-42"
    assert reply.json()["id"] == "cmpl-req-42"
    assert "ignored: 'frobnicate_xyz'" in cluster.log_path.read_text()
    made = httpx.get(f"{url}/v1/models").headers["x-request-id"]
    assert len(made) == 32
    # A field that vLLM knows and this server does not serve yet is refused.
    refused = httpx.post(f"{url}/v1/completions", json={**body, "use_beam_search": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_beam_search"
    # SmolLM2's tokenizer has no fill-in-the-middle tokens.
    refused = httpx.post(f"{url}/v1/completions", json={**body, "suffix": "!"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"


@pytest.mark.slow
def test_suffix_fills_in_the_middle_with_qwen_coder(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    path = TEST_MODELS["qwen2.5-coder-0.5b"].path
    if not path.is_file():
        pytest.skip(f"{path} is absent: scripts/fetch_test_gguf.py fetches it")
    address = f"ipc://{tmp_path}/engine.sock"
    subprocess_cleanup.append(start_engine(address, tmp_path / "engine.log", "--model", str(path)))
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, tmp_path / "server.log"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    request = dict(model=client.models.list().data[0].id, max_tokens=6, temperature=0, stop=["("])
    # The name the model gives the function depends on the code after it.
    named = {
        "\n\n\nassert product(6, 3) == 18\n": "product",
        "(a, b):\n    return a - b\n": "subtract",
    }
    for suffix, name in named.items():
        reply = client.completions.create(prompt="def ", suffix=suffix, **request)
        assert reply.choices[0].text == name
    plain = client.completions.create(prompt="def ", **request).choices[0].text
    assert plain.strip() not in named.values()
