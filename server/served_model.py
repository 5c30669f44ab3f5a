"""What a server knows about the model it serves; all of it comes from the handshake."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from tokenizers import Tokenizer

from protocol import HandshakeReply
from server.chat_template import ChatTemplate, ChatTemplateError
from server.errors import ApiError
from server.fill_in_middle import FillInMiddle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    vocab_size: int  # token ids at or above this are not the tokenizer's
    max_model_len: int
    created: int  # unix time, for /v1/models
    chat_template: ChatTemplate | None
    # Why there is no chat template (the chat endpoint answers with it), or None.
    chat_template_problem: str | None
    fill_in_middle: FillInMiddle | None  # None: the tokenizer cannot take a suffix

    @classmethod
    def from_handshake(cls, reply: HandshakeReply) -> ServedModel:
        tokenizer = Tokenizer.from_str(reply.tokenizer_json)
        template, problem = None, None
        if reply.chat_template is None:
            problem = (
                f"The model {reply.model_name} has no chat template, so this server cannot "
                "turn messages into a prompt; use /v1/completions with a prompt instead."
            )
        else:
            try:
                template = ChatTemplate(reply.chat_template, reply.bos_token, reply.eos_token)
            except ChatTemplateError as exc:
                problem = str(exc)
                logger.error("%s; the chat endpoint will refuse requests", problem)
        return cls(
            name=reply.model_name,
            tokenizer=tokenizer,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            max_model_len=reply.max_model_len,
            created=int(reply.engine_started_at),
            chat_template=template,
            chat_template_problem=problem,
            fill_in_middle=FillInMiddle.of(tokenizer),
        )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt is
        # tokenized in a thread while the event loop keeps streaming other answers.
        def run() -> list[int]:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

        return await asyncio.to_thread(run)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def check_name(self, name: str | None) -> None:
        """Refuses a request for another model (one that names none is for this one)."""
        if name is not None and name != self.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. This server serves `{self.name}`.",
                param="model",
                code="model_not_found",
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Refuses token ids beyond the vocabulary, naming the request's ``param``."""
        # Non-negative is checked by the schema; the upper bound depends on the model.
        if token_ids and max(token_ids) >= self.vocab_size:
            raise ApiError(
                400,
                f"Token id {max(token_ids)} is out of range: the vocabulary has "
                f"{self.vocab_size} tokens.",
                param=param,
            )
