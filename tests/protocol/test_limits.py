"""The context-length and prompt log-probabilities checks that the server and the engine
share."""

from __future__ import annotations

import pytest

from protocol import (
    MAX_FRAME_BYTES,
    MAX_TOP_LOGPROBS,
    PromptTokenLogprobs,
    RequestOutput,
    TokenOutputs,
    context_length_problem,
    prompt_logprobs_problem,
)
from protocol.limits import max_prompt_logprobs_tokens


def test_a_request_fits_exactly_up_to_the_context() -> None:
    assert context_length_problem(10, 6, 16) is None
    problem = context_length_problem(10, 7, 16)
    assert problem is not None
    assert "maximum context length is 16 tokens" in problem
    assert "requested 17 tokens (10 in the prompt, 7 in the completion)" in problem


def test_without_max_tokens_the_prompt_leaves_room_for_one_token() -> None:
    assert context_length_problem(15, None, 16, "messages") is None
    problem = context_length_problem(16, None, 16, "messages")
    assert problem is not None
    assert "your messages resulted in 16 tokens" in problem
    assert "reduce the length of the messages" in problem


@pytest.mark.parametrize("prompt_logprobs", [0, 1, MAX_TOP_LOGPROBS])
def test_the_longest_prompt_logprobs_fit_in_a_frame(prompt_logprobs: int) -> None:
    """At the bound, the prompt's log-probabilities at their largest on the wire (ids and
    ranks past 2**16, float64s) fit in the one frame that carries them, with the room left
    for the step's other outputs; one more token is refused."""
    most = max_prompt_logprobs_tokens(prompt_logprobs)
    position = PromptTokenLogprobs(
        -1.5, 2**31, [2**31 + i for i in range(prompt_logprobs)], [-2.5] * prompt_logprobs
    )
    output = RequestOutput("r", [1], None, most, 1, prompt_logprobs=[position] * most)
    assert len(TokenOutputs([output]).encode()) <= MAX_FRAME_BYTES - 2 * 2**20
    assert prompt_logprobs_problem(most, prompt_logprobs) is None
    problem = prompt_logprobs_problem(most + 1, prompt_logprobs)
    assert problem is not None and f"at most {most} prompt tokens" in problem
    assert prompt_logprobs_problem(10**9, None) is None
