"""POST /v1/completions: prompts (text or token ids) in, their continuations out.

A request's prompts make a batch: prompt ``i``'s ``n`` choices answer with the indexes
``i * n`` to ``i * n + n - 1``, as OpenAI numbers them. With ``best_of``, each prompt
generates that many candidates and its ``n`` likeliest answer.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.answer import Answer, whole_answer
from server.choices import ChoiceDeltas, PreparedGeneration
from server.engine_pool import EnginePool
from server.generation import TextDelta
from server.logprobs import CompletionLogprobs, joined_logprobs, prompt_logprobs
from server.openai_schemas import CompletionRequest, read_request
from server.prompts import completion_prompts
from server.request_id import client_address, request_id
from server.served_model import ServedModel
from server.streaming import CompletionChunks, streamed_response


class Completions:
    def __init__(self, client: EnginePool, model: ServedModel) -> None:
        self._client = client
        self._model = model

    async def create(self, request: Request) -> Response:
        body = await read_request(CompletionRequest, request)
        self._model.check_name(body.model)
        prompts = await completion_prompts(self._model, body)
        self._model.check_requests_at_once(
            len(prompts) * body.num_candidates,
            "choices to generate (its prompts times n, or best_of)",
            "prompt" if len(prompts) > 1 else "n",
        )
        prompt_tokens = sum(len(prompt.ids) for prompt in prompts)
        answer = Answer.new(
            "cmpl-", "text_completion", self._model.name, request_id(request), prompt_tokens
        )
        choices: list[ChoiceDeltas] = []
        for index, prompt in enumerate(prompts):
            generation = PreparedGeneration(
                prompt.ids,
                body.sampling_params(len(prompt.ids), self._model),
                body.stop,
                body.num_candidates,
                body.include_stop_str_in_output,
                body.hidden_token_ids(self._model),
                body.scheduling(client_address(request)),
            )
            choices += generation.choices(
                self._client, self._model.tokenizer, f"{answer.engine_id}-{index}"
            )
        if body.prompt_only:
            choices = [_prompt_only(deltas) for deltas in choices]
        # Each choice's prompt text, for echo, in the order of the choices.
        echoes = [prompt.echo or "" for prompt in prompts for _ in range(body.num_choices)]

        # Each choice's prompt ids, in the order of the choices.
        choice_prompts = [prompt.ids for prompt in prompts for _ in range(body.num_candidates)]

        def renderer() -> CompletionLogprobs | None:
            # Each choice's own: its text offsets run on from chunk to chunk.
            if body.logprobs is None:
                return None
            return CompletionLogprobs(self._model, body.return_tokens_as_token_ids)

        if body.stream:  # best_of is refused with stream, so every candidate is a choice
            renderers = [renderer() for _ in choices]
            chunks = CompletionChunks(
                answer,
                body.include_usage,
                [None if r is None else r.render for r in renderers],
                echoes if body.echo else None,
                continuous_usage=body.continuous_usage,
                prompt_tokens=[len(ids) for ids in choice_prompts],
                echo_logprobs=[
                    (ids, r.render_prompt)
                    for ids, r in zip(choice_prompts, renderers, strict=True)
                    if r is not None
                ]
                if body.echo_logprobs
                else None,
            )
            return await streamed_response(request, chunks, choices)

        def choice(index: int, whole: TextDelta) -> dict[str, Any]:
            prompt_ids = prompts[index // body.num_choices].ids
            choice_renderer = renderer()
            logprobs = None
            if choice_renderer is not None:
                echoed = None
                if body.echo_logprobs:  # first: the completion's text offsets follow its
                    assert whole.prompt_logprobs is not None  # requested_prompt_logprobs
                    echoed = choice_renderer.render_prompt(prompt_ids, whole.prompt_logprobs)
                logprobs = choice_renderer.render(whole.token_ids, whole.logprobs)
                if echoed is not None:
                    logprobs = joined_logprobs(echoed, logprobs)
            rendered = {
                "index": index,
                "text": echoes[index] + whole.text,
                "logprobs": logprobs,
                "finish_reason": whole.finish_reason,
            }
            if whole.prompt_logprobs is not None:
                rendered["prompt_logprobs"] = prompt_logprobs(
                    self._model, prompt_ids, whole.prompt_logprobs
                )
            return rendered

        def render(wholes: list[TextDelta]) -> dict[str, Any]:
            chosen = _likeliest(wholes, body.num_candidates, body.num_choices)
            return {
                **answer.header(),
                "choices": [choice(index, whole) for index, whole in enumerate(chosen)],
                # Every candidate was generated, so every one counts, as OpenAI counts them.
                "usage": answer.usage(sum(whole.completion_tokens for whole in wholes)),
            }

        return await whole_answer(request, choices, render)


async def _prompt_only(deltas: ChoiceDeltas) -> ChoiceDeltas:
    """A choice's deltas without what it generated (echo with max_tokens 0): the first's
    prompt log-probabilities, and the end, at its length, as OpenAI's and vLLM's."""
    async with aclosing(deltas):
        async for delta in deltas:
            if delta.prompt_logprobs is not None or delta.finish_reason is not None:
                finish_reason = None if delta.finish_reason is None else "length"
                yield TextDelta("", finish_reason, 0, prompt_logprobs=delta.prompt_logprobs)


def _likeliest(wholes: list[TextDelta], candidates: int, n: int) -> list[TextDelta]:
    """Of each prompt's ``candidates`` choices in turn, the ``n`` with the highest sum of
    their tokens' log-probabilities, likeliest first; all of them if there are only ``n``."""
    if candidates == n:
        return wholes
    chosen = []
    for start in range(0, len(wholes), candidates):
        group = wholes[start : start + candidates]
        group.sort(key=lambda whole: sum(token.logprob for token in whole.logprobs), reverse=True)
        chosen += group[:n]
    return chosen
