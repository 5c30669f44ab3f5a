"""vLLM's further chat options end to end, with the official openai client (vLLM's fields
in extra_body): echo, documents, reasoning_effort, include_reasoning, continuous usage
stats, special tokens' text, the text of the token that stopped an answer, and
restrictions that leave a structured output no token."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tandem.testing.processes import free_port, start_server, stop, wait_for_cache_free
from tests.conftest import Cluster

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}
# A ChatML that reads what vLLM's fields give a template: the reasoning effort and each
# document as system turns before the conversation; with the variable ``thinking``, the
# answer starts inside a <think> block (read by the server's qwen3 reasoning parser).
OPTIONS_TEMPLATE = (
    "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}"
    "{% for document in documents or [] %}<|im_start|>system\n"
    "{{ document.title }}: {{ document.text }}<|im_end|>\n{% endfor %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if thinking %}<think>\n{% endif %}{% endif %}"
)


def chat(cluster: Cluster, **fields: Any) -> Any:
    fields = {"messages": QUESTION, **GREEDY, **fields}
    return cluster.client().chat.completions.create(model=cluster.model, **fields)


def streamed_content(stream: Any) -> tuple[list[Any], dict[int, str]]:
    """The chunks of a streamed chat answer, and each choice's content joined."""
    chunks, content = list(stream), {}
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    return chunks, content


