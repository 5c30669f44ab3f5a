"""The whole system as a user sees it: real engine, real servers, the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import openai
import pytest
import zmq

from protocol import (
    PROTOCOL_VERSION,
    EngineStats,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    decode_message,
)
from tandem.testing.processes import engine_stats, wait_for_cache_free
from tests.conftest import Cluster

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs) -> str:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=messages, **kwargs)
    return reply.choices[0].message.content


def _stream_chat(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs) -> str:
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=messages, stream=True, **kwargs)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_greedy_answer_names_paris(cluster: Cluster) -> None:
    client = cluster.client()
    reply = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, temperature=0, max_tokens=32
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.completion_tokens > 0


def test_streamed_answer_equals_the_plain_one(cluster: Cluster) -> None:
    client = cluster.client(1)
    plain = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, temperature=0, max_tokens=32
    )
    chunks = list(
        client.chat.completions.create(
            model=cluster.model,
            messages=QUESTION,
            temperature=0,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert "Paris" in streamed
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["stop"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_endpoint_streams_the_same_text(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = "The capital of France is"
    plain = client.completions.create(
        model=cluster.model, prompt=prompt, max_tokens=12, temperature=0
    )
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=cluster.model, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert plain.choices[0].text == streamed
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 12


def test_two_servers_serve_sixteen_concurrent_streams(cluster: Cluster) -> None:
    topics = [
        "cats",
        "the sea",
        "bread",
        "winter",
        "music",
        "trains",
        "the moon",
        "coffee",
        "rivers",
        "chess",
        "bees",
        "mountains",
        "paper",
        "rain",
        "clocks",
        "gardens",
    ]
    prompts = [[{"role": "user", "content": f"Write one sentence about {t}."}] for t in topics]
    clients = [cluster.client(0), cluster.client(1)]
    # Each answer alone first; greedy decoding must give the same text in a batch of 16.
    alone = [_chat(clients[0], p, temperature=0, max_tokens=12) for p in prompts]
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [
            pool.submit(_stream_chat, clients[i % 2], p, temperature=0, max_tokens=12)
            for i, p in enumerate(prompts)
        ]
        together = [f.result(timeout=600) for f in futures]
    assert together == alone
    assert len(set(together)) > 8  # distinct prompts got their own answers


def test_seed_makes_sampling_reproducible(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = [{"role": "user", "content": "Tell me a short story."}]
    runs = [_chat(client, prompt, temperature=1.0, seed=1234, max_tokens=20) for _ in range(2)]
    other = _chat(client, prompt, temperature=1.0, seed=4321, max_tokens=20)
    assert runs[0] == runs[1]
    assert other != runs[0]


def test_stop_string_cuts_the_answer(cluster: Cluster) -> None:
    client = cluster.client()
    reply = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, temperature=0, max_tokens=32, stop=["Paris"]
    )
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    wait_for_cache_free(cluster.urls[0])


def test_models_and_health(cluster: Cluster) -> None:
    models = httpx.get(f"{cluster.urls[1]}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == cluster.model
    health = httpx.get(f"{cluster.urls[1]}/health")
    assert health.status_code == 200
    assert health.json()["engine"]["num_total_blocks"] > 0


@pytest.mark.parametrize("choices", [1, 3])
def test_client_disconnect_mid_stream_frees_the_cache(cluster: Cluster, choices: int) -> None:
    url = cluster.urls[0]
    body = {
        "model": cluster.model,
        "messages": QUESTION,
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
        "n": choices,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6 * choices)]
        assert any(line.startswith("data: ") for line in received)
        assert engine_stats(url)["num_running"] == choices
    stats = wait_for_cache_free(url)
    assert stats["num_running"] == 0


def _error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    return error


def test_bad_requests_get_openai_style_400s(cluster: Cluster) -> None:
    url = f"{cluster.urls[0]}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    _error_of(httpx.post(url, content=b"{not json", headers=headers))
    _error_of(httpx.post(url, json={"model": cluster.model}))
    error = _error_of(
        httpx.post(url, json={"model": cluster.model, "messages": QUESTION, "max_tokens": -5})
    )
    assert "max_tokens" in error["message"] or error["param"] == "max_tokens"
    long_prompt = [{"role": "user", "content": "word " * 20_000}]
    error = _error_of(httpx.post(url, json={"model": cluster.model, "messages": long_prompt}))
    assert "context" in error["message"]
    # None of it disturbed the engine.
    assert "Paris" in _chat(cluster.client(), QUESTION, temperature=0, max_tokens=32)


def test_garbage_on_the_engine_socket_is_dropped(cluster: Cluster) -> None:
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 1000)
    rogue.setsockopt(zmq.RCVTIMEO, 60_000)  # a missing reply fails the test, not hangs it
    rogue.connect(cluster.engine_address)
    try:
        rogue.send(b"\x00\xffthis is not a message")
        rogue.send(b"\x81\xa4type\xa8generate")  # a map naming a message, with no fields
        rogue.send_multipart([b"two", b"frames"])
        rogue.send(b"\xc1" * 1000)
        # Handshaken, requests the codec takes that once took the engine down: a top_k past a
        # signed 64-bit integer (a step's int64 tensor overflowed) and a choice constraint
        # nested past Python's stack (its check raised RecursionError out of the loop).
        rogue.send(HandshakeRequest(PROTOCOL_VERSION, "rogue").encode())
        assert isinstance(decode_message(rogue.recv()), HandshakeReply)
        sampling = {"max_tokens": 4, "top_k": 2**63}
        rogue.send(msgpack.packb(_generate("big-top-k", sampling), use_bin_type=True))
        choice = {"max_tokens": 4, "structured_output": {"kind": "choice", "spec": "[" * 100_000}}
        rogue.send(msgpack.packb(_generate("nested", choice), use_bin_type=True))
        refusal = _next_but_heartbeats(rogue)
        assert isinstance(refusal, ErrorReply) and refusal.request_id == "nested", refusal
    finally:
        # Not term(): a socket left open by a failed assertion would block it forever (here,
        # or in a later test's garbage collection: CI hung so once).
        context.destroy(linger=0)
    assert "Paris" in _chat(cluster.client(1), QUESTION, temperature=0, max_tokens=32)
    assert "dropped" in cluster.log_path.read_text()


def _next_but_heartbeats(peer: zmq.Socket) -> Message:
    """The next message the engine sends ``peer`` that is not the stats it sends every
    handshaken peer now and then."""
    message = decode_message(peer.recv())
    while isinstance(message, EngineStats):
        message = decode_message(peer.recv())
    return message


def _generate(request_id: str, sampling: dict) -> dict:
    """A generate message's map, as a server would send it, with these sampling fields."""
    return {
        "type": "generate",
        "request_id": request_id,
        "prompt_token_ids": [1, 2, 3],
        "sampling": sampling,
    }


