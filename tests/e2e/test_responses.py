"""The Responses API end to end, through the official openai client's own parsing."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import Cluster

QUESTION = "What is the capital of France?"


def test_response_whole_streamed_and_through_the_stream_helper(cluster: Cluster) -> None:
    client = cluster.client()
    request = dict(model=cluster.model, input=QUESTION, temperature=0, max_output_tokens=32)
    whole = client.responses.create(**request)
    assert whole.status == "completed" and whole.object == "response"
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")
    assert "Paris" in whole.output_text
    # It is the chat endpoint's answer to the same message.
    chat = client.chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    events = list(client.responses.create(stream=True, **request))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text

    with client.responses.stream(**request) as stream:
        helper_deltas = [
            event.delta for event in stream if event.type == "response.output_text.delta"
        ]
        final = stream.get_final_response()
    assert "".join(helper_deltas) == final.output_text == whole.output_text


def test_running_out_of_tokens_makes_an_incomplete_response(cluster: Cluster) -> None:
    client = cluster.client(1)
    request = dict(model=cluster.model, input=QUESTION, max_output_tokens=3)
    whole = client.responses.create(**request)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3
    last = list(client.responses.create(stream=True, **request))[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"


def test_instructions_request_ids_and_refusals(cluster: Cluster) -> None:
    client = cluster.client()
    reply = client.responses.with_raw_response.create(
        model=cluster.model,
        instructions="Answer in one word.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        temperature=0,
        max_output_tokens=8,
        extra_headers={"X-Request-Id": "my-request-7"},
    )
    assert reply.headers["x-request-id"] == "my-request-7"
    assert reply.parse().id.startswith("resp_my-request-7-")
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=cluster.model, input=QUESTION, previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=cluster.model,
            input=QUESTION,
            tools=[{"type": "web_search"}],
        )
    assert refused.value.body["param"] == "tools"
    assert "not supported" in refused.value.body["message"]


def test_one_x_request_id_twice_stores_two_responses(cluster: Cluster) -> None:
    """A response's id is the key it is stored and continued under: two requests that come
    with one X-Request-Id get two ids, each retrieved as it was answered."""
    client = cluster.client()
    responses = [
        client.responses.create(
            model=cluster.model,
            input=question,
            temperature=0,
            max_output_tokens=4,
            extra_headers={"X-Request-Id": "sent-twice"},
        )
        for question in (QUESTION, "Name a colour.")
    ]
    assert responses[0].id != responses[1].id
    for response in responses:
        assert response.id.startswith("resp_sent-twice-")
        stored = client.responses.retrieve(response.id)
        assert stored.output_text == response.output_text
        assert stored.usage.input_tokens == response.usage.input_tokens


def test_vllms_sampling_fields_as_the_chat_endpoint_takes_them(cluster: Cluster) -> None:
    """seed, stop, repetition_penalty, top_k, ignore_eos and structured_outputs, which vLLM's
    Responses API takes, mean what they mean in chat."""
    client = cluster.client()
    fields = {"seed": 11, "stop": ["."], "repetition_penalty": 1.3, "top_k": 20}
    response = client.responses.create(
        model=cluster.model,
        input=QUESTION,
        temperature=1.0,
        max_output_tokens=24,
        extra_body=fields,
    )
    chat = client.chat.completions.create(
        model=cluster.model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=1.0,
        max_tokens=24,
        extra_body=fields,
    )
    assert response.output_text == chat.choices[0].message.content
    assert "." not in response.output_text
    constrained = client.responses.create(
        model=cluster.model,
        input=QUESTION,
        max_output_tokens=8,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}, "ignore_eos": True},
    )
    assert constrained.output_text in ("Paris", "Rome")