def token_id(cluster: Cluster, text: str) -> int:
    body = {"prompt": text, "add_special_tokens": False}
    tokens = httpx.post(f"{cluster.urls[0]}/tokenize", json=body, timeout=30).json()["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


def test_echo_starts_the_answer_with_the_message_it_goes_on_with(cluster: Cluster) -> None:
    """vLLM's echo: the last message's content comes first where the answer has its role: an
    assistant message continued, or any message without a generation prompt."""
    start = "The capital of France is"
    conversation = [*QUESTION, {"role": "assistant", "content": start}]
    going_on = {"add_generation_prompt": False, "continue_final_message": True}
    plain = chat(cluster, messages=conversation, extra_body=going_on).choices[0].message
    echoed = chat(cluster, messages=conversation, extra_body={**going_on, "echo": True})
    message = echoed.choices[0].message
    assert message.role == "assistant" and message.content == start + plain.content
    assert "Paris" in message.content
    chunks, content = streamed_content(
        chat(cluster, messages=conversation, stream=True, extra_body={**going_on, "echo": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == start  # the echo, before any token
    assert content[0] == message.content
    # A user's message is no answer's start: with a generation prompt there is nothing to echo.
    assert chat(cluster, extra_body={"echo": True}).choices[0].message.content == (
        chat(cluster).choices[0].message.content
    )


@pytest.fixture(scope="module")
def options_url(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server on the cluster's engine with OPTIONS_TEMPLATE and the qwen3 reasoning
    parser."""
    template = tmp_path_factory.mktemp("options") / "options.jinja"
    template.write_text(OPTIONS_TEMPLATE)
    port = free_port()
    server = start_server(
        cluster.engine_address,
        port,
        cluster.log_path,
        "--chat-template",
        str(template),
        "--reasoning-parser",
        "qwen3",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server, signal.SIGTERM)


def test_documents_and_reasoning_effort_reach_the_chat_template(
    cluster: Cluster, options_url: str
) -> None:
    client = openai.OpenAI(base_url=f"{options_url}/v1", api_key="unused", max_retries=0)
    document = {"title": "Zorbland", "text": "The capital of Zorbland is Paris."}
    reply = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        **GREEDY,
        reasoning_effort="low",
        extra_body={"documents": [document]},
    )
    # The template renders both as system turns: the prompt is that conversation's.
    as_messages = [
        {"role": "system", "content": "Reasoning: low"},
        {"role": "system", "content": "Zorbland: The capital of Zorbland is Paris."},
    ]
    tokenized = httpx.post(
        f"{options_url}/tokenize", json={"messages": [*as_messages, *QUESTION]}, timeout=30
    ).json()
    assert reply.usage.prompt_tokens == tokenized["count"]
    without = client.chat.completions.create(model=cluster.model, messages=QUESTION, **GREEDY)
    assert without.usage.prompt_tokens < reply.usage.prompt_tokens
    # The Responses API's reasoning.effort is the same variable.
    response = client.responses.create(
        model=cluster.model,
        input=QUESTION[0]["content"],
        max_output_tokens=1,
        reasoning={"effort": "low"},
    )
    tokenized = httpx.post(
        f"{options_url}/tokenize", json={"messages": [as_messages[0], *QUESTION]}, timeout=30
    ).json()
    assert response.usage.input_tokens == tokenized["count"]


def test_include_reasoning_false_leaves_the_reasoning_out(
    cluster: Cluster, options_url: str
) -> None:
    client = openai.OpenAI(base_url=f"{options_url}/v1", api_key="unused", max_retries=0)
    thinking = {"chat_template_kwargs": {"thinking": True}}
    reply = client.chat.completions.create(
        model=cluster.model, messages=QUESTION, **GREEDY, extra_body=thinking
    )
    # The tiny model never closes its <think> block: all of the answer is reasoning.
    reasoning = reply.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and not reply.choices[0].message.content
    hidden = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        **GREEDY,
        extra_body={**thinking, "include_reasoning": False},
    )
    assert "reasoning_content" not in hidden.choices[0].message.model_extra
    assert hidden.usage.completion_tokens == reply.usage.completion_tokens
    stream = client.chat.completions.create(
        model=cluster.model,
        messages=QUESTION,
        **GREEDY,
        stream=True,
        extra_body={**thinking, "include_reasoning": False},
    )
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert not any((delta.model_extra or {}).get("reasoning_content") for delta in deltas)


def test_continuous_usage_stats_put_the_usage_on_every_chunk(cluster: Cluster) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    whole = chat(cluster, n=2, temperature=1.0, seed=4)
    chunks, _ = streamed_content(
        chat(cluster, n=2, temperature=1.0, seed=4, stream=True, stream_options=options)
    )
    *choice_chunks, last = chunks
    assert not last.choices and last.usage.total_tokens == whole.usage.total_tokens
    so_far = {0: 0, 1: 0}
    for chunk in choice_chunks:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens >= so_far[choice.index]  # each choice's own count
        so_far[choice.index] = usage.completion_tokens
    assert sum(so_far.values()) == whole.usage.completion_tokens
    # Completions: each prompt of a batch counts its own prompt tokens.
    prompts = ["The capital of France is", "One, two, three, four, five,"]
    stream = cluster.client().completions.create(
        model=cluster.model, prompt=prompts, max_tokens=3, stream=True, stream_options=options
    )
    prompt_tokens = {c.choices[0].index: c.usage.prompt_tokens for c in stream if c.choices}
    assert prompt_tokens[0] != prompt_tokens[1]
    # Without include_usage, as vLLM: no usage at all.
    plain, _ = streamed_content(
        chat(cluster, stream=True, stream_options={"continuous_usage_stats": True})
    )
    assert all(chunk.usage is None for chunk in plain)


def test_special_tokens_and_the_stopping_token_in_the_text(cluster: Cluster) -> None:
    """skip_special_tokens false keeps special tokens' text (here an EOS the request ignores);
    include_stop_str_in_output ends the text with the stop token's, as vLLM."""
    plain = chat(cluster)
    answer = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "stop" and "Paris" in answer
    beyond = {"max_tokens": plain.usage.completion_tokens + 3, "ignore_eos": True}
    hidden = chat(cluster, extra_body=beyond).choices[0].message.content
    shown = chat(cluster, extra_body={**beyond, "skip_special_tokens": False})
    assert "<|im_end|>" not in hidden and "<|im_end|>" in shown.choices[0].message.content
    assert shown.choices[0].message.content.startswith(answer + "<|im_end|>")

    paris = token_id(cluster, " Paris")
    cut = chat(cluster, extra_body={"stop_token_ids": [paris]}).choices[0]
    kept = chat(
        cluster, extra_body={"stop_token_ids": [paris], "include_stop_str_in_output": True}
    ).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop" and "Paris" not in cut.message.content
    assert kept.message.content == cut.message.content + " Paris"
    # The EOS that ended the answer: its text only where special tokens show.
    eos = chat(cluster, extra_body={"include_stop_str_in_output": True}).choices[0].message
    assert eos.content == answer
    eos_shown = chat(
        cluster, extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False}
    )
    assert eos_shown.choices[0].message.content == answer + "<|im_end|>"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_restrictions_that_leave_a_structured_output_no_token_are_a_400(
    cluster: Cluster, stream: bool
) -> None:
    letter = token_id(cluster, "a")
    with pytest.raises(openai.BadRequestError) as refused:
        reply = chat(
            cluster,
            stream=stream,
            extra_body={"guided_regex": "[0-9]+", "allowed_token_ids": [letter]},
        )
        list(reply) if stream else None
    assert "No token is left to sample at output token 1" in refused.value.message
    # Later in the answer: "aaa" is complete, but min_tokens bans the EOS it needs.
    with pytest.raises(openai.BadRequestError, match="output token 4") as refused:
        chat(
            cluster,
            extra_body={"guided_regex": "aaa", "allowed_token_ids": [letter], "min_tokens": 5},
        )
    assert "structured output, allowed_token_ids and min_tokens" in refused.value.message
    # Up front, where the server can tell.
    with pytest.raises(openai.BadRequestError) as refused:
        chat(cluster, extra_body={"allowed_token_ids": [letter], "bad_words": ["a"]})
    assert refused.value.body["param"] == "allowed_token_ids"
    # The engine serves on.
    assert "Paris" in chat(cluster).choices[0].message.content
    wait_for_cache_free(cluster.urls[0])


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(cluster: Cluster) -> None:
    fields = {"return_tokens_as_token_ids": True}
    reply = chat(cluster, logprobs=True, top_logprobs=2, extra_body=fields)
    entries = reply.choices[0].logprobs.content
    ids = [int(entry.token.removeprefix("token_id:")) for entry in entries]
    assert all(top.token.startswith("token_id:") for e in entries for top in e.top_logprobs)
    text = httpx.post(f"{cluster.urls[0]}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert text["prompt"] == reply.choices[0].message.content
    completion = cluster.client().completions.create(
        model=cluster.model, prompt="One, two,", max_tokens=3, logprobs=1, extra_body=fields
    )
    logprobs = completion.choices[0].logprobs
    assert all(token.startswith("token_id:") for token in logprobs.tokens)
    assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top)
