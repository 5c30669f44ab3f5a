"""Structured outputs through the whole engine: a tiny random Llama over the default model's
real tokenizer, whose constrained greedy tokens must be transformers' greedy tokens under the
same grammar's masks, in batches that mix constrained and free requests, with overlapped
steps, chunked prefill and preemption; and the requests' life around their grammars: the
refusals, the stops, the aborts while compiling and the compile time limit."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import LlamaForCausalLM as HFLlama

from engine.backends.pytorch import TorchStepOps
from engine.llm_engine import LLMEngine
from engine.models import load_checkpoint
from engine.sampling.structured_output import GrammarBitmask, new_matcher
from engine.scheduling.request import RequestStatus
from protocol import (
    ErrorCode,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama
from tandem.testing.reference import hf_greedy
from tests.engine.test_logprobs import generate
from tests.engine.test_overlap_steps import make_engine, tokens
from tests.engine.test_prompt_logprobs import prompt_logprobs_of

REGEX = StructuredOutput(StructuredOutputKind.REGEX, r"[a-z]{1,8}(-[0-9]{1,3}){0,4}")
SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["size", "colour", "tags"],
}
JSON_SCHEMA = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))
CHOICE = StructuredOutput(StructuredOutputKind.CHOICE, json.dumps(["yes", "no", "perhaps"]))
# Long outputs of letters: each request decodes all its max_tokens, for cache pressure.
LETTERS = StructuredOutput(StructuredOutputKind.REGEX, "[a-z]{300,400}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFLlama]:
    """A tiny Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer and EOS."""
    directory = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    smollm2 = load_checkpoint("SmolLM2-135M-Instruct")
    eos_token_id = smollm2.tokenizer.eos_token_ids[0]
    model = save_tiny_llama(
        directory,
        vocab_size=smollm2.config.vocab_size,
        eos_token_id=eos_token_id,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    (directory / "tokenizer.json").write_text(smollm2.tokenizer.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": smollm2.tokenizer.eos_token})
    )
    return directory, model


@pytest.fixture(scope="module")
def text_tokenizer(tiny: tuple[Path, HFLlama]) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))


def hf_constrained_greedy(
    model: HFLlama, engine: LLMEngine, prompt: list[int], constraint: StructuredOutput, n: int
) -> tuple[list[int], str]:
    """transformers' greedy tokens (at most ``n``) with each step's logits masked by the
    grammar, as the engine's grammar compiles it; and the finish reason the engine should
    give (the stop token that a complete output ends with is not an output token)."""
    matcher = new_matcher(engine.compiling.compiler.compile(constraint).result())
    vocab_size = model.config.vocab_size
    bitmask = GrammarBitmask(1, vocab_size, torch.device("cpu"), TorchStepOps())
    tokens: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1:].float()
        bitmask.apply(logits, [matcher])
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return tokens, FinishReason.STOP
        tokens.append(token)
    return tokens, FinishReason.LENGTH


def tokens_and_finish(outputs: list[RequestOutput]) -> tuple[list[int], str | None]:
    return [t for output in outputs for t in output.new_token_ids], outputs[-1].finish_reason


def assert_all_done(engine: LLMEngine) -> None:
    assert engine.in_flight is None and not engine.requests and not engine.compiling
    assert engine.num_constrained == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "one-at-a-time"])
def test_constrained_and_free_requests_share_steps(
    tiny: tuple[Path, HFLlama], text_tokenizer: tokenizers.Tokenizer, overlap: bool
) -> None:
    """Each constrained request gets transformers' masked greedy tokens, each free one its
    plain greedy tokens, in batches that hold both, prompts prefilled in chunks of 16."""
    directory, hf_model = tiny
    engine = make_engine(directory, overlap, max_num_seqs=8, max_num_batched_tokens=16)
    prompts = random_prompts(7)
    constrained = {"regex": (prompts[4], REGEX), "json": (prompts[3], JSON_SCHEMA)}
    constrained |= {"choice": (prompts[6], CHOICE), "choice-again": (prompts[1], CHOICE)}
    free = {"free-short": prompts[0], "free-long": prompts[6]}
    free_sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    requests = {
        name: (prompt, SamplingParams(max_tokens=20, structured_output=constraint))
        for name, (prompt, constraint) in constrained.items()
    } | {name: (prompt, free_sampling) for name, prompt in free.items()}
    outputs = generate(engine, requests)
    for name, (prompt, constraint) in constrained.items():
        expected = hf_constrained_greedy(hf_model, engine, prompt, constraint, 20)
        assert tokens_and_finish(outputs[name]) == expected, name
    for name, prompt in free.items():
        assert tokens_and_finish(outputs[name]) == (hf_greedy(hf_model, prompt, 12), "length")
    regex_text = text_tokenizer.decode(tokens_and_finish(outputs["regex"])[0])
    assert re.fullmatch(REGEX.spec, regex_text)
    for name in ("choice", "choice-again"):
        choice = text_tokenizer.decode(tokens_and_finish(outputs[name])[0])
        assert choice in json.loads(CHOICE.spec)
    assert_all_done(engine)


def test_preemption_keeps_constrained_outputs_exact(tiny: tuple[Path, HFLlama]) -> None:
    """Preempted requests recompute their cache; their matchers keep their place."""
    directory, hf_model = tiny
    engine = make_engine(directory, num_kv_blocks=40, max_model_len=160)
    prompts = random_prompts(8)
    # Every other request constrained; the free ones run to max_tokens too.
    requests = {
        str(i): (
            prompt,
            SamplingParams(max_tokens=24, structured_output=LETTERS)
            if i % 2
            else SamplingParams(max_tokens=24, ignore_eos=True),
        )
        for i, prompt in enumerate(prompts)
    }
    outputs = generate(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for name, (prompt, sampling) in requests.items():
        if sampling.structured_output is None:
            expected = (hf_greedy(hf_model, prompt, 24), FinishReason.LENGTH)
        else:
            expected = hf_constrained_greedy(hf_model, engine, prompt, LETTERS, 24)
        assert tokens_and_finish(outputs[name]) == expected, name
    assert_all_done(engine)


def test_a_complete_output_stops_on_a_stop_token(
    tiny: tuple[Path, HFLlama], text_tokenizer: tokenizers.Tokenizer
) -> None:
    """Once the output is complete only stop tokens are allowed: the EOS ids and the
    request's own stop_token_ids; with ignore_eos, an EOS the grammar takes stops it too."""
    directory, _ = tiny
    engine = make_engine(directory)
    exclamation = text_tokenizer.token_to_id("!")
    three_letters = StructuredOutput(StructuredOutputKind.REGEX, "[a-z]{3}")
    prompt = random_prompts(3)[2]
    outputs = generate(
        engine,
        {
            "stop-token": (
                prompt,
                SamplingParams(
                    max_tokens=10,
                    stop_token_ids=[exclamation],
                    logit_bias_token_ids=[exclamation],
                    logit_bias_values=[100.0],  # the stop token, once the grammar allows it
                    structured_output=three_letters,
                ),
            ),
            "ignore-eos": (
                prompt,
                SamplingParams(max_tokens=10, ignore_eos=True, structured_output=three_letters),
            ),
        },
    )
    for name in ("stop-token", "ignore-eos"):
        tokens, finish = tokens_and_finish(outputs[name])
        assert finish == FinishReason.STOP, name
        assert re.fullmatch("[a-z]{3}", text_tokenizer.decode(tokens)), name
    # The token that stopped each is named beside its last output, not among its tokens.
    assert outputs["stop-token"][-1].stop_token_id == exclamation
    assert outputs["ignore-eos"][-1].stop_token_id in engine.eos_token_ids
    assert_all_done(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "one-at-a-time"])
