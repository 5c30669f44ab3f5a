"""Rebuild a Hugging Face tokenizer from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: llama.cpp stores the tokens, merges (or scores) and special ids
under `tokenizer.ggml.*`, and picks its text-splitting rule from the `tokenizer.ggml.pre` name. We
rebuild the tokenizer with the `tokenizers` library as transformers' GGUF loading does
(`transformers.integrations.gguf`), so ids match what the model was trained on:

- `gpt2`: byte-level BPE with the file's merges;
- `llama`: SentencePiece BPE with byte fallback. The file has scores instead of merges, so the
  merges are rebuilt from the vocabulary, ranked by score (Gemma: by position in the file), as
  transformers' `generate_merges` does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from engine.model_config import TokenizerInfo
from protocol.eos import eos_token_ids

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
# Qwen2's split regex, as in transformers' Qwen2Tokenizer and llama.cpp's QWEN2 pre-tokenizer: the
# Llama 3 rule with every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
_GPT2_PRE = ("default", "gpt-2")

# SentencePiece writes a space as this; its byte-fallback tokens are spelled <0x00> to <0xFF>.
_SPACE = "\u2581"
# llama.cpp writes Gemma's vocabulary for these architectures, where transformers builds Gemma's
# tokenizer: no prefix space, and merges in vocabulary order (see `_sentencepiece_tokenizer`).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


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
    """A `tokenizers.Tokenizer` that encodes as transformers does with this file's vocabulary."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_tokenizer(metadata)
        # llama.cpp's default for a file that does not say: BOS for Llama 3's vocabulary only.
        add_bos_default = metadata.get("tokenizer.ggml.pre", "default") in _LLAMA3_PRE
    elif kind == "llama":
        tokenizer = _sentencepiece_tokenizer(metadata)
        add_bos_default = True  # llama.cpp's and transformers' default for SentencePiece
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported, only 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)"
        )
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        _add_whole_tokens(tokenizer, metadata["tokenizer.ggml.tokens"], token_types)
    tokenizer.post_processor = _special_tokens_around(
        metadata,
        add_bos=metadata.get("tokenizer.ggml.add_bos_token", add_bos_default),
        add_eos=metadata.get("tokenizer.ggml.add_eos_token", False),
    )
    return tokenizer


def _byte_level_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
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
    return tokenizer


def _sentencepiece_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """SentencePiece BPE as transformers' LlamaTokenizer or GemmaTokenizer builds it."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    gemma = metadata.get("general.architecture") in _GEMMA_ARCHITECTURES
    if gemma:
        # llama.cpp stores Gemma's tokens of two or more spaces with real spaces, where the
        # tokenizer looks them up as SentencePiece spaces: spell them that way again.
        tokens = [
            _SPACE * len(token) if token.isspace() and " " in token else token for token in tokens
        ]
        # Gemma's scores do not follow its merge order; the order of the vocabulary does.
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, metadata["tokenizer.ggml.scores"], strict=True))
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=_merges_by_rank(vocab, ranks),
        fuse_unk=True,
        byte_fallback=True,
        # As in transformers: GemmaTokenizer names its unknown token, LlamaTokenizer does not.
        **({"unk_token": "<unk>"} if gemma else {}),
    )
    tokenizer = Tokenizer(model)
    pieces_to_text = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        # Spaces become SentencePiece spaces; no space is put before the text.
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
        # No space is left to split on after the normalizer; Gemma's own tokenizer.json has this
        # all the same, and so the rebuilt one has it too.
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tokenizer.decoder = decoders.Sequence(pieces_to_text)
    else:
        # Llama 2 style: a space is put before the text, and taken off again when decoding.
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
        tokenizer.decoder = decoders.Sequence([*pieces_to_text, decoders.Strip(" ", 1, 0)])
    return tokenizer


def _merges_by_rank(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-ranked token first, as transformers'
    `generate_merges` orders them (ties: longer left part, then longer right part first)."""
    merges: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        splits = [
            (token[:cut], token[cut:], rank)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        merges.extend(sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]])))
    # A stable sort, in reverse: equal keys keep the order above, as in transformers.
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


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
    for names, split in ((_LLAMA3_PRE, _LLAMA3_SPLIT), (_QWEN2_PRE, _QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
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
    adding them keeps their ids. A user-defined token the vocabulary spells otherwise (Gemma's runs
    of spaces, respelled above) is left out, as transformers does: adding it would make a new id
    past the model's embedding.
    """
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == _CONTROL
        ]
    )
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=True)
            if token_type == _USER_DEFINED and token in vocab
        ]
    )


def _special_tokens_around(
    metadata: Mapping[str, Any], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    """BOS before and EOS after each sequence where the file asks for them, as transformers'
    `update_post_processor` does; None when neither is added."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    bos_id = metadata.get("tokenizer.ggml.bos_token_id") if add_bos else None
    eos_id = metadata.get("tokenizer.ggml.eos_token_id") if add_eos else None
    if bos_id is None and eos_id is None:
        return None

    def sequence(name: str, type_id: int) -> list[str]:
        bos = [] if bos_id is None else [f"{tokens[bos_id]}:{type_id}"]
        eos = [] if eos_id is None else [f"{tokens[eos_id]}:{type_id}"]
        return [*bos, f"${name}:{type_id}", *eos]

    return processors.TemplateProcessing(
        single=sequence("A", 0),
        pair=sequence("A", 0) + sequence("B", 1),
        special_tokens=[(tokens[i], i) for i in (bos_id, eos_id) if i is not None],
    )


def _token_text(metadata: Mapping[str, Any], id_key: str) -> str | None:
    token_id = metadata.get(id_key)
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]
