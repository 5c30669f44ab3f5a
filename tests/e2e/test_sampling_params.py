"""vLLM's sampling parameters through the whole system with the official openai client
(vLLM's fields in extra_body), and the model's generation_config.json defaults."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
from tokenizers import Tokenizer, models, pre_tokenizers

from tandem.testing.processes import free_port, start_engine, start_server, wait_for_cache_free
from tandem.testing.random_checkpoint import VOCAB, random_prompts, save_tiny_llama
from tests.conftest import Cluster

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a long poem about the sea."}]


def _answer(cluster: Cluster, messages: list[dict[str, str]], **kwargs) -> str:
    reply = cluster.client().chat.completions.create(
        model=cluster.model, messages=messages, **kwargs
    )
    return reply.choices[0].message.content


def _tokenize(cluster: Cluster, text: str, add_special_tokens: bool = True) -> list[int]:
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    response = httpx.post(f"{cluster.urls[0]}/tokenize", json=body, timeout=30)
    return response.json()["tokens"]


def test_min_p_one_keeps_only_the_likeliest_token(cluster: Cluster) -> None:
    greedy = _answer(cluster, QUESTION, temperature=0, max_tokens=16)
    sampled = _answer(
        cluster, QUESTION, temperature=1.0, seed=3, max_tokens=16, extra_body={"min_p": 1.0}
    )
    assert sampled == greedy


def test_repetition_penalty_changes_a_greedy_answer(cluster: Cluster) -> None:
    plain = _answer(cluster, POEM, temperature=0, max_tokens=48)
    penalized = _answer(
        cluster, POEM, temperature=0, max_tokens=48, extra_body={"repetition_penalty": 1.5}
    )
    neutral = _answer(
        cluster, POEM, temperature=0, max_tokens=48, extra_body={"repetition_penalty": 1.0}
    )
    assert penalized != plain and neutral == plain


def test_min_tokens_holds_off_eos_and_stop_strings(cluster: Cluster) -> None:
    client = cluster.client()
    plain = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, temperature=0, max_tokens=64
    )
    assert plain.choices[0].finish_reason == "stop" and "Paris" in plain.choices[0].message.content
    length = plain.usage.completion_tokens
    longer = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=length + 8,
        extra_body={"min_tokens": length + 8},
    )
    assert longer.usage.completion_tokens == length + 8
    assert longer.choices[0].finish_reason == "length"
    assert longer.choices[0].message.content.startswith(plain.choices[0].message.content)
    # A stop string in the first min_tokens tokens does not count (without them it cuts the
    # answer before "Paris": test_chat.py).
    held = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=length + 8,
        stop=["Paris"],
        extra_body={"min_tokens": length},
    )
    assert held.choices[0].message.content == plain.choices[0].message.content


def test_bad_words_keep_a_word_out(cluster: Cluster) -> None:
    assert "Paris" in _answer(cluster, QUESTION, temperature=0, max_tokens=32)
    answer = _answer(
        cluster, QUESTION, temperature=0, max_tokens=32, extra_body={"bad_words": ["Paris"]}
    )
    assert "Paris" not in answer


def test_allowed_token_ids_restrict_the_output(cluster: Cluster) -> None:
    allowed = sorted(set(_tokenize(cluster, " yes no maybe", add_special_tokens=False)))
    reply = cluster.client().completions.create(
        model=cluster.model,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=1.0,
        seed=5,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    texts = {
        httpx.post(f"{cluster.urls[0]}/detokenize", json={"tokens": [i]}).json()["prompt"]
        for i in allowed
    }
    tokens = reply.choices[0].logprobs.tokens
    assert len(tokens) == 6 and set(tokens) <= texts


def test_prompt_logprobs_in_vllms_shapes(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = _tokenize(cluster, prompt)
    reply = client.completions.create(
        model=cluster.model,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) == reply.usage.prompt_tokens and scored[0] is None
    for token_id, position in zip(ids[1:], scored[1:], strict=True):
        assert str(token_id) in position and len(position) in (2, 3)
        ranked = sorted(position.values(), key=lambda entry: entry["logprob"], reverse=True)
        assert [entry["rank"] for entry in ranked[:2]] == [1, 2]
        assert all(entry["logprob"] <= 0 and "decoded_token" in entry for entry in ranked)
    # Position i's distribution is the one the model samples from after the first i tokens.
    for i in (3, len(ids) - 1):
        after = client.completions.create(
            model=cluster.model, prompt=ids[:i], max_tokens=1, temperature=0, logprobs=1
        )
        top = after.choices[0].logprobs.top_logprobs[0]
        best = next(entry for entry in scored[i].values() if entry["rank"] == 1)
        assert list(top) == [best["decoded_token"]]
        assert abs(next(iter(top.values())) - best["logprob"]) < 1e-3
    # Every choice shows them (the first choice's engine request computed them).
    two = client.completions.create(
        model=cluster.model,
        prompt=prompt,
        max_tokens=1,
        n=2,
        temperature=1.0,
        extra_body={"prompt_logprobs": 2},
    )
    first, second = (choice.model_extra["prompt_logprobs"] for choice in two.choices)
    assert first == second and len(first) == len(scored)
    chat = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert len(scored) == chat.usage.prompt_tokens and scored[0] is None
    assert all(len(position) == 1 for position in scored[1:])
    wait_for_cache_free(cluster.urls[0])


def _word_level_checkpoint(directory: Path, generation_config: dict[str, float]) -> None:
    """A tiny Llama whose tokens are the words w0 ... w255, with ``generation_config``."""
    save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(json.dumps(generation_config))


def test_generation_config_fills_what_a_request_leaves_out(
    tmp_path: Path, subprocess_cleanup: list
) -> None:
    _word_level_checkpoint(
        tmp_path / "model", {"repetition_penalty": 2.0, "top_k": 1, "max_new_tokens": 5}
    )
    address = f"ipc://{tmp_path}/engine.sock"
    log = tmp_path / "engine.log"
    subprocess_cleanup.append(start_engine(address, log, "--model", str(tmp_path / "model")))
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, tmp_path / "server.log"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id

    def complete(temperature: float, **fields: float) -> str:
        reply = client.completions.create(
            model=model,
            prompt=random_prompts(5)[4],
            max_tokens=16,
            temperature=temperature,
            extra_body={"ignore_eos": True, **fields},
        )
        return reply.choices[0].text

    # top_k 1 from the model: sampling at temperature 1 takes the likeliest token, under the
    # model's repetition penalty.
    defaulted = complete(1.0, seed=7)
    assert defaulted == complete(0, repetition_penalty=2.0)
    assert defaulted != complete(0, repetition_penalty=1.0)
    assert "sampling defaults from the generation config" in log.read_text()
    # max_new_tokens is the length of a request that names none.
    unbounded = client.completions.create(
        model=model, prompt=random_prompts(5)[4], extra_body={"ignore_eos": True}
    )
    assert unbounded.usage.completion_tokens == 5 and unbounded.choices[0].finish_reason == "length"
