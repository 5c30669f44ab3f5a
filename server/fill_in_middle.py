"""Fill in the middle: a completion's ``suffix``, for models trained to write the text
between a prefix and a suffix.

Such a model's tokenizer has three special tokens; the prompt is prefix token, prefix,
suffix token, suffix, middle token (the "PSM" order), and the model generates the
middle. Tokenizers without them cannot do this, and a ``suffix`` for them is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

# Each family's prefix, suffix and middle tokens.
_TOKEN_SETS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
)


@dataclass(frozen=True)
class FillInMiddle:
    prefix_token: str
    suffix_token: str
    middle_token: str

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FillInMiddle | None:
        """The tokenizer's fill-in-the-middle tokens, or None if it has none."""
        for tokens in _TOKEN_SETS:
            if all(tokenizer.token_to_id(token) is not None for token in tokens):
                return cls(*tokens)
        return None

    def prompt(self, prefix: str, suffix: str) -> str:
        """The prompt text whose completion is the text between ``prefix`` and ``suffix``;
        tokenized as any prompt is, it gets the tokenizer's BOS token if it adds one."""
        return f"{self.prefix_token}{prefix}{self.suffix_token}{suffix}{self.middle_token}"
