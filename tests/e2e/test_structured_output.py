"""Structured outputs as a user sees them: the default model behind real servers, asked
through the official openai client in each shape (OpenAI's response_format, vLLM's
structured_outputs and guided_*), answering text that follows the constraint."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import openai
import pytest

from tests.conftest import Cluster

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "hobbies"],
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON: name, age, city, hobbies."}]
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
ANSWERS = ["yes", "no", "maybe"]


def chat(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK_PERSON)
    return client.chat.completions.create(model=model, temperature=0, **kwargs)


def assert_person(text: str) -> None:
    person = json.loads(text)
    assert person.keys() == PERSON["properties"].keys()
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert type(person["age"]) is int and 0 <= person["age"] <= 120
    assert person["city"] in PERSON["properties"]["city"]["enum"]
    assert isinstance(person["hobbies"], list) and len(person["hobbies"]) <= 2
    assert all(isinstance(hobby, str) and len(hobby) <= 12 for hobby in person["hobbies"])


def test_json_schema_answer_follows_the_schema_streamed_or_not(cluster: Cluster) -> None:
    client = cluster.client()
    plain = chat(client, cluster.model, response_format=PERSON_FORMAT, max_tokens=120)
    assert plain.choices[0].finish_reason == "stop"
    assert_person(plain.choices[0].message.content)
    stream = chat(client, cluster.model, response_format=PERSON_FORMAT, max_tokens=120, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_answer_is_a_json_object(cluster: Cluster) -> None:
    reply = chat(
        cluster.client(1), cluster.model, response_format={"type": "json_object"}, max_tokens=120
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_regex_in_both_endpoints(cluster: Cluster) -> None:
    client = cluster.client()
    completion = client.completions.create(
        model=cluster.model,
        prompt="The Apollo 11 landing happened on",
        temperature=0,
        max_tokens=20,
        extra_body={"guided_regex": " " + DATE},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(" " + DATE, completion.choices[0].text)
    reply = chat(
        client,
        cluster.model,
        messages=[{"role": "user", "content": "When did Apollo 11 land on the moon?"}],
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": DATE}},
    )
    assert re.fullmatch(DATE, reply.choices[0].message.content)


def test_choice_and_n_choices_with_logprobs(cluster: Cluster) -> None:
    """Two sampled choices, each one of the answers; log-probabilities of the allowed tokens
    (they sum to one), the forbidden alternatives at OpenAI's floor of -9999.0."""
    reply = cluster.client(1).chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes, no or maybe."}],
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=10,
        logprobs=True,
        top_logprobs=20,
        extra_body={"guided_choice": ANSWERS},
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.message.content in ANSWERS
        assert choice.finish_reason == "stop"
        for token in choice.logprobs.content:
            assert -9999.0 < token.logprob <= 0
            allowed = [alt.logprob for alt in token.top_logprobs if alt.logprob > -9999.0]
            assert len(allowed) < 20
            assert math.fsum(math.exp(lp) for lp in allowed) == pytest.approx(1.0, abs=1e-3)
            assert all(alt.logprob == -9999.0 for alt in token.top_logprobs[len(allowed) :])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            'Unsupported type "nope"',
        ),
        ({"extra_body": {"guided_regex": "a(b"}}, "The parenthesis is not closed."),
        ({"extra_body": {"guided_grammar": "root ::= foo"}}, 'Rule "foo" is not defined'),
        # Valid, but it matches no text: no token is ever allowed (was a 503, an abort).
        ({"extra_body": {"guided_grammar": "root ::= root"}}, "the structured output allows"),
    ],
    ids=["schema", "regex", "grammar", "empty grammar"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_bad_constraint_is_a_400_with_the_library_message(
    cluster: Cluster, fields: dict[str, Any], message: str, stream: bool
) -> None:
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as refused:
        reply = chat(client, cluster.model, max_tokens=4, stream=stream, **fields)
        list(reply) if stream else None
    assert refused.value.status_code == 400
    assert message in refused.value.message
    # The engine serves on.
    reply = chat(client, cluster.model, max_tokens=4, extra_body={"guided_choice": ANSWERS})
    assert reply.choices[0].message.content in ANSWERS
