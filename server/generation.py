"""One request's text, as it is generated: engine outputs in, final text pieces out.

Both endpoints, streamed or not, take their text from here, so a streamed answer
is by construction the same as the non-streamed one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from protocol import (
    ErrorCode,
    FinishReason,
    PromptTokenLogprobs,
    SamplingParams,
    Scheduling,
    TokenLogprobs,
)
from protocol.detokenizer import IncrementalDetokenizer
from server.drain import DrainTimedOut
from server.engine_client import EngineRequestError, EngineUnavailable
from server.engine_pool import EnginePool
from server.errors import ApiError

# Seconds a client refused for a full queue is told to wait (Retry-After): about the time
# a place frees in a busy batch.
RETRY_AFTER_S = 1


@dataclass(slots=True)
class TextDelta:
    text: str  # may be empty in the last delta
    finish_reason: str | None  # set on the last delta only
    completion_tokens: int  # generated so far, stop tokens included
    # The tokens that arrived since the last delta, with their log-probabilities, when the
    # request asked for them (SamplingParams.logprobs); else both empty.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # In the first delta, when the request asked (SamplingParams.prompt_logprobs): one per
    # prompt token after the first.
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


async def generate_text(
    client: EnginePool,
    tokenizer: Tokenizer,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    scheduling: Scheduling,
    stop: Sequence[str],
    include_stop_str_in_output: bool = False,
    hidden_token_ids: frozenset[int] | None = None,
) -> AsyncGenerator[TextDelta, None]:
    """Yields text as it becomes final; the last delta carries the finish reason. A stop
    string ends the text (``include_stop_str_in_output``) or is cut off with what follows;
    so does the text of the EOS or stop token that ended the request (with special tokens
    hidden, an EOS has none).

    ``hidden_token_ids``: None leaves every special token's text out of the text; a set
    keeps special tokens' text (a tool-call parser reads its markers) but these tokens'.

    Raises ``ApiError`` when the engine is gone or refuses the request (429 when its queue
    is full), or when this server's drain cuts it. Closing the iterator early aborts the
    request in the engine.
    """
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        prompt_ids,
        stop,
        include_stop_str_in_output,
        hidden_token_ids,
        sampling.min_tokens,
    )
    token_ids: list[int] = []  # with log-probabilities, not yet in a delta
    logprobs: list[TokenLogprobs] = []
    # The prompt's log-probabilities, joined from the engine's pieces (each step's of the
    # prompt's prefill, all before or with the first token), until the first delta takes them.
    prompt_logprobs: list[PromptTokenLogprobs] | None = (
        [] if sampling.prompt_logprobs is not None else None
    )

    def delta(text: str, finish_reason: str | None, completion_tokens: int) -> TextDelta:
        nonlocal token_ids, logprobs, prompt_logprobs
        result = TextDelta(
            text, finish_reason, completion_tokens, token_ids, logprobs, prompt_logprobs
        )
        token_ids, logprobs, prompt_logprobs = [], [], None
        return result

    timer = client.metrics.request()
    finish_reason: str | None = None  # for the metrics: "error" if it stays None
    try:
        # Without stop strings, outputs that wait while this handler is busy come merged.
        outputs = client.generate(
            request_id, prompt_ids, sampling, scheduling, not stop, timer.output
        )
        async with aclosing(outputs) as outputs:
            async for output in outputs:
                if output.prompt_logprobs is not None:
                    assert prompt_logprobs is not None, "prompt log-probabilities after a delta"
                    prompt_logprobs += output.prompt_logprobs
                text = detokenizer.push(output.new_token_ids)
                # A stop string that ends in a step of several tokens leaves out those after
                # the one it ends in, as a step of one token each would.
                taken = detokenizer.tokens_taken
                if output.logprobs:
                    token_ids.extend(output.new_token_ids[:taken])
                    logprobs.extend(output.logprobs[:taken])
                if detokenizer.stopped:
                    finish_reason = FinishReason.STOP
                    untaken = len(output.new_token_ids) - taken
                    # Leaving this block closes ``outputs``, which aborts the request.
                    yield delta(text, FinishReason.STOP, output.num_output_tokens - untaken)
                    timer.text_passed()
                    return
                if output.finish_reason == FinishReason.ABORT:
                    finish_reason = FinishReason.ABORT
                    # Only the engine aborts a request that this server still reads (it
                    # stopped, or the request broke its grammar).
                    raise ApiError(503, "The engine aborted the request.", code="engine_aborted")
                if output.finish_reason is not None:
                    finish_reason = output.finish_reason
                    if include_stop_str_in_output and output.stop_token_id is not None:
                        text += detokenizer.push([output.stop_token_id])
                    text += detokenizer.finish()
                    yield delta(text, output.finish_reason, output.num_output_tokens)
                    timer.text_passed()
                    return
                if text:
                    yield delta(text, None, output.num_output_tokens)
                    # The consumer asks for the next delta once it passed this one on.
                    timer.text_passed()
    except (GeneratorExit, asyncio.CancelledError):
        # Closed or cancelled before its end (after it, the reason is already set): the
        # client went away.
        finish_reason = finish_reason or FinishReason.ABORT
        raise
    except EngineUnavailable as exc:
        raise engine_unavailable(exc) from exc
    except EngineRequestError as exc:
        raise engine_refusal(exc) from exc
    except DrainTimedOut as exc:
        raise ApiError(503, str(exc), code="server_draining") from exc
    finally:
        timer.finish(finish_reason or "error")


def engine_unavailable(reason: object) -> ApiError:
    """The HTTP error of a request no engine could take (``reason`` says why)."""
    return ApiError(503, f"The engine is unavailable: {reason}.", code="engine_unavailable")


def engine_refusal(exc: EngineRequestError) -> ApiError:
    """The HTTP error of a request the engine refused."""
    if exc.code == ErrorCode.PROMPT_TOO_LONG:
        return ApiError(400, exc.message, code="context_length_exceeded")
    if exc.code == ErrorCode.INVALID_REQUEST:
        return ApiError(400, exc.message)
    if exc.code == ErrorCode.OVERLOADED:
        return overloaded(exc.message)
    if exc.code in (ErrorCode.NOT_READY, ErrorCode.SHUTTING_DOWN):
        return engine_unavailable(exc.message)
    return ApiError(500, f"The engine refused the request: {exc.message}")


def overloaded(reason: str) -> ApiError:
    """The HTTP error of a request refused because the engine's queue is full."""
    return ApiError(
        429,
        f"The server is at capacity: {reason}. Try again in {RETRY_AFTER_S} s.",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
