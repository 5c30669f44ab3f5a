"""vLLM's POST /tokenize and /detokenize: the model's tokenizer, and its chat template."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.openai_schemas import DetokenizeRequest, TokenizeRequest, read_request
from server.prompts import chat_prompt
from server.served_model import ServedModel
from server.tool_calling import declared_tools, prompt_tools


class Tokenization:
    def __init__(self, model: ServedModel) -> None:
        self._model = model

    async def tokenize(self, request: Request) -> Response:
        """The token ids of a prompt, or of messages (and tools) through the chat template,
        as the chat endpoint renders them."""
        body = await read_request(TokenizeRequest, request)
        model = self._model
        model.check_name(body.model)
        if body.messages is not None:
            # As the chat endpoint renders them with tool_choice "none" (or "auto").
            tools = prompt_tools(model, declared_tools(body.tools))
            prompt = await chat_prompt(
                model,
                tools.messages(body.messages),
                "messages",
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=tools.template_tools,
                template_kwargs=body.chat_template_kwargs,
            )
            # The template already holds the special tokens (as apply_chat_template does).
            ids = await model.encode(prompt, add_special_tokens=False)
        else:
            assert body.prompt is not None  # the schema wants exactly one of the two
            ids = await model.encode(body.prompt, body.add_special_tokens)
        token_strs = None
        if body.return_token_strs:  # as vLLM: the vocabulary's spelling ("Ġthe")
            token_strs = [model.tokenizer.id_to_token(token_id) for token_id in ids]
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": model.max_model_len,
                "tokens": ids,
                "token_strs": token_strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids."""
        body = await read_request(DetokenizeRequest, request)
        self._model.check_name(body.model)
        self._model.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await self._model.decode_in_thread(body.tokens)})
