"""Rebuild a Hugging Face tokenizer from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: llama.cpp stores the tokens, merges and special ids under
`tokenizer.ggml.*` and picks its text-splitting rule from the `tokenizer.ggml.pre` name. We rebuild
the same tokenizer with the `tokenizers` library so a server can encode exactly as llama.cpp does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.checkpoint.eos import eos_token_ids
from engine.model_config import TokenizerInfo

logger = logging.getLogger("engine.checkpoint")

# llama.cpp's token types (llama_token_type): only these two need to stay whole in the text.
_CONTROL = 3  # e.g. <|im_end|>: added as special tokens
_USER_DEFINED = 4  # e.g. <think>: added as plain added tokens

# Llama 3's split regex, as in its tokenizer.json and llama.cpp's LLAMA3 pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")  # llama.cpp's names for the same rule
_GPT2_PRE = ("default", "gpt-2")


def gguf_tokenizer_info(metadata: Mapping[str, Any]) -> TokenizerInfo:
    """The tokenizer, chat template and end-of-generation ids a GGUF's metadata describes."""
    tokenizer = build_gguf_tokenizer(metadata)
    chat_template = metadata.get("tokenizer.chat_template")
    declared_eos = [
        metadata.get("tokenizer.ggml.eos_token_id"),
        metadata.get("tokenizer.ggml.eot_token_id"),
        metadata.get("tokenizer.ggml.eom_token_id"),
    ]
    return TokenizerInfo(
        tokenizer_json=tokenizer.to_str(),
        chat_template=chat_template,
        bos_token=_token_text(metadata, "tokenizer.ggml.bos_token_id"),
        eos_token=_token_text(metadata, "tokenizer.ggml.eos_token_id"),
        eos_token_ids=eos_token_ids(declared_eos, chat_template, tokenizer.token_to_id),
    )


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` that encodes as llama.cpp does with this file's vocabulary."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported, only 'gpt2' (byte-level BPE)"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=[_split_merge(merge) for merge in metadata["tokenizer.ggml.merges"]],
            # llama.cpp takes a whole word that is in the vocabulary as is for Llama 3, like
            # tiktoken, instead of merging up to it (which can end elsewhere).
            ignore_merges=pre in _LLAMA3_PRE,
        )
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        _add_whole_tokens(tokenizer, tokens, token_types)
    # A file that does not say gets llama.cpp's default: BOS for Llama 3's vocabulary only.
    if metadata.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRE):
        tokenizer.post_processor = _prepend_bos(metadata)
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from the second character, as llama.cpp does, so a merge whose left side is itself a
    # space still splits in the right place.
    cut = merge.index(" ", 1)
    return merge[:cut], merge[cut + 1 :]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """How text is cut into words before BPE, by llama.cpp's name for the rule."""
    if pre == "smollm":
        # SmolLM's vocabulary was trained with every digit on its own.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRE:
        logger.warning(
            "GGUF pre-tokenizer %r is not known here; splitting text like GPT-2, "
            "so token ids may differ from llama.cpp's",
            pre,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _add_whole_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Match control and user-defined tokens whole in the text, as llama.cpp does.

    BPE would otherwise cut `<|im_end|>` into pieces. They are in the vocabulary already, so
    adding them keeps their ids.
    """
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == _CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == _USER_DEFINED
        ]
    )


def _prepend_bos(metadata: Mapping[str, Any]) -> processors.TemplateProcessing:
    bos_id = metadata["tokenizer.ggml.bos_token_id"]
    bos = metadata["tokenizer.ggml.tokens"][bos_id]
    return processors.TemplateProcessing(
        single=[bos, "$A"],
        pair=[bos, "$A", f"{bos}:1", "$B:1"],
        special_tokens=[(bos, bos_id)],
    )


def _token_text(metadata: Mapping[str, Any], id_key: str) -> str | None:
    token_id = metadata.get(id_key)
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]