def test_restrictions_that_leave_no_token_end_the_request_with_an_error(
    tiny: tuple[Path, HFLlama], text_tokenizer: tokenizers.Tokenizer, overlap: bool
) -> None:
    """Where a request's allowed_token_ids, bad words or min_tokens and its grammar allow no
    token, its user gets an invalid_request error saying so (never a token it forbade, nor
    an abort), and the other requests go on."""
    directory, hf_model = tiny
    engine = make_engine(directory, overlap)
    letter_a, digit = text_tokenizer.token_to_id("a"), text_tokenizer.token_to_id("1")
    three_as = StructuredOutput(StructuredOutputKind.REGEX, "aaa")
    prompts = random_prompts(4)
    outputs = generate(
        engine,
        {
            # At once: the grammar wants a letter, only a digit is allowed.
            "first": (
                prompts[0],
                SamplingParams(allowed_token_ids=[digit], structured_output=REGEX),
            ),
            # After "aaa" the grammar wants EOS, which min_tokens bans until token 5.
            "later": (
                prompts[1],
                SamplingParams(
                    max_tokens=8,
                    allowed_token_ids=[letter_a],
                    min_tokens=5,
                    structured_output=three_as,
                ),
            ),
            # No grammar: the only allowed token is a bad word.
            "banned": (
                prompts[2],
                SamplingParams(allowed_token_ids=[letter_a], bad_words_token_ids=[[letter_a]]),
            ),
            "free": (prompts[3], SamplingParams(max_tokens=6, ignore_eos=True)),
        },
    )
    errors = {reply.request_id: reply for _, reply in engine.take_errors()}
    assert sorted(errors) == ["banned", "first", "later"]
    assert all(reply.code == ErrorCode.INVALID_REQUEST for reply in errors.values())
    assert "output token 1: the structured output and allowed_token_ids" in errors["first"].message
    assert "output token 4: the structured output, allowed_token_ids and min_tokens" in (
        errors["later"].message
    )
    assert "output token 1: allowed_token_ids and bad_words together" in errors["banned"].message
    assert tokens_and_finish(outputs["later"])[0] == [letter_a] * 3
    assert not outputs["first"] and not outputs["banned"]
    assert tokens(outputs["free"]) == hf_greedy(hf_model, prompts[3], 6)
    assert_all_done(engine)


