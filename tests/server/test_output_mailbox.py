"""A request's outputs merge while its handler is busy, and only when asked to."""

from __future__ import annotations

import asyncio

from protocol import PromptTokenLogprobs, RequestOutput, TokenLogprobs
from server.output_mailbox import OutputMailbox


def output(tokens: list[int], done: int, finish: str | None = None, **extra) -> RequestOutput:
    return RequestOutput("r", tokens, finish, num_prompt_tokens=7, num_output_tokens=done, **extra)


def logprobs(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(-0.5 * token_id, [token_id], [-0.5 * token_id])


def test_outputs_waiting_for_a_busy_handler_arrive_as_one() -> None:
    async def run() -> None:
        seen: list[RequestOutput] = []
        mailbox = OutputMailbox(merge=True, observe=seen.append)
        mailbox.put(output([1], 1, queue_time=0.25, prefill_time=0.125, logprobs=[logprobs(1)]))
        mailbox.put(output([2, 3], 3, logprobs=[logprobs(2), logprobs(3)]))
        mailbox.put(output([], 3, "stop", stop_token_id=9))
        first = await mailbox.get()
        assert first.new_token_ids == [1, 2, 3]
        assert (first.num_output_tokens, first.finish_reason) == (3, "stop")
        assert (first.queue_time, first.prefill_time, first.stop_token_id) == (0.25, 0.125, 9)
        assert [p.top_token_ids[0] for p in first.logprobs or []] == [1, 2, 3]
        assert len(seen) == 3  # the latency metrics still see every step

    asyncio.run(run())


def test_prompt_logprobs_pieces_waiting_arrive_joined_in_order() -> None:
    """A prompt prefilled over several steps sends its log-probabilities in pieces, the
    outputs before its first token's with no tokens."""

    def piece(first_rank: int, count: int) -> list[PromptTokenLogprobs]:
        return [PromptTokenLogprobs(-1.0, rank, [], []) for rank in range(first_rank, count)]

    async def run() -> None:
        mailbox = OutputMailbox(merge=True)
        mailbox.put(output([], 0, prompt_logprobs=piece(1, 4)))
        mailbox.put(output([], 0, prompt_logprobs=piece(4, 6)))
        mailbox.put(output([5], 1, prompt_logprobs=piece(6, 7)))
        mailbox.put(output([6], 2))
        first = await mailbox.get()
        assert first.new_token_ids == [5, 6]
        assert [entry.rank for entry in first.prompt_logprobs or []] == [1, 2, 3, 4, 5, 6]

    asyncio.run(run())


def test_a_handler_that_keeps_up_sees_every_output() -> None:
    async def run() -> None:
        mailbox = OutputMailbox(merge=True)
        for step in range(1, 4):
            mailbox.put(output([step], step))
            assert (await mailbox.get()).new_token_ids == [step]

    asyncio.run(run())


def test_without_merging_every_output_and_error_arrives_in_order() -> None:
    async def run() -> None:
        mailbox = OutputMailbox(merge=False)
        mailbox.put(output([1], 1))
        mailbox.put(output([2], 2))
        error = RuntimeError("engine lost")
        mailbox.put(error)
        assert (await mailbox.get()).new_token_ids == [1]
        assert (await mailbox.get()).new_token_ids == [2]
        assert await mailbox.get() is error

    asyncio.run(run())


def test_an_error_is_not_merged_away() -> None:
    async def run() -> None:
        mailbox = OutputMailbox(merge=True)
        mailbox.put(output([1], 1))
        error = RuntimeError("engine lost")
        mailbox.put(error)
        mailbox.put(output([2], 2))  # cannot follow an error in practice; kept apart anyway
        assert (await mailbox.get()).new_token_ids == [1]
        assert await mailbox.get() is error

    asyncio.run(run())


def test_get_waits_for_the_next_output() -> None:
    async def run() -> None:
        mailbox = OutputMailbox(merge=True)
        waiting = asyncio.ensure_future(mailbox.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        mailbox.put(output([4], 1))
        assert (await waiting).new_token_ids == [4]

    asyncio.run(run())
