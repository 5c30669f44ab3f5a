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

import numpy as np

from engine.scheduling.request import Request


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
                tokens = _token_array(request)
                continuation, length = find_continuation(tokens, self.min_n, self.max_n, count)
                found = continuation.tolist()
            drafts.append(found)
            lengths.append(length)
        return drafts, lengths

    def preview(self, request: Request) -> int:
        """The length of the n-gram the host's tokens of the request end in that occurred
        before (0: none): where the lookup would draft from, once the token in flight is
        read."""
        _, length = find_continuation(_token_array(request), self.min_n, self.max_n, 1)
        return length


def find_continuation(
    tokens: np.ndarray, min_n: int, max_n: int, count: int
) -> tuple[np.ndarray, int]:
    """Up to ``count`` tokens that followed the latest earlier occurrence of the longest
    suffix of ``tokens`` (between ``max_n`` and ``min_n`` long) that occurred before, and
    that suffix's length (0: none occurred)."""
    length = tokens.size
    # Where an occurrence of the shortest suffix ends (filtered back from the earlier
    # copies of the last token one token at a time: text that does not repeat is told
    # apart in a step or two), then how far back each of those matches, all at once: the
    # longer suffixes' occurrences are among the shorter's. (Trying each length from the
    # longest down cost several times as much where nothing matched.)
    shortest = min(min_n, length - 1)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(2, shortest + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
    if shortest < min_n or ends.size == 0:
        return tokens[:0], 0
    # The latest occurrence, if it matches as far back as any can, is the one: text being
    # copied finds it so, at the cost of one comparison (a lookup a request a step).
    longest = min(max_n, length - 1)
    latest = int(ends[-1])
    if (
        latest >= longest - 1
        and (tokens[latest - longest + 1 : latest + 1] == tokens[length - longest :]).all()
    ):
        return tokens[latest + 1 : latest + 1 + count], longest
    back = np.arange(min_n, longest)  # how far back each further token lies
    positions = ends[:, None] - back
    matches = (tokens[np.maximum(positions, 0)] == tokens[length - 1 - back]) & (positions >= 0)
    lengths = min_n + np.cumprod(matches, axis=1).sum(axis=1)
    found = int(lengths.max())
    latest = ends[lengths == found][-1]
    return tokens[latest + 1 : latest + 1 + count], found


def _token_array(request: Request) -> np.ndarray:
    """The request's prompt and output as one array. The array is kept with the request and
    extended by the tokens it gained since the last step: copying the whole output into a
    new array every step cost more than the lookup."""
    prompt_len = len(request.prompt_token_ids)
    total = prompt_len + len(request.output_token_ids)
    array = request.token_array
    if array is None or array.size < total:
        grown = np.empty(max(2 * total, 256), np.int64)
        if array is None:
            grown[:prompt_len] = request.prompt_token_ids
            request.num_arrayed_tokens = prompt_len
        else:
            grown[: request.num_arrayed_tokens] = array[: request.num_arrayed_tokens]
        array = request.token_array = grown
    done = request.num_arrayed_tokens
    if done < total:
        array[done:total] = request.output_token_ids[done - prompt_len :]
        request.num_arrayed_tokens = total
    return array[:total]