def test_a_grammar_that_matches_no_text_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    """A grammar whose mask allows no token (it matches no text) is its user's error: an
    invalid_request, not an abort (an HTTP 503 that retrying never gets past)."""
    directory, hf_model = tiny
    engine = make_engine(directory)
    nothing = StructuredOutput(StructuredOutputKind.GRAMMAR, "root ::= root")
    prompts = random_prompts(2)
    outputs = generate(
        engine,
        {
            "nothing": (prompts[0], SamplingParams(structured_output=nothing)),
            "free": (prompts[1], SamplingParams(max_tokens=4, ignore_eos=True)),
        },
    )
    ((_, error),) = engine.take_errors()
    assert error.request_id == "nothing" and error.code == ErrorCode.INVALID_REQUEST
    assert "output token 1: the structured output allows none" in error.message
    assert not outputs["nothing"]
    assert tokens(outputs["free"]) == hf_greedy(hf_model, prompts[1], 4)
    assert_all_done(engine)


def test_logprobs_are_those_of_the_allowed_tokens(tiny: tuple[Path, HFLlama]) -> None:
    """As vLLM's: the log-probabilities of the distribution sampled from, the grammar's
    mask applied; the forbidden alternatives have -inf."""
    directory, hf_model = tiny
    engine = make_engine(directory)
    prompt = random_prompts(5)[4]
    sampling = SamplingParams(max_tokens=8, logprobs=20, structured_output=CHOICE)
    outputs = generate(engine, {"choice": (prompt, sampling)})["choice"]
    tokens, _ = tokens_and_finish(outputs)
    logprobs = [lp for output in outputs for lp in output.logprobs or []]
    assert len(logprobs) == len(tokens) > 0
    matcher = new_matcher(engine.compiling.compiler.compile(CHOICE).result())
    bitmask = GrammarBitmask(1, hf_model.config.vocab_size, torch.device("cpu"), TorchStepOps())
    with torch.no_grad():
        all_logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    for position, (token, token_logprobs) in enumerate(zip(tokens, logprobs, strict=True)):
        logits = all_logits[position : position + 1].float()
        bitmask.apply(logits, [matcher])
        reference = torch.log_softmax(logits[0], dim=-1)
        allowed = int(torch.isfinite(reference).sum())
        assert 0 < allowed < 20
        assert token_logprobs.logprob == pytest.approx(reference[token].item(), abs=1e-4)
        top = token_logprobs.top_logprobs
        assert all(lp > -1e9 for lp in top[:allowed])
        assert all(lp == float("-inf") for lp in top[allowed:])
        assert sum(torch.tensor(top[:allowed]).exp()) == pytest.approx(1.0, abs=1e-4)
        assert token_logprobs.top_token_ids[:allowed] == reference.topk(allowed).indices.tolist()
        assert matcher.accept_token(token)


def block_the_grammar_pool(engine: LLMEngine) -> threading.Event:
    """Keep both of the engine's grammar threads busy until the returned event is set."""
    gate = threading.Event()
    for _ in range(2):
        engine.grammar_pool.submit(gate.wait)
    return gate


