"""Prompt-lookup (n-gram) drafts: the tokens that followed the last time the request's latest
n tokens appeared in its own prompt and output.

No second model: it pays off where the output copies its input (code edits, summaries and
answers quoting a document, RAG). As vLLM's, it looks for the longest n-gram between
``prompt_lookup_max`` and ``prompt_lookup_min`` tokens; among its occurrences it takes the
latest, the likeliest to go on as the output does now. Each proposal's key is the length of
the n-gram it matched: a long match is copying, a short one often chance, and the adaptive
policy (``engine/speculative/adaptive.py``) measures the acceptance of each length apart, so
that the lengths a request drafts from follow what was accepted.
"""

from __future__ import annotations

from array import array

import numpy as np

from engine.scheduling.request import Request

# A token id's bytes in the lookup's byte string (int32: every vocabulary fits).
_TOKEN_BYTES = 4
# The most tokens searched as bytes; longer sequences as an array (``find_continuation``).
_LONGEST_BYTE_SEARCH = 4096


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"prompt lookup needs 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max "
                f"({max_n})"
            )
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, requests: list[Request], max_drafts: list[int]
    ) -> tuple[list[list[int]], list[int]]:
        """Up to ``min(num_speculative_tokens, max_drafts[i])`` tokens to follow each
        request's tokens, all read by the host, and the length of the n-gram they follow;
        none (and 0) where its last n-gram appeared nowhere before. (A lookup in each
        request's own tokens: one at a time, on the host.)"""
        drafts, lengths = [], []
        for request, limit in zip(requests, max_drafts, strict=True):
            count = min(self.num_speculative_tokens, limit)
            found, length = [], 0
            if count > 0:
                tokens = _token_bytes(request)
                found, length = find_continuation(tokens, self.min_n, self.max_n, count)
            drafts.append(found)
            lengths.append(length)
        return drafts, lengths

    def preview(self, request: Request) -> int:
        """The length of the n-gram the host's tokens of the request end in that occurred
        before (0: none): where the lookup would draft from, once the token in flight is
        read."""
        _, length = find_continuation(_token_bytes(request), self.min_n, self.max_n, 1)
        return length


def find_continuation(
    tokens: bytearray, min_n: int, max_n: int, count: int
) -> tuple[list[int], int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (int32 ids, ``_token_bytes``' layout; between ``max_n`` and
    ``min_n`` tokens long) that occurred before, and that suffix's length (0: none occurred).

    Up to ``_LONGEST_BYTE_SEARCH`` tokens each length is found with one backward search of
    the byte string (``bytearray.rfind``, a C loop): the shortest suffix first (most text
    repeats none, and is told apart in one search), then the longest (text being copied
    matches it at once), then the lengths between from the short end, whose occurrences are
    among the shorter's, so the first that is missing ends the search. Past it numpy's
    comparisons of the whole array (``_find_in_array``): the byte search goes about a byte a
    step where the ids' bytes repeat (their high bytes are mostly zero), while numpy's
    handful of calls costs about the same fixed overhead whatever the length, so each is the
    faster on its side (docs/benchmarks.md has the crossover)."""
    length = len(tokens) // _TOKEN_BYTES
    if length - 1 < min_n:
        return [], 0
    if length > _LONGEST_BYTE_SEARCH:
        return _find_in_array(np.frombuffer(tokens, np.int32), min_n, max_n, count)
    before_last = (length - 1) * _TOKEN_BYTES  # an occurrence ends before the last token
    found, start = min_n, _latest(tokens, min_n, before_last)
    if start < 0:
        return [], 0
    longest = min(max_n, length - 1)
    start_longest = _latest(tokens, longest, before_last) if longest > min_n else -1
    if start_longest >= 0:
        found, start = longest, start_longest
    else:
        for n in range(min_n + 1, longest):
            start_n = _latest(tokens, n, before_last)
            if start_n < 0:
                break
            found, start = n, start_n
    first = start // _TOKEN_BYTES + found  # the token after the occurrence
    last = min(first + count, length)
    return array("i", tokens[first * _TOKEN_BYTES : last * _TOKEN_BYTES]).tolist(), found


def _find_in_array(tokens: np.ndarray, min_n: int, max_n: int, count: int) -> tuple[list[int], int]:
    """``find_continuation`` over an array of at least ``min_n`` + 1 ids: where an
    occurrence of the shortest suffix ends (filtered back from the earlier copies of the last
    token one token at a time: text that does not repeat is told apart in a step or two),
    then how far back each of those matches, all at once: the longer suffixes' occurrences
    are among the shorter's."""
    length = tokens.size
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(2, min_n + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
    if ends.size == 0:
        return [], 0
    # The latest occurrence, if it matches as far back as any can, is the one: text being
    # copied finds it so, at the cost of one comparison.
    longest = min(max_n, length - 1)
    latest = int(ends[-1])
    if (
        latest >= longest - 1
        and (tokens[latest - longest + 1 : latest + 1] == tokens[length - longest :]).all()
    ):
        return tokens[latest + 1 : latest + 1 + count].tolist(), longest
    back = np.arange(min_n, longest)  # how far back each further token lies
    positions = ends[:, None] - back
    matches = (tokens[np.maximum(positions, 0)] == tokens[length - 1 - back]) & (positions >= 0)
    lengths = min_n + np.cumprod(matches, axis=1).sum(axis=1)
    found = int(lengths.max())
    latest = int(ends[lengths == found][-1])
    return tokens[latest + 1 : latest + 1 + count].tolist(), found


def _latest(tokens: bytearray, n: int, end: int) -> int:
    """Where (in bytes) the latest occurrence of ``tokens``' last ``n`` tokens starts that ends
    by byte ``end``; -1: none. A match of the bytes that does not start at a token's first
    byte spans two tokens and is no occurrence: the search goes on before it."""
    suffix = tokens[-n * _TOKEN_BYTES :]
    while True:
        start = tokens.rfind(suffix, 0, end)
        if start % _TOKEN_BYTES == 0 or start < 0:
            return start
        end = start + len(suffix) - 1


def _token_bytes(request: Request) -> bytearray:
    """The request's prompt and output as int32 ids in one byte string, kept with the request
    and extended by the tokens it gained since the last step: copying the whole output every
    step cost more than the lookup."""
    prompt_len = len(request.prompt_token_ids)
    if request.token_bytes is None:
        request.token_bytes = bytearray(array("i", request.prompt_token_ids))
        request.num_byte_tokens = prompt_len
    done = request.num_byte_tokens
    if done < prompt_len + len(request.output_token_ids):
        request.token_bytes += array("i", request.output_token_ids[done - prompt_len :])
        request.num_byte_tokens = prompt_len + len(request.output_token_ids)
    return request.token_bytes
