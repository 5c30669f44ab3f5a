"""What a server knows about the model it serves; all of it comes from the handshake."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from tokenizers import Tokenizer

from protocol import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS, HandshakeReply, SamplingDefaults
from server.chat_template import ChatTemplate, ChatTemplateError
from server.errors import ApiError

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
    # For the sampling fields a request leaves out (the model's generation_config.json).
    sampling_defaults: SamplingDefaults

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
            sampling_defaults=reply.sampling_defaults,
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

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word tokenized as it is (its leading
        spaces stripped) and, where that makes a word of another first token but as many
        tokens, after a space too (as it reads mid-text)."""
        sequences: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
            if not bare:
                raise ApiError(
                    400, "bad_words entries must tokenize to at least one token.", param="bad_words"
                )
            sequences.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS or sum(map(len, sequences)) > MAX_BAD_WORDS_TOKENS:
            raise ApiError(
                400,
                f"Too many bad words: they tokenize to {len(sequences)} sequences of "
                f"{sum(map(len, sequences))} tokens; at most {MAX_BAD_WORDS} sequences of "
                f"{MAX_BAD_WORDS_TOKENS} tokens in all are allowed.",
                param="bad_words",
            )
        return sequences
