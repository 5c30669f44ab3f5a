"""The engine's per-token log-probabilities in the OpenAI API's two shapes, and the
prompt's in vLLM's.

Chat completions list one object per token (its text, log-probability, UTF-8 bytes and
the likeliest alternatives); completions give parallel lists (tokens, their
log-probabilities, the alternatives as {text: log-probability} maps, and each token's
character offset in the completion). A token's text is that token decoded alone: a token
holding part of a multi-byte character shows a replacement character there, as in vLLM;
or, with vLLM's return_tokens_as_token_ids, "token_id:ID".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol import PromptTokenLogprobs, TokenLogprobs
from server.generation import TextDelta
from server.served_model import ServedModel

# The least log-probability written, as OpenAI's and vLLM's: a token that a structured
# output forbids has -inf, which JSON cannot hold.
_MIN_LOGPROB = -9999.0

# Some tokens' log-probabilities in one endpoint's shape: ``chat_logprobs`` bound to its
# model, or a choice's ``CompletionLogprobs.render``.
RenderLogprobs = Callable[[list[int], list[TokenLogprobs]], dict[str, Any]]
# A prompt's tokens' log-probabilities, for echo: a choice's
# ``CompletionLogprobs.render_prompt``.
RenderPromptLogprobs = Callable[[list[int], list[PromptTokenLogprobs]], dict[str, Any]]


def logprobs_of(render: RenderLogprobs | None, delta: TextDelta) -> dict[str, Any] | None:
    """``delta``'s tokens' log-probabilities as ``render`` writes them; None if not asked."""
    return None if render is None else render(delta.token_ids, delta.logprobs)


def token_text(model: ServedModel, token_id: int, as_token_id: bool = False) -> str:
    """How a token is named in log-probabilities: its text, or "token_id:ID" (vLLM's
    return_tokens_as_token_ids, for tokens whose text is not theirs alone)."""
    return f"token_id:{token_id}" if as_token_id else model.decode([token_id])


def chat_logprobs(
    model: ServedModel,
    token_ids: list[int],
    logprobs: list[TokenLogprobs],
    *,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion or chunk: {"content": [...]}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(model, token_id, as_token_ids)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    content = []
    for token_id, token in zip(token_ids, logprobs, strict=True):
        top = zip(token.top_token_ids, token.top_logprobs, strict=True)
        content.append(
            entry(token_id, token.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in top]}
        )
    return {"content": content}


class CompletionLogprobs:
    """``choices[].logprobs`` of a completion or of its chunks, one after another: the
    character offsets run on from chunk to chunk."""

    def __init__(self, model: ServedModel, as_token_ids: bool = False) -> None:
        self._model = model
        self._as_token_ids = as_token_ids
        self._offset = 0

    def _tokens_and_offsets(self, token_ids: list[int]) -> tuple[list[str], list[int]]:
        """Each token's text and where it starts in the text rendered so far (which it
        extends)."""
        tokens, offsets = [], []
        for token_id in token_ids:
            text = self._text(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
        return tokens, offsets

    def render(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, offsets = self._tokens_and_offsets(token_ids)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(token.logprob) for token in logprobs],
            "top_logprobs": [
                {
                    self._text(i): _finite(lp)
                    for i, lp in zip(token.top_token_ids, token.top_logprobs, strict=True)
                }
                for token in logprobs
            ],
            "text_offset": offsets,
        }

    def render_prompt(
        self, prompt_ids: list[int], logprobs: list[PromptTokenLogprobs]
    ) -> dict[str, Any]:
        """The prompt's tokens, for ``echo`` with ``logprobs``, as vLLM lists them before the
        completion's: the first has no log-probability (nothing precedes it), null."""
        tokens, offsets = self._tokens_and_offsets(prompt_ids)
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [_finite(token.logprob) for token in logprobs],
            "top_logprobs": [None]
            + [
                {
                    self._text(i): _finite(lp)
                    for i, lp in zip(token.top_token_ids, token.top_logprobs, strict=True)
                }
                for token in logprobs
            ],
            "text_offset": offsets,
        }

    def _text(self, token_id: int) -> str:
        return token_text(self._model, token_id, self._as_token_ids)


def joined_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two runs of completion log-probabilities (an echoed prompt's, then its completion's)
    as one: each list goes on with the second's."""
    return {key: first[key] + then[key] for key in first}


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def prompt_logprobs(
    model: ServedModel, prompt_ids: list[int], logprobs: list[PromptTokenLogprobs]
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing precedes it),
    then for each other a map from token id to its log-probability, rank and text: the
    prompt token's own first, then the likeliest tokens', ranked 1, 2, ..."""

    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": model.decode([token_id])}

    rendered: list[dict[int, dict[str, Any]] | None] = [None]
    for token_id, token in zip(prompt_ids[1:], logprobs, strict=True):
        position = {token_id: entry(token_id, token.logprob, token.rank)}
        top = zip(token.top_token_ids, token.top_logprobs, strict=True)
        for rank, (top_id, logprob) in enumerate(top, start=1):
            position[top_id] = entry(top_id, logprob, rank)
        rendered.append(position)
    return rendered
