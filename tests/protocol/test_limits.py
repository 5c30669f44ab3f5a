"""The context-length check that the server and the engine share."""

from __future__ import annotations

from protocol import context_length_problem


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
