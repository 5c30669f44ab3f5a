"""/v1/embeddings through real processes with the openai client: a batch of text and
token-id inputs, as floats and as base64 (the client's default), each the model's last
hidden state at the last token, L2-normalized, as transformers computes it on the same
weights; the usage; requests that share an X-Request-Id; and the refusals (dimensions, too
long, empty)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from tandem.testing.processes import SMALL_KV_CACHE, engine_and_server
from tandem.testing.random_checkpoint import save_tiny_word_model
from tests.conftest import Cluster

INPUTS = ["w3 w4 w5", "w7 w8 w9 w10 w11 w12", [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    """The tiny word model behind an engine and a server; and its directory."""
    workdir = tmp_path_factory.mktemp("embeddings")
    model = workdir / "model"
    save_tiny_word_model(model)
    engine_args = ("--model", str(model), "--max-model-len", "64", *SMALL_KV_CACHE)
    with engine_and_server(workdir, *engine_args) as (address, url, log_path):
        yield Cluster(address, [url], "model", log_path), model


def reference(model: LlamaForCausalLM, ids: list[int]) -> list[float]:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0).tolist()


def test_embeddings_match_transformers(served: tuple[Cluster, Path]) -> None:
    cluster, directory = served
    client = cluster.client()
    token_ids = [
        httpx.post(f"{cluster.urls[0]}/tokenize", json={"prompt": text}).json()["tokens"]
        for text in INPUTS[:2]
    ] + [INPUTS[2]]
    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    expected = [reference(model, ids) for ids in token_ids]

    as_base64 = client.embeddings.create(model=cluster.model, input=INPUTS)  # the default
    as_floats = client.embeddings.create(model=cluster.model, input=INPUTS, encoding_format="float")
    for answer in (as_base64, as_floats):
        assert [item.index for item in answer.data] == [0, 1, 2]
        for item, reference_embedding in zip(answer.data, expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(item.embedding),
                torch.tensor(reference_embedding),
                atol=1e-5,
                rtol=1e-4,
            )
        num_tokens = sum(map(len, token_ids))
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens
    raw = httpx.post(
        f"{cluster.urls[0]}/v1/embeddings",
        json={"input": "w3 w4 w5", "encoding_format": "base64"},
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list"
    one = client.embeddings.create(model=cluster.model, input=INPUTS[2], encoding_format="float")
    # Alone or in a batch: the same vector, up to float32 rounding (another batch may take
    # other kernels' summation orders).
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), torch.tensor(as_floats.data[2].embedding)
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"dimensions": 8}, "dimensions"),
        ({"input": "w3 " * 65}, "input"),  # more than the context's 64 tokens
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_refusals(served: tuple[Cluster, Path], fields: dict, param: str) -> None:
    cluster, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        cluster.client().embeddings.create(**{"model": cluster.model, "input": "w3", **fields})
    assert refused.value.body["param"] == param


def test_requests_with_one_x_request_id_at_once(served: tuple[Cluster, Path]) -> None:
    # The engine requests' ids are the answer's plus a part of their own: on the answer's id
    # alone, every request but the first in flight with that X-Request-Id was a 500.
    cluster, _ = served
    body = {"model": cluster.model, "input": ["w3 w4 w5"] * 16, "encoding_format": "float"}

    async def embed_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.urls[0], timeout=60) as client:
            headers = {"X-Request-Id": "shared"}
            return await asyncio.gather(
                *(client.post("/v1/embeddings", json=body, headers=headers) for _ in range(8))
            )

    replies = asyncio.run(embed_at_once())
    assert [reply.status_code for reply in replies] == [200] * 8, [r.text for r in replies]
    assert {reply.json()["id"] for reply in replies} == {"embd-shared"}
    first = torch.tensor(replies[0].json()["data"][0]["embedding"])
    for reply in replies:
        for item in reply.json()["data"]:
            torch.testing.assert_close(torch.tensor(item["embedding"]), first)
