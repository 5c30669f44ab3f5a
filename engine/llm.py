"""The offline Python API: vLLM's ``LLM(...).generate(...)`` over an in-process engine.

    from engine import LLM, SamplingParams

    llm = LLM(model="path/or/name", max_model_len=4096)
    for output in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
        print(output.outputs[0].text)

``LLM`` drives ``LLMEngine`` directly (no socket, no server): it tokenizes and detokenizes
with the checkpoint's own tokenizer.json, renders chat messages with the model's chat template
(``protocol/chat_template.py``, which servers render with too), submits every prompt at once
and steps the engine until all are done, a progress bar counting the finished ones. The
results have the shapes of vLLM's ``RequestOutput`` and ``CompletionOutput``. ``embed``
gives each prompt's embedding (the engine's pooling steps: its last hidden state pooled as the
checkpoint says, L2-normalized), in the shape of vLLM's ``EmbeddingRequestOutput``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from tqdm import tqdm

import protocol
from engine.checkpoint.resolve import DEFAULT_MODEL
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestRejected
from protocol import PromptTokenLogprobs, TokenLogprobs
from protocol.chat_template import ChatTemplate
from protocol.detokenizer import IncrementalDetokenizer

_CLIENT = b"llm"  # the one client of the engine's requests

# A token's log-probability and its top alternatives': token id -> log-probability.
Logprobs = dict[int, float]

# vLLM's speculative_config keys and the engine options they set.
SPECULATIVE_CONFIG_KEYS = {
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


@dataclass
class SamplingParams(protocol.SamplingParams):
    """The engine's sampling parameters and, as vLLM's, what the offline API does with the
    text: ``n`` completions of each prompt (a seeded request's take the seeds seed,
    seed + 1, ...), and ``stop`` strings, which end a completion's text before them (after
    them, with ``include_stop_str_in_output``) as the servers' do (``protocol/detokenizer.py``:
    the same code)."""

    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False

    def engine_params(self, index: int) -> protocol.SamplingParams:
        """The engine's parameters of completion ``index``: the wire fields only."""
        wire = {f.name: getattr(self, f.name) for f in dataclasses.fields(protocol.SamplingParams)}
        # The result holds the prompt's log-probabilities once: completion 0's.
        return protocol.SamplingParams(**wire).for_choice(index, prompt_logprobs_once=True)


