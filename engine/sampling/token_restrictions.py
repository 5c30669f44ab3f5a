"""Dead ends: a request whose own token restrictions (allowed_token_ids, bad words,
min_tokens) and grammar together leave no token to sample, or whose grammar alone does (one
that matches no text).

The sampler cannot tell: every logit is -inf, and the argmax it takes is token 0, whatever
that is. Checking the step's masks on the device would cost a sync each step; instead the
host checks each token it reads of such a request against the request's own restrictions
(a set lookup, a few bad words), and its grammar checks the rest as it accepts the token.
A token that breaks them can only come from a dead end, which the engine then reports to
the request's user rather than send text it never allowed.
"""

from __future__ import annotations

from engine.scheduling.request import Request


def may_dead_end(request: Request) -> bool:
    """Whether the request's restrictions can leave it no token: allowed tokens can all be
    banned, and a grammar can want only banned ones; bad words or min_tokens alone cannot."""
    return request.grammar is not None or request.allowed_token_set is not None


def breaks_restrictions(request: Request, token: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether ``token``, the request's next output token, is one its allowed_token_ids, bad
    words or min_tokens forbid there (as engine/execution/batch.py masks them)."""
    sampling = request.sampling
    if request.allowed_token_set is not None and token not in request.allowed_token_set:
        return True
    output = request.output_token_ids
    if len(output) < sampling.min_tokens and (
        token in eos_token_ids or token in request.stop_token_set
    ):
        return True
    return any(
        word[-1] == token
        and len(word) - 1 <= len(output)
        and output[len(output) - len(word) + 1 :] == word[:-1]
        for word in sampling.bad_words_token_ids
    )


def dead_end_message(request: Request) -> str:
    """What the user of a request at a dead end is told."""
    sampling = request.sampling
    given = [
        name
        for name, present in (
            ("the structured output", request.grammar is not None),
            ("allowed_token_ids", sampling.allowed_token_ids is not None),
            ("bad_words", bool(sampling.bad_words_token_ids)),
            ("min_tokens", sampling.min_tokens > 0),
        )
        if present
    ]
    if len(given) == 1:
        allow_none = f"{given[0]} allows none"
    else:
        allow_none = f"{', '.join(given[:-1])} and {given[-1]} together allow none"
    return (
        f"No token is left to sample at output token {len(request.output_token_ids) + 1}: "
        f"{allow_none}, so the generation cannot go on."
    )