def test_a_bad_constraint_is_refused_from_the_grammar_pool(tiny: tuple[Path, HFLlama]) -> None:
    # The grammar is built on the pool, not in add_request: a schema nested a few hundred
    # deep (or a long chain of $refs) takes the library seconds to minutes to build, which
    # on the step loop stalled every request. Its refusal comes once the pool gets to it.
    directory, hf_model = tiny
    engine = make_engine(directory)
    gate = block_the_grammar_pool(engine)
    prompt = random_prompts(2)[1]
    bad = StructuredOutput(StructuredOutputKind.REGEX, "a(b")
    try:
        engine.add_request(b"t", "bad", prompt, SamplingParams(structured_output=bad))
        engine.add_request(b"t", "free", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        free = []
        while engine.requests.get((b"t", "free")):  # the free request runs meanwhile
            free += [output for _, output in engine.step()]
        assert engine.requests[(b"t", "bad")].status is RequestStatus.COMPILING
    finally:
        gate.set()
    assert tokens_and_finish(free) == (hf_greedy(hf_model, prompt, 4), FinishReason.LENGTH)
    deadline = time.monotonic() + 30
    while not (errors := engine.take_errors()) and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    ((client, error),) = errors
    assert client == b"t" and error.request_id == "bad"
    assert error.code == ErrorCode.INVALID_REQUEST
    assert "The parenthesis is not closed" in error.message
    assert_all_done(engine)


def test_abort_while_compiling(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory)
    gate = block_the_grammar_pool(engine)
    prompt = random_prompts(2)[1]
    try:
        engine.add_request(b"t", "waits", prompt, SamplingParams(structured_output=REGEX))
        engine.add_request(b"t", "free", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        assert engine.requests[(b"t", "waits")].status is RequestStatus.COMPILING
        free = []
        while engine.requests.get((b"t", "free")):  # the free request runs meanwhile
            free += [output for _, output in engine.step()]
        assert engine.requests[(b"t", "waits")].status is RequestStatus.COMPILING
        assert engine.stats().num_waiting == 1
        assert engine.num_grammar_compiles() == 1
        aborted = engine.abort(b"t", "waits")
        assert aborted is not None and aborted.finish_reason == FinishReason.ABORT
        # Its compile had not started: cancelled, for no one waits for it.
        assert engine.num_grammar_compiles() == 0
        assert engine.num_grammar_compiles(arriving=REGEX) == 1
    finally:
        gate.set()
    assert tokens_and_finish(free) == (hf_greedy(hf_model, prompt, 4), FinishReason.LENGTH)
    assert not engine.has_work and not engine.take_errors()
    # Asked for again, the constraint compiles anew and runs.
    outputs = generate(engine, {"later": (prompt, SamplingParams(structured_output=REGEX))})
    assert outputs["later"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert_all_done(engine)


def test_a_compile_past_the_time_limit_is_refused(tiny: tuple[Path, HFLlama]) -> None:
    engine = make_engine(tiny[0])
    engine.compiling.timeout_s = 0.2
    gate = block_the_grammar_pool(engine)
    try:
        sampling = SamplingParams(structured_output=JSON_SCHEMA)
        engine.add_request(b"t", "slow", [1, 2, 3], sampling)
        assert engine.only_compiling and not engine.step() and not engine.take_errors()
        time.sleep(0.3)
        assert not engine.step()
        ((client, error),) = engine.take_errors()
    finally:
        gate.set()
    assert client == b"t" and error.request_id == "slow"
    assert error.code == ErrorCode.INVALID_REQUEST
    assert error.message == "the grammar took more than 0.2 s to compile"
    assert not engine.has_work
    assert_all_done(engine)


def test_requests_of_one_constraint_each_have_their_own_matcher(
    tiny: tuple[Path, HFLlama], text_tokenizer: tokenizers.Tokenizer
) -> None:
    """As the n choices of one request: one compile, a matcher each."""
    engine = make_engine(tiny[0])
    prompts = random_prompts(3)
    for i, prompt in enumerate(prompts):
        engine.add_request(b"t", str(i), prompt, SamplingParams(structured_output=CHOICE))
    outputs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
    matchers: set[int] = set()
    while engine.has_work:
        matchers |= {id(r.grammar) for r in engine.requests.values() if r.grammar is not None}
        for _, output in engine.step():
            outputs[output.request_id].append(output)
    assert len(matchers) == len(prompts)
    for request_outputs in outputs.values():
        tokens, finish = tokens_and_finish(request_outputs)
        assert finish == FinishReason.STOP
        assert text_tokenizer.decode(tokens) in json.loads(CHOICE.spec)
    assert_all_done(engine)


def test_prompt_logprobs_beside_a_grammar(tiny: tuple[Path, HFLlama]) -> None:
    """The grammar's mask falls on the sampled rows only, not on the scored prompt positions
    that follow them in the step's logits (prompts in chunks of 8, 4 positions a step)."""
    directory, hf_model = tiny
    engine = make_engine(directory, max_num_seqs=4, max_num_batched_tokens=8)
    prompts = random_prompts(5)
    requests = {
        "constrained": (
            prompts[4],
            SamplingParams(max_tokens=20, structured_output=CHOICE, prompt_logprobs=0),
        ),
        "free": (prompts[3], SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0)),
    }
    outputs = generate(engine, requests)
    expected = hf_constrained_greedy(hf_model, engine, prompts[4], CHOICE, 20)
    assert tokens_and_finish(outputs["constrained"]) == expected
    for name, (prompt, _) in requests.items():
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
        reference = torch.log_softmax(logits, dim=-1)
        scored = prompt_logprobs_of(outputs[name])
        assert len(scored) == len(prompt) - 1
        chosen = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        ours = torch.tensor([entry.logprob for entry in scored])
        torch.testing.assert_close(ours, chosen, rtol=1e-4, atol=1e-4)
    assert_all_done(engine)
