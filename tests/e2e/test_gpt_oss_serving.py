"""gpt-oss served as a user runs it: a tiny random checkpoint with a harmony tokenizer and
template (tandem/testing/harmony.py) in an engine process, a real server, the openai client.

Random weights write no harmony, so this checks the plumbing: the template's harmony picks
the harmony parsers (tool_choice "auto" is taken, which needs a tool-call parser), the stop
tokens of generation_config.json end generation, and a streamed answer assembles to the
whole one through the parsers. tests/server/test_harmony.py reads real harmony answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.models import load_checkpoint
from tandem.testing.harmony import HARMONY_VOCAB, harmony_tokenizer, save_harmony_tokenizer
from tandem.testing.processes import SMALL_KV_CACHE, engine_and_server
from tests.engine.test_model_families import saved_tiny_model

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Path]]:
    workdir = tmp_path_factory.mktemp("gpt-oss-serving")
    model_dir = workdir / "model"
    saved_tiny_model("gpt-oss", model_dir, vocab_size=HARMONY_VOCAB, eos_token_id=None)
    save_harmony_tokenizer(model_dir)
    with engine_and_server(workdir, "--model", str(model_dir), *SMALL_KV_CACHE) as (_, url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), model_dir


def test_the_stop_tokens_are_generation_configs(gpt_oss: tuple[openai.OpenAI, Path]) -> None:
    _, model_dir = gpt_oss
    tokenizer = harmony_tokenizer()
    ends = {tokenizer.token_to_id(token) for token in ("<|return|>", "<|call|>")}
    assert ends <= set(load_checkpoint(str(model_dir)).tokenizer.eos_token_ids)


def test_gpt_oss_answers_whole_and_streamed_alike(gpt_oss: tuple[openai.OpenAI, Path]) -> None:
    """With tools and tool_choice "auto": refused (400) unless a tool-call parser is known."""
    client, _ = gpt_oss
    model = client.models.list().data[0].id
    arguments = dict(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        max_tokens=8,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
    )
    reply = client.chat.completions.create(**arguments)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert 0 < reply.usage.completion_tokens <= 8
    reasoning = getattr(message, "reasoning_content", None)
    streamed = list(client.chat.completions.create(**arguments, stream=True))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    streamed_reasoning = "".join(
        getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
        for chunk in streamed
        if chunk.choices
    )
    assert content == (message.content or "")
    assert streamed_reasoning == (reasoning or "")
