"""What a server knows about the model it serves; all of it comes from the handshake."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from protocol import MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS, HandshakeReply, SamplingDefaults
from protocol.chat_template import ChatTemplate, ChatTemplateError
from protocol.eos import eos_token_ids
from server.errors import ApiError
from server.fill_in_middle import FillInMiddle
from server.reasoning_parsers import REASONING_PARSERS, reasoning_parser_for_template
from server.tool_parsers import TOOL_PARSERS, tool_parser_for_template

logger = logging.getLogger(__name__)

# --max-generated-tokens by default: this many whole contexts, over a request's choices.
_DEFAULT_GENERATED_CONTEXTS = 4
# Chat templates shipped with the server, by the name --chat-template takes for them.
_PACKAGED_TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class ChatOptions:
    """The server's options about chat answers (``python -m server``): a chat template to
    use instead of the model's (a path, or a packaged template's name), the parsers of
    tool calls and reasoning (None: the ones the template's markers call for), and the most
    tokens one request may generate in all, over its n choices (None: 4 contexts' worth)."""

    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_generated_tokens: int | None = None


def load_chat_template(name_or_path: str) -> str:
    """The source of ``--chat-template``: a packaged template's name, or a file."""
    packaged = _PACKAGED_TEMPLATES / f"{name_or_path}.jinja"
    path = packaged if packaged.is_file() else Path(name_or_path)
    try:
        return path.read_text()
    except OSError as exc:
        packaged_names = ", ".join(sorted(p.stem for p in _PACKAGED_TEMPLATES.glob("*.jinja")))
        raise ValueError(
            f"--chat-template {name_or_path}: not a packaged template ({packaged_names}) "
            f"nor a readable file: {exc}"
        ) from exc


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
    # The tool-call parser (a TOOL_PARSERS name) for tool_choice "auto", or None: none known.
    tool_parser: str | None = None
    reasoning_parser: str | None = None  # a REASONING_PARSERS name, or None: no reasoning
    # Tokens whose text never shows in an answer, even where special tokens are kept.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Of those, the end-of-turn tokens of --chat-template that the engine does not stop on (it
    # knows the checkpoint's template only): each request asks for them as stop tokens.
    template_eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # For the sampling fields a request leaves out (the model's generation_config.json).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Whether the tokenizer's decoder puts spaces between added tokens (WordPiece's does;
    # byte-level BPE's and SentencePiece's do not), which vLLM's
    # spaces_between_special_tokens false would take out.
    spaces_between_added_tokens: bool = False
    # The most tokens one request may generate over all its choices (n × max_tokens):
    # --max-generated-tokens, by default as many as four whole contexts.
    max_generated_tokens: int = 0
    # The most engine requests (choices, embedding inputs) the engines take at once when
    # idle (the handshake's); None: no bound known.
    max_requests_at_once: int | None = None

    @classmethod
    def from_handshake(
        cls, reply: HandshakeReply, options: ChatOptions | None = None
    ) -> ServedModel:
        options = options or ChatOptions()
        tokenizer = Tokenizer.from_str(reply.tokenizer_json)
        template, problem = None, None
        source = reply.chat_template
        engine_eos = frozenset(reply.eos_token_ids)
        template_eos: frozenset[int] = frozenset()
        if options.chat_template is not None:
            source = load_chat_template(options.chat_template)
            template_eos = frozenset(eos_token_ids([], source, tokenizer.token_to_id)) - engine_eos
        if source is None:
            problem = (
                f"The model {reply.model_name} has no chat template, so this server cannot "
                "turn messages into a prompt; use /v1/completions with a prompt instead."
            )
        else:
            try:
                template = ChatTemplate(source, reply.bos_token, reply.eos_token)
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
            tool_parser=_parser_name(
                options.tool_call_parser, TOOL_PARSERS, tool_parser_for_template, source
            ),
            reasoning_parser=_parser_name(
                options.reasoning_parser, REASONING_PARSERS, reasoning_parser_for_template, source
            ),
            eos_token_ids=engine_eos | template_eos,
            template_eos_token_ids=template_eos,
            sampling_defaults=reply.sampling_defaults,
            spaces_between_added_tokens=_spaces_between_added_tokens(tokenizer),
            max_generated_tokens=options.max_generated_tokens
            or _DEFAULT_GENERATED_CONTEXTS * reply.max_model_len,
            max_requests_at_once=reply.max_requests_at_once,
        )

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt is
        # tokenized in a thread while the event loop keeps streaming other answers.
        def run() -> list[int]:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

        return await asyncio.to_thread(run)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def decode_in_thread(self, token_ids: list[int]) -> str:
        """``decode`` for ids of any number (a body holds millions): decode_batch releases
        the GIL (decode does not), so the event loop keeps streaming other answers."""

        def run() -> str:
            return self.tokenizer.decode_batch([token_ids], skip_special_tokens=False)[0]

        return await asyncio.to_thread(run)

    def check_name(self, name: str | None) -> None:
        """Refuses a request for another model (one that names none is for this one)."""
        if name is not None and name != self.name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. This server serves `{self.name}`.",
                param="model",
                code="model_not_found",
            )

    def check_requests_at_once(self, count: int, what: str, param: str) -> None:
        """Refuses an HTTP request of ``count`` engine requests (``what``: its choices, its
        inputs) if that is more than the engines take at once when idle: the engine would
        refuse the excess as overloaded (429) however often the request were retried."""
        bound = self.max_requests_at_once
        if bound is not None and count > bound:
            raise ApiError(
                400,
                f"This request has {count} {what}, more than the engine takes at once "
                f"({bound}: --max-num-seqs plus --max-queued-requests). Please send fewer.",
                param=param,
                code="invalid_value",
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


def _spaces_between_added_tokens(tokenizer: Tokenizer) -> bool:
    added = list(tokenizer.get_added_tokens_decoder().items())[:2]
    if len(added) < 2:
        return False
    ids = [token_id for token_id, _ in added]
    joined = "".join(token.content for _, token in added)
    return tokenizer.decode(ids, skip_special_tokens=False) != joined


def _parser_name(
    chosen: str | None,
    known: Mapping[str, object],
    for_template: Callable[[str], str | None],
    template_source: str | None,
) -> str | None:
    """The parser the option names (checked against ``known``), else the template's."""
    if chosen is not None:
        if chosen not in known:
            raise ValueError(f"unknown parser {chosen!r}; known: {', '.join(sorted(known))}")
        return chosen
    return None if template_source is None else for_template(template_source)
