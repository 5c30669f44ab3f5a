"""A completion's suffix: fill-in-the-middle prompts, for tokenizers that have the tokens."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tokenizers import Tokenizer

from server.fill_in_middle import FillInMiddle
from server.openai_schemas import CompletionRequest
from server.prompts import completion_prompts
from server.served_model import ServedModel
from tests.server.test_openai_schemas import CHATML, TOKENIZER_JSON, handshake


def model_with(tokens: list[str]) -> ServedModel:
    tokenizer = Tokenizer.from_str(TOKENIZER_JSON)
    tokenizer.add_special_tokens(tokens)
    reply = dataclasses.replace(handshake(CHATML), tokenizer_json=tokenizer.to_str())
    return ServedModel.from_handshake(reply)


@pytest.mark.parametrize(
    "tokens",
    [
        ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
        ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ],
)
def test_suffix_makes_a_prefix_suffix_middle_prompt(tokens: list[str]) -> None:
    model = model_with(tokens)
    assert model.fill_in_middle == FillInMiddle(*tokens)
    request = CompletionRequest(prompt="hello world", suffix=" the fox", echo=True)
    (prompt,) = asyncio.run(completion_prompts(model, request))
    tokenizer = model.tokenizer
    ids = [tokenizer.token_to_id(token) for token in tokens]
    assert prompt.ids[0] == ids[0] and prompt.ids[-1] == ids[2] and ids[1] in prompt.ids
    assert model.decode(prompt.ids) == f"{tokens[0]}hello world{tokens[1]} the fox{tokens[2]}"
    assert prompt.echo == "hello world"  # echo shows the prompt as given


def test_tokenizers_without_the_tokens_have_no_fill_in_the_middle() -> None:
    # One token of a set is not enough.
    assert model_with(["<fim_prefix>", "<fim_middle>"]).fill_in_middle is None
    assert model_with([]).fill_in_middle is None