@dataclass
class CompletionOutput:
    """One generated answer (vLLM's shape): its text, its token ids, why it ended and, when
    ``SamplingParams.logprobs`` asked, each token's log-probabilities."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    # Per token, with logprobs=k: the token's log-probability and the k likeliest tokens'.
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None  # the sum of the tokens' log-probabilities


@dataclass
class RequestOutput:
    """The answers to one prompt (vLLM's shape). ``prompt`` is None for a prompt given as
    token ids; ``prompt_logprobs``, when asked, has None for the first token, as vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # unit length (L2)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class LLM:
    """A model loaded in this process, for generating offline.

    ``options`` are ``EngineConfig``'s fields, the flags of ``python -m engine`` without
    their dashes (``max_model_len=4096``, ``device="cpu"``, ``enforce_eager=True``, ...).
    ``speculative_config`` is vLLM's: ``{"model": DRAFT, "num_speculative_tokens": k}``, or
    ``{"method": "ngram", ...}``, its keys those of ``SPECULATIVE_CONFIG_KEYS``."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        speculative_config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if speculative_config is not None:
            unknown = set(speculative_config) - set(SPECULATIVE_CONFIG_KEYS)
            if unknown:
                raise ValueError(
                    f"speculative_config: unknown keys {sorted(unknown)} (known: "
                    f"{', '.join(SPECULATIVE_CONFIG_KEYS)})"
                )
            options |= {SPECULATIVE_CONFIG_KEYS[k]: v for k, v in speculative_config.items()}
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        info = self.engine.tokenizer
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.chat_template = (
            None
            if info.chat_template is None
            else ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
        )
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (``tensor_parallel_size`` > 1)."""
        self.engine.close()

    def default_sampling_params(self) -> SamplingParams:
        """Greedy decoding but where the model's generation_config.json says otherwise (what
        ``generate`` uses without ``sampling_params``, as vLLM's LLM does)."""
        defaults = dataclasses.asdict(self.engine.sampling_defaults)
        return SamplingParams(**{k: v for k, v in defaults.items() if v is not None})

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate after each prompt (a text, tokenized with the model's special tokens, or
        token ids); one output per prompt, in order. ``sampling_params`` is one for all or
        one per prompt. Raises ValueError for a prompt or parameters the engine refuses;
        nothing is generated then."""
        texts, token_ids = self._prompts(prompts)
        return self._run(texts, token_ids, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (a text, tokenized with the model's special tokens, or
        token ids), in order, as the server's /v1/embeddings computes it. Raises ValueError
        for a prompt the engine refuses (empty, or longer than the context); nothing is
        computed then."""
        _, token_ids = self._prompts(prompts)
        results: dict[str, EmbeddingRequestOutput] = {}
        for index, prompt in enumerate(token_ids):
            request_id = str(next(self._request_ids))
            try:
                self.engine.add_embed_request(_CLIENT, request_id, prompt)
            except RequestRejected as exc:
                for added in results:
                    self.engine.abort(_CLIENT, added)
                raise ValueError(f"prompt {index}: {exc.message}") from None
            results[request_id] = EmbeddingRequestOutput(
                request_id, prompt, EmbeddingOutput([]), finished=False
            )
        with tqdm(
            total=len(results), desc="embedding", unit="prompt", disable=not use_tqdm
        ) as progress:
            while self.engine.has_work:
                for _, embedding in self.engine.pool():
                    result = results[embedding.request_id]
                    result.outputs.embedding = embedding.embedding
                    result.finished = True
                    progress.update()
        return list(results.values())

    def _prompts(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]]
    ) -> tuple[list[str | None], list[list[int]]]:
        """Each prompt's text (None for token ids) and its token ids: a text tokenized with
        the model's special tokens."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        texts: list[str | None] = [p if isinstance(p, str) else None for p in prompts]
        encoded = self.tokenizer.encode_batch([t for t in texts if t is not None])
        encoded_ids = iter(encoding.ids for encoding in encoded)
        token_ids = [
            next(encoded_ids) if text is not None else list(prompt)  # type: ignore[arg-type]
            for text, prompt in zip(texts, prompts, strict=True)
        ]
        return texts, token_ids

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of OpenAI-style messages) or several, each through
        the model's chat template as the chat endpoint renders it; raises ValueError for a
        model without one, or a conversation its template refuses."""
        if self.chat_template is None:
            raise ValueError("the model has no chat template: use generate()")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        texts: list[str | None] = [
            self.chat_template.render(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        # The rendered template holds the special tokens already (as apply_chat_template).
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return self._run(texts, [e.ids for e in encoded], sampling_params, use_tqdm)

    def _run(
        self,
        texts: list[str | None],
        token_ids: list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(token_ids)
        if len(sampling_params) != len(token_ids):
            raise ValueError(
                f"{len(sampling_params)} sampling parameters for {len(token_ids)} prompts"
            )
        results: list[RequestOutput] = []
        choices: dict[str, _Choice] = {}
        try:
            for text, prompt, params in zip(texts, token_ids, sampling_params, strict=True):
                sampling = (
                    params if isinstance(params, SamplingParams) else SamplingParams(**vars(params))
                )
                if sampling.n < 1:
                    raise ValueError(
                        f"prompt {len(results)}: n must be at least 1, not {sampling.n}"
                    )
                result = RequestOutput(str(next(self._request_ids)), text, prompt, [], False)
                if sampling.prompt_logprobs is not None:
                    result.prompt_logprobs = [None]  # the first token's; the engine's follow
                for index in range(sampling.n):
                    request_id = f"{result.request_id}-{index}"
                    try:
                        self.engine.add_request(
                            _CLIENT, request_id, prompt, sampling.engine_params(index)
                        )
                    except RequestRejected as exc:
                        raise ValueError(f"prompt {len(results)}: {exc.message}") from None
                    choices[request_id] = _Choice(self.tokenizer, result, index, prompt, sampling)
                results.append(result)
        except BaseException:
            # A refused prompt generates nothing: the earlier prompts' requests leave the engine
            # too, or the next call would step them with no choice to take their tokens.
            for added in choices:
                self.engine.abort(_CLIENT, added)
            raise
        with tqdm(
            total=len(results), desc="generating", unit="prompt", disable=not use_tqdm
        ) as progress:
            while self.engine.has_work:
                for _, output in self.engine.step():
                    choice = choices[output.request_id]
                    if choice.take(output):
                        if not output.finish_reason:  # a stop string: the engine goes on
                            self.engine.abort(_CLIENT, output.request_id)
                        if all(c.finish_reason for c in choice.result.outputs):
                            choice.result.finished = True
                            progress.update()
                for _, error in self.engine.take_errors():
                    for request_id, choice in choices.items():
                        if not choice.completion.finish_reason:
                            self.engine.abort(_CLIENT, request_id)
                    raise ValueError(error.message)
        return results


class _Choice:
    """One completion as it is generated: its tokens, their log-probabilities, and its text
    through the servers' incremental detokenizer and stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        result: RequestOutput,
        index: int,
        prompt: list[int],
        sampling: SamplingParams,
    ) -> None:
        self.result = result
        self.completion = CompletionOutput(
            index, "", [], None, [] if sampling.logprobs is not None else None
        )
        result.outputs.append(self.completion)
        self.include_stop = sampling.include_stop_str_in_output
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt, sampling.stop, self.include_stop, min_tokens=sampling.min_tokens
        )

    def take(self, output: protocol.RequestOutput) -> bool:
        """Add one step's output; whether the completion is over (its request finished, or a
        stop string ended its text: the engine's request must then be aborted)."""
        completion = self.completion
        if output.prompt_logprobs is not None:  # the next piece, of completion 0's request
            whole = self.result.prompt_logprobs
            assert whole is not None  # asked for: the request's parameters say so
            # The piece scores the prompt tokens from the first not yet scored on.
            scored_ids = self.result.prompt_token_ids[
                len(whole) : len(whole) + len(output.prompt_logprobs)
            ]
            scored = zip(scored_ids, output.prompt_logprobs, strict=True)
            whole += [_token_logprobs(t, lp) for t, lp in scored]
        # Token by token: a stop string ends the completion at the token that completes it.
        for position, token in enumerate(output.new_token_ids):
            completion.token_ids.append(token)
            if completion.logprobs is not None and output.logprobs:
                completion.logprobs.append(_token_logprobs(token, output.logprobs[position]))
            completion.text += self.detokenizer.push([token])
            if self.detokenizer.stopped:
                self._finish("stop")
                return True
        if output.finish_reason is None:
            return False
        if self.include_stop and output.stop_token_id is not None:
            completion.text += self.detokenizer.push([output.stop_token_id])
        completion.text += self.detokenizer.finish()
        self._finish(output.finish_reason)
        return True

    def _finish(self, reason: str) -> None:
        completion = self.completion
        completion.finish_reason = reason
        if completion.logprobs is not None:
            tokens = zip(completion.token_ids, completion.logprobs, strict=True)
            completion.cumulative_logprob = sum(lp[t] for t, lp in tokens)


def _token_logprobs(token: int, logprobs: TokenLogprobs | PromptTokenLogprobs) -> Logprobs:
    """The token's log-probability, then its position's likeliest tokens' (vLLM's dict)."""
    top = zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True)
    return {token: logprobs.logprob, **dict(top)}