def test_chat_logprobs_streamed_and_not(cluster: Cluster) -> None:
    client = cluster.client()
    request = dict(
        model=cluster.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    plain = client.chat.completions.create(**request)
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens
    assert "".join(entry.token for entry in content) == plain.choices[0].message.content
    for entry in content:
        alternatives = [top.logprob for top in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == alternatives[0] <= 0  # greedy: the likeliest token
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = [
        entry
        for chunk in client.chat.completions.create(stream=True, **request)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(s.logprob - p.logprob) < 1e-4 for s, p in zip(streamed, content, strict=True))


def test_completion_logprobs(cluster: Cluster) -> None:
    reply = cluster.client().completions.create(
        model=cluster.model,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [
        sum(len(token) for token in logprobs.tokens[:i]) for i in range(6)
    ]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 2 and top[token] == logprob == max(top.values())


def test_several_choices_streamed_and_not(cluster: Cluster) -> None:
    client = cluster.client()
    request = dict(model=cluster.model, messages=QUESTION, temperature=1.0, seed=11, max_tokens=16)
    plain = client.chat.completions.create(n=3, **request)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    texts = [c.message.content for c in plain.choices]
    assert len(set(texts)) > 1  # each choice samples with a seed of its own
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(n=3, stream=True, **request):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    # The first choice is the one a single request with the same seed gets.
    one = client.chat.completions.create(**request)
    assert one.choices[0].message.content == texts[0]
    assert plain.usage.prompt_tokens == one.usage.prompt_tokens
    others = [client.chat.completions.create(**{**request, "seed": 11 + i}) for i in (1, 2)]
    assert plain.usage.completion_tokens == sum(
        reply.usage.completion_tokens for reply in [one, *others]
    )


def test_frequency_penalty_changes_a_greedy_answer(cluster: Cluster) -> None:
    client = cluster.client()
    request = dict(
        model=cluster.model,
        messages=[{"role": "user", "content": "Write a long poem about the sea."}],
        temperature=0,
        max_tokens=48,
    )
    plain = client.chat.completions.create(**request).choices[0].message.content
    penalized = client.chat.completions.create(
        frequency_penalty=1.5, presence_penalty=0.5, **request
    )
    assert penalized.choices[0].message.content != plain


def test_logit_bias_forces_a_token(cluster: Cluster) -> None:
    reply = cluster.client().completions.create(
        model=cluster.model,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    tokens = reply.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1
    assert reply.choices[0].text == tokens[0] * 4


def test_metrics_count_tokens(cluster: Cluster) -> None:
    def scrape() -> dict[str, float]:
        text = httpx.get(f"{cluster.urls[1]}/metrics", timeout=10).text
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in samples}

    def grew(name: str, before: dict[str, float], after: dict[str, float]) -> float:
        return after[name] - before[name]

    def ask() -> None:
        cluster.client().chat.completions.create(
            model=cluster.model, messages=QUESTION, max_tokens=5, extra_body={"ignore_eos": True}
        )

    first = scrape()
    assert first["tandem_engine_up"] == 1 and first["tandem_kv_cache_blocks"] > 0
    ask()
    second = scrape()
    assert grew("tandem_generation_tokens_total", first, second) >= 5
    assert grew("tandem_prompt_tokens_total", first, second) > 0
    ask()  # the same prompt again: its full blocks come from the prefix cache
    third = scrape()
    assert grew("tandem_prefix_cache_hit_tokens_total", second, third) > 0
