"""The context-length limit and the prompt log-probabilities' one, each checked and worded
once for the server and the engine.

The server checks a request before it sends it; the engine checks again, since any
process may send it requests. Both answer in the same words, OpenAI's, which the
server passes on to its client either way.
"""

from __future__ import annotations

from protocol.codec import MAX_FRAME_BYTES

# The most bytes one prompt position's log-probabilities take in MessagePack: the token's
# log-probability (a float64: 9 bytes) and rank (up to a uint32: 5), each alternative's id
# and float64 log-probability (14), and the headers of its three arrays (7 at most).
_POSITION_BYTES = 21
_ALTERNATIVE_BYTES = 14
# What the frame leaves for the rest of its step's outputs (each request's new tokens, with
# their log-probabilities, a few KB).
_FRAME_ROOM_BYTES = 2 * 2**20


def context_length_problem(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_name: str = "prompt"
) -> str | None:
    """Why a prompt of ``prompt_tokens`` tokens, followed by ``max_tokens`` generated ones,
    cannot fit in ``max_model_len`` tokens, or None if it fits.

    ``max_tokens`` None means as many as fit: the prompt must then leave room for one.
    ``prompt_name`` is what the request called its prompt (the chat API's "messages").
    """
    if max_tokens is None:
        if prompt_tokens < max_model_len:
            return None
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_name} resulted in {prompt_tokens} tokens. Please reduce the length of "
            f"the {prompt_name}."
        )
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, "
        f"{max_tokens} in the completion). Please reduce the length of the {prompt_name} or "
        "completion."
    )


def max_prompt_logprobs_tokens(prompt_logprobs: int) -> int:
    """The longest prompt whose log-probabilities, with ``prompt_logprobs`` alternatives at
    each position, a request may ask for: as many as one output frame holds. The engine
    sends them in pieces, a step's at a time, but a server holds them all until it answers
    (the answer carries them in one body), so the bound keeps what one request makes a
    server hold to a frame's bytes: past 200,000 positions even at 20 alternatives."""
    per_position = _POSITION_BYTES + _ALTERNATIVE_BYTES * prompt_logprobs
    return (MAX_FRAME_BYTES - _FRAME_ROOM_BYTES) // per_position


def prompt_logprobs_problem(prompt_tokens: int, prompt_logprobs: int | None) -> str | None:
    """Why the log-probabilities of a prompt of ``prompt_tokens`` tokens cannot be sent, or
    None if they can (or are not asked for)."""
    if prompt_logprobs is None:
        return None
    most = max_prompt_logprobs_tokens(prompt_logprobs)
    if prompt_tokens <= most:
        return None
    return (
        f"The prompt's log-probabilities ({prompt_logprobs} alternatives at each of its "
        f"{prompt_tokens} tokens) are more than one answer carries: at most {most} prompt "
        f"tokens with {prompt_logprobs}. Please shorten the prompt or ask for fewer "
        "(prompt_logprobs, or logprobs with echo)."
    )
