"""vLLM's POST /tokenize and /detokenize: the model's tokenizer, and its chat template."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.openai_schemas import DetokenizeRequest, TokenizeRequest, parse_request
from server.prompts import chat_prompt_ids
from server.served_model import ServedModel


class Tokenization:
    def __init__(self, model: ServedModel) -> None:
        self._model = model

    async def tokenize(self, request: Request) -> Response:
        """The token ids of a prompt, or of messages through the chat template."""
        body = parse_request(TokenizeRequest, await request.body())
        self._model.check_name(body.model)
        if body.messages is not None:
            ids = await chat_prompt_ids(self._model, body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None  # the schema wants exactly one of the two
            ids = await self._model.encode(body.prompt, body.add_special_tokens)
        return JSONResponse(
            {"count": len(ids), "max_model_len": self._model.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids."""
        body = parse_request(DetokenizeRequest, await request.body())
        self._model.check_name(body.model)
        self._model.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": self._model.decode(body.tokens)})
