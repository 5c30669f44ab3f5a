"""The context-length limit, checked and worded once for the server and the engine.

The server checks a request before it sends it; the engine checks again, since any
process may send it requests. Both answer in the same words, OpenAI's, which the
server passes on to its client either way.
"""

from __future__ import annotations


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
