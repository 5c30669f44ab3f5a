"""POST /v1/embeddings: each input's embedding, the model's last hidden state pooled and
L2-normalized by the engine (an ``EmbedRequest`` each: engine/execution/pooling.py), as
floats or as base64 (little-endian float32, what OpenAI's client decodes)."""

from __future__ import annotations

import asyncio
import base64
import struct
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from protocol import Embedding
from server.answer import CLIENT_CLOSED_REQUEST, engine_request_prefix
from server.choices import unless_disconnected
from server.engine_client import EngineRequestError, EngineUnavailable
from server.engine_pool import EnginePool
from server.errors import ApiError
from server.generation import engine_refusal, engine_unavailable
from server.openai_schemas import EmbeddingRequest, read_request
from server.request_id import request_id
from server.served_model import ServedModel


class Embeddings:
    def __init__(self, client: EnginePool, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = await read_request(EmbeddingRequest, request)
        self._model.check_name(body.model)
        self._model.check_requests_at_once(len(body.input), "inputs", "input")
        prompts = [await self._prompt_ids(body, item) for item in body.input]
        answer_id = f"embd-{request_id(request)}"
        engine_id = engine_request_prefix(answer_id)
        embeddings = await unless_disconnected(request, self._embed_all(engine_id, prompts))
        if embeddings is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        num_tokens = sum(embedding.num_prompt_tokens for embedding in embeddings)
        return JSONResponse(
            {
                "id": answer_id,
                "object": "list",
                "created": int(time.time()),
                "model": self._model.name,
                "data": [
                    {
                        "index": index,
                        "object": "embedding",
                        "embedding": _encoded(embedding.embedding, body.encoding_format),
                    }
                    for index, embedding in enumerate(embeddings)
                ],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            }
        )

    async def _prompt_ids(self, body: EmbeddingRequest, item: str | list[int]) -> list[int]:
        if isinstance(item, list):
            self._model.check_token_ids(item, "input")
            ids = item
        else:
            ids = await self._model.encode(item, add_special_tokens=body.add_special_tokens)
        ids = body.truncated_prompt(ids, self._model.max_model_len)
        limit = self._model.max_model_len
        if len(ids) > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )
        return ids

    async def _embed_all(self, engine_id: str, prompts: list[list[int]]) -> list[Embedding]:
        """Every prompt's embedding, asked for at once; the first refusal fails them all
        (and cancels, so aborts, the others)."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._client.embed(f"{engine_id}-{index}", ids))
                    for index, ids in enumerate(prompts)
                ]
        except* EngineUnavailable as errors:
            raise engine_unavailable(errors.exceptions[0]) from None
        except* EngineRequestError as errors:
            error = errors.exceptions[0]
            assert isinstance(error, EngineRequestError)
            raise engine_refusal(error) from None
        return [task.result() for task in tasks]


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()
