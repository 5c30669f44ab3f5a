"""Structured outputs on the default model's real tokenizer: outputs decoded under the grammar
masks are what the constraint asks for, bad constraints get the library's message, and each
distinct constraint is compiled once, off the calling thread."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import tokenizers
import torch
import xgrammar as xgr

from engine.backends.pytorch import TorchStepOps
from engine.model_config import TokenizerInfo
from engine.models import load_checkpoint
from engine.sampling.structured_output import (
    MAX_SCHEMA_NESTING,
    MAX_SCHEMA_REFS,
    CompilingRequests,
    GrammarBitmask,
    GrammarCompiler,
    GrammarError,
    grammar_problem,
    grammar_vocabulary,
    new_matcher,
)
from engine.scheduling.request import Request
from protocol import SamplingParams, StructuredOutput, StructuredOutputKind

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tokenizer() -> TokenizerInfo:
    return load_checkpoint("SmolLM2-135M-Instruct").tokenizer


@pytest.fixture(scope="module")
def text_tokenizer(tokenizer: TokenizerInfo) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json)


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return load_checkpoint("SmolLM2-135M-Instruct").config.vocab_size


@pytest.fixture(scope="module")
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar") as pool:
        yield pool


@pytest.fixture(scope="module")
def compiler(
    tokenizer: TokenizerInfo, vocab_size: int, executor: ThreadPoolExecutor
) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size, executor)


def compiled(compiler: GrammarCompiler, kind: str, spec: str = "") -> xgr.CompiledGrammar:
    return compiler.compile(StructuredOutput(kind, spec)).result()


def decode(
    grammar: xgr.CompiledGrammar,
    vocab_size: int,
    seed: int,
    bias: torch.Tensor | None = None,
    stop_token_ids: list[int] = (),
) -> tuple[list[int], int | None]:
    """Greedy decoding of random logits under the grammar's masks, as the engine will sample:
    the output tokens and the stop token that ended them (None: MAX_TOKENS ran out first).
    ``bias`` [V] is added to the logits, to steer unbounded grammars towards an end."""
    generator = torch.Generator().manual_seed(seed)
    matcher = new_matcher(grammar, stop_token_ids)
    bitmask = GrammarBitmask(1, vocab_size, torch.device("cpu"), TorchStepOps())
    tokens = []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(1, vocab_size, generator=generator)
        if bias is not None:
            logits += bias
        bitmask.apply(logits, [matcher])
        token = int(logits.argmax())
        assert matcher.accept_token(token), f"the mask allowed token {token}, which breaks it"
        if matcher.is_terminated():
            return tokens, token
        tokens.append(token)
    return tokens, None


def favouring(vocab_size: int, favoured: list[int], avoided: list[int] = ()) -> torch.Tensor:
    bias = torch.zeros(vocab_size)
    bias[favoured] = 4.0
    bias[list(avoided)] = -8.0
    return bias


@pytest.fixture(scope="module")
def json_bias(
    text_tokenizer: tokenizers.Tokenizer, tokenizer: TokenizerInfo, vocab_size: int
) -> torch.Tensor:
    """Random logits would pick whitespace between JSON tokens most of the time (the grammar
    allows any, and many tokens are whitespace) and wander through strings and nestings:
    closing them is favoured, whitespace avoided."""
    whitespace = [
        token_id
        for token_id in range(vocab_size)
        if (text := text_tokenizer.decode([token_id])) and text.isspace()
    ]
    closers = [text_tokenizer.token_to_id(c) for c in ['"', "}", "]"]]
    return favouring(vocab_size, closers + tokenizer.eos_token_ids, whitespace)


def text_of(text_tokenizer: tokenizers.Tokenizer, tokens: list[int]) -> str:
    return text_tokenizer.decode(tokens, skip_special_tokens=True)  # as the server does


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags"],
}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_is_valid_json_of_the_schema(
    compiler: GrammarCompiler,
    json_bias: torch.Tensor,
    text_tokenizer: tokenizers.Tokenizer,
    tokenizer: TokenizerInfo,
    vocab_size: int,
    seed: int,
) -> None:
    grammar = compiled(compiler, StructuredOutputKind.JSON_SCHEMA, json.dumps(PERSON_SCHEMA))
    tokens, stop = decode(grammar, vocab_size, seed, json_bias)
    assert stop in tokenizer.eos_token_ids
    person = json.loads(text_of(text_tokenizer, tokens))
    assert set(PERSON_SCHEMA["required"]) <= person.keys() <= PERSON_SCHEMA["properties"].keys()
    assert isinstance(person["name"], str) and 1 <= len(person["name"]) <= 12
    assert type(person["age"]) is int and 0 <= person["age"] <= 150
    assert person["role"] in ("admin", "user", "guest")
    assert len(person["tags"]) <= 3 and all(len(tag) <= 5 for tag in person["tags"])
    assert type(person.get("active", True)) is bool


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_is_a_json_object(
    compiler: GrammarCompiler,
    json_bias: torch.Tensor,
    text_tokenizer: tokenizers.Tokenizer,
    tokenizer: TokenizerInfo,
    vocab_size: int,
    seed: int,
) -> None:
    grammar = compiled(compiler, StructuredOutputKind.JSON_OBJECT)
    tokens, stop = decode(grammar, vocab_size, seed, json_bias)
    assert stop is not None
    assert isinstance(json.loads(text_of(text_tokenizer, tokens)), dict)


def test_json_object_allows_exactly_objects(
    compiler: GrammarCompiler, text_tokenizer: tokenizers.Tokenizer, tokenizer: TokenizerInfo
) -> None:
    grammar = compiled(compiler, StructuredOutputKind.JSON_OBJECT)
    matcher = new_matcher(grammar)
    for token in text_tokenizer.encode('{"a": [1, 2.5, "x"], "b": {"c": null}}').ids:
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_ids[0])
    assert matcher.is_terminated()
    assert not new_matcher(grammar).accept_token(text_tokenizer.token_to_id("["))


@pytest.mark.parametrize(
    "regex",
    [
        r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
        r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}",
        r"\+?[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    ],
)
def test_regex_output_matches_the_regex(
    compiler: GrammarCompiler,
    text_tokenizer: tokenizers.Tokenizer,
    tokenizer: TokenizerInfo,
    vocab_size: int,
    regex: str,
) -> None:
    grammar = compiled(compiler, StructuredOutputKind.REGEX, regex)
    for seed in range(3):
        tokens, stop = decode(grammar, vocab_size, seed)
        assert stop in tokenizer.eos_token_ids
        assert re.fullmatch(regex, text_of(text_tokenizer, tokens))


CHOICES = ["yes", "no", 'say "maybe"', "back\\slash", "new\nline", "über 🚀", "ctrl\x01", ""]


def test_choice_output_is_one_of_the_choices(
    compiler: GrammarCompiler, text_tokenizer: tokenizers.Tokenizer, vocab_size: int
) -> None:
    grammar = compiled(compiler, StructuredOutputKind.CHOICE, json.dumps(CHOICES))
    outputs = {text_of(text_tokenizer, decode(grammar, vocab_size, seed)[0]) for seed in range(8)}
    assert outputs <= set(CHOICES)
    assert len(outputs) > 1


@pytest.mark.parametrize("choice", CHOICES)
def test_every_choice_is_accepted(
    compiler: GrammarCompiler,
    text_tokenizer: tokenizers.Tokenizer,
    tokenizer: TokenizerInfo,
    choice: str,
) -> None:
    """Escaping keeps each choice's text exactly: quotes, backslashes, control characters."""
    matcher = new_matcher(compiled(compiler, StructuredOutputKind.CHOICE, json.dumps(CHOICES)))
    for token in text_tokenizer.encode(choice).ids:
        assert matcher.accept_token(token)
    assert matcher.accept_token(tokenizer.eos_token_ids[0])
    rejected = new_matcher(compiled(compiler, StructuredOutputKind.CHOICE, json.dumps(CHOICES)))
    assert not all(rejected.accept_token(t) for t in text_tokenizer.encode(choice + "!").ids)


def test_ebnf_grammar_output_is_in_the_language(
    compiler: GrammarCompiler, text_tokenizer: tokenizers.Tokenizer, vocab_size: int
) -> None:
    ebnf = 'root ::= term (("+" | "-") term)*\nterm ::= [1-9] [0-9]* | "(" root ")"'
    grammar = compiled(compiler, StructuredOutputKind.GRAMMAR, ebnf)
    bias = favouring(vocab_size, [text_tokenizer.token_to_id(")")])
    for seed in range(4):
        tokens, stop = decode(grammar, vocab_size, seed, bias)
        assert stop is not None
        expression = text_of(text_tokenizer, tokens)
        assert re.fullmatch(r"[0-9+\-()]+", expression)
        eval(compile(expression, "<grammar output>", "eval"))  # well-formed arithmetic


def test_the_request_stop_tokens_end_a_complete_output(
    compiler: GrammarCompiler, text_tokenizer: tokenizers.Tokenizer, vocab_size: int
) -> None:
    stop_token = text_tokenizer.token_to_id("!")
    grammar = compiled(compiler, StructuredOutputKind.REGEX, "[a-z]{3}")
    bias = favouring(vocab_size, [stop_token])
    tokens, stop = decode(grammar, vocab_size, 0, bias, stop_token_ids=[stop_token])
    assert stop == stop_token
    assert re.fullmatch("[a-z]{3}", text_of(text_tokenizer, tokens))


def structural_tag(format_: dict[str, Any]) -> StructuredOutput:
    spec = json.dumps({"type": "structural_tag", "format": format_})
    return StructuredOutput(StructuredOutputKind.STRUCTURAL_TAG, spec)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutput("json_schema", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (StructuredOutput("json_schema", "{not json"), "Failed to parse JSON"),
        (StructuredOutput("regex", "a(b"), "The parenthesis is not closed."),
        (StructuredOutput("regex", "a\0b"), "must not contain null characters"),
        (StructuredOutput("grammar", "root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutput("grammar", 'start ::= "a"'), 'root rule with name "root"'),
        (StructuredOutput("choice", '["a\\u0000"]'), "must not contain a NUL"),
        (structural_tag({"type": "nope"}), "Format type not recognized: nope"),
        (structural_tag({"type": "regex", "pattern": "a("}), "The parenthesis is not closed."),
    ],
)
def test_a_bad_constraint_gets_the_library_message(
    compiler: GrammarCompiler, constraint: StructuredOutput, message: str
) -> None:
    problem = grammar_problem(constraint)
    assert problem is not None and message in problem
    assert not re.search(r"\.cc:\d+|Check failed|^\[", problem), "the library's log prefix stays"
    refusal = compiler.compile(constraint)  # built on the pool: its future holds the refusal
    with pytest.raises(GrammarError, match=re.escape(problem)):
        refusal.result(timeout=30)
    assert compiler.compile(constraint) is refusal  # asked again: the same refusal


def _nested_schema(levels: int) -> str:
    """An object in an object ``levels`` deep (written as text: json.dumps recurses)."""
    head = '{"type": "object", "required": ["a"], "properties": {"a": '
    return head * levels + '{"type": "string"}' + "}}" * levels


def _reference_chain(links: int) -> str:
    definitions: dict[str, Any] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(links)}
    definitions[f"a{links}"] = {"type": "string"}
    return json.dumps({"$defs": definitions, "$ref": "#/$defs/a0"})


def test_a_schema_the_library_would_take_minutes_over_is_refused_at_once() -> None:
    """Nested or chained past the bounds, a schema is refused before the library builds it
    (which would take it seconds to minutes, holding a grammar thread); within them, built."""
    deep = grammar_problem(StructuredOutput("json_schema", _nested_schema(700)))
    assert deep is not None and f"deeper than {MAX_SCHEMA_NESTING}" in deep
    chained = grammar_problem(StructuredOutput("json_schema", _reference_chain(3000)))
    assert chained is not None and f"more than {MAX_SCHEMA_REFS}" in chained
    tag = structural_tag({"type": "json_schema", "json_schema": json.loads(_nested_schema(100))})
    assert "deeper than" in (grammar_problem(tag) or "")
    beyond_python = grammar_problem(StructuredOutput("json_schema", _nested_schema(5000)))
    assert beyond_python is not None and "deeper than" in beyond_python
    assert grammar_problem(StructuredOutput("json_schema", _nested_schema(40))) is None
    assert grammar_problem(StructuredOutput("json_schema", _reference_chain(300))) is None


def test_good_constraints_have_no_problem() -> None:
    assert grammar_problem(StructuredOutput("json_schema", json.dumps(PERSON_SCHEMA))) is None
    assert grammar_problem(StructuredOutput("json_object")) is None
    assert grammar_problem(StructuredOutput("choice", json.dumps(CHOICES))) is None
    either = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in CHOICES]}
    assert grammar_problem(structural_tag(either)) is None


def test_each_distinct_constraint_is_compiled_once(
    tokenizer: TokenizerInfo, vocab_size: int, executor: ThreadPoolExecutor
) -> None:
    compiler = GrammarCompiler(tokenizer, vocab_size, executor, max_cached=2)
    a, b, c = (StructuredOutput("regex", regex) for regex in ["a+", "b+", "c+"])
    first_a = compiler.compile(a)
    assert compiler.compile(StructuredOutput("regex", "a+")) is first_a  # equal, not the same
    first_b = compiler.compile(b)
    assert first_b is not first_a
    assert compiler.compile(a) is first_a  # a is now the most recently used
    compiler.compile(c)  # evicts b, the least recently used
    assert compiler.compile(a) is first_a
    assert compiler.compile(b) is not first_b
    assert isinstance(first_a.result(), xgr.CompiledGrammar)


def test_the_cache_keeps_compiled_grammars_within_its_bytes(
    tokenizer: TokenizerInfo, vocab_size: int, executor: ThreadPoolExecutor
) -> None:
    """Compiled grammars are kept by their bytes too, not only by their count: a large choice
    list compiles to hundreds of megabytes, and 256 of them would hold an engine's memory."""
    a, b = (StructuredOutput("regex", regex) for regex in ["a+", "b+"])
    probe = GrammarCompiler(tokenizer, vocab_size, executor)
    both = sum(probe.compile(x).result().memory_size_bytes for x in (a, b))
    compiler = GrammarCompiler(tokenizer, vocab_size, executor, max_cached_bytes=both - 1)
    first_a = compiler.compile(a)
    first_a.result()
    compiler.compile(b).result()  # a and b: more than the budget once b is compiled
    compiler.compile(StructuredOutput("regex", "c+"))  # so the next compile evicts a
    assert compiler.compile(a) is not first_a


def test_the_cache_byte_total_is_its_entries_sizes(
    tokenizer: TokenizerInfo, vocab_size: int, executor: ThreadPoolExecutor
) -> None:
    """The cache keeps its bytes as a running total, not a sum over its entries at each
    compile: the total must follow every entry in and out, evicted by count or by bytes,
    or the byte bound drifts from what the cache holds."""
    small = [StructuredOutput("regex", regex) for regex in ["a+", "b+", "c+", "d+", "e+"]]
    # About a hundred kilobytes compiled, over the budget alone; a regex is a few kilobytes.
    large = StructuredOutput("choice", json.dumps([f"option {i}" for i in range(1_000)]))
    compiler = GrammarCompiler(
        tokenizer, vocab_size, executor, max_cached=3, max_cached_bytes=20_000
    )
    latest: dict[StructuredOutput, Future[xgr.CompiledGrammar]] = {}

    def compile_and_check(constraint: StructuredOutput) -> list[StructuredOutput]:
        """Compiles the constraint and checks the total against the cached entries, once
        their compiles are done; returns those entries."""
        latest[constraint] = compiler.compile(constraint)
        cached = [c for c in latest if not compiler.would_compile(c)]
        entry_bytes = [latest[c].result(timeout=60).memory_size_bytes for c in cached]
        assert compiler.cached_bytes == sum(entry_bytes)
        return cached

    for constraint in [*small[:4], large]:  # d and the large list each evict one by count
        compile_and_check(constraint)
    # The large list compiled, e's compile evicts the oldest by count and the rest by bytes.
    assert compile_and_check(small[4]) == [small[4]]
    for constraint in small[:2]:  # back after their eviction
        compile_and_check(constraint)
    assert compiler.cached_bytes > 0


def test_compiles_run_on_the_pool_not_the_caller(tokenizer: TokenizerInfo, vocab_size: int) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        compiler = GrammarCompiler(tokenizer, vocab_size, pool)
        gate = threading.Event()
        pool.submit(gate.wait)  # the pool's one thread is busy until the gate opens
        future = compiler.compile(StructuredOutput("json_schema", json.dumps(PERSON_SCHEMA)))
        assert not future.done()  # compile() returned without compiling
        gate.set()
        assert isinstance(future.result(timeout=60), xgr.CompiledGrammar)


def constrained_request(request_id: str, constraint: StructuredOutput) -> Request:
    return Request(b"t", request_id, [1, 2, 3], SamplingParams(structured_output=constraint), 0)


def test_compiles_not_done_are_counted_and_only_a_new_constraint_starts_one(
    tokenizer: TokenizerInfo, vocab_size: int
) -> None:
    """What the service bounds (--max-compiling-grammars): the compiles queued or running. A
    constraint cached or compiling already would start none, so it is never refused."""
    a, b, c = (StructuredOutput("regex", regex) for regex in ["a+", "b+", "c+"])
    with ThreadPoolExecutor(max_workers=1) as pool:
        compiler = GrammarCompiler(tokenizer, vocab_size, pool)
        gate = threading.Event()
        pool.submit(gate.wait)  # the compiles queue behind it
        try:
            assert compiler.num_compiling == 0 and compiler.would_compile(a)
            futures = [compiler.compile(a), compiler.compile(b), compiler.compile(a)]
            # Two distinct compiles; the vocabulary's reading, queued first, is not one.
            assert compiler.num_compiling == 2
            assert not compiler.would_compile(a) and not compiler.would_compile(b)
            assert compiler.would_compile(c)
        finally:
            gate.set()
        for future in futures:
            future.result(timeout=60)
    assert compiler.num_compiling == 0
    assert not compiler.would_compile(a)  # compiled: in the cache


def test_a_compile_no_request_waits_for_is_cancelled_before_it_starts(
    tokenizer: TokenizerInfo, vocab_size: int
) -> None:
    """A compile whose requests were all aborted, or ran out of time, is cancelled while it is
    queued and forgotten: it would delay every compile behind it (for minutes, under a flood
    of large schemas) for a grammar nobody waits for, and count against the bound. While one
    request still waits for it, it stays."""
    a, b = StructuredOutput("regex", "a+"), StructuredOutput("regex", "b+")
    with ThreadPoolExecutor(max_workers=1) as pool:
        compiler = GrammarCompiler(tokenizer, vocab_size, pool)
        compiling = CompilingRequests(compiler, timeout_s=0.2)
        gate = threading.Event()
        pool.submit(gate.wait)  # the compiles queue behind it
        try:
            first, second = constrained_request("first", a), constrained_request("second", a)
            compiling.add(first)
            compiling.add(second)  # the same compile
            compiling.add(constrained_request("slow", b))
            a_compile, b_compile = compiler.compile(a), compiler.compile(b)
            compiling.remove(first)  # aborted
            assert not a_compile.cancelled()  # the second request waits for it
            compiling.remove(second)
            assert a_compile.cancelled() and compiler.would_compile(a)
            assert compiler.num_compiling == 1  # b's
            time.sleep(0.3)
            ready, failed = compiling.take_done()
            assert not ready
            assert [(r.request_id, why) for r, why in failed] == [
                ("slow", "the grammar took more than 0.2 s to compile")
            ]
            assert b_compile.cancelled() and compiler.would_compile(b)
            assert compiler.num_compiling == 0 and not compiling
            assert compiler.cached_bytes == 0  # the cancelled entries are off the total too
        finally:
            gate.set()
        # Asked for again, the constraint compiles anew.
        again = compiler.compile(a)
        assert again is not a_compile
        assert isinstance(again.result(timeout=60), xgr.CompiledGrammar)


def test_a_running_compile_goes_on_for_the_cache_and_counts_until_done(
    tokenizer: TokenizerInfo, vocab_size: int
) -> None:
    """The library cannot stop a compile: one running when its last request is aborted
    finishes, for the cache, and counts against the bound until then."""
    # Ten thousand choices: about a second's compile, long enough to be seen running.
    many = StructuredOutput("choice", json.dumps([f"option {i} of many" for i in range(10_000)]))
    with ThreadPoolExecutor(max_workers=1) as pool:
        compiler = GrammarCompiler(tokenizer, vocab_size, pool)
        compiling = CompilingRequests(compiler)
        request = constrained_request("aborted", many)
        compiling.add(request)
        future = compiler.compile(many)
        deadline = time.monotonic() + 60
        while not future.running():
            assert not future.done() and time.monotonic() < deadline
            time.sleep(0.001)
        compiling.remove(request)
        assert not future.cancelled()
        assert compiler.num_compiling == 1 and not compiler.would_compile(many)
        assert isinstance(future.result(timeout=60), xgr.CompiledGrammar)
    assert compiler.num_compiling == 0 and compiler.compile(many) is future


def test_padded_and_special_tokens_are_never_allowed(
    tokenizer: TokenizerInfo, text_tokenizer: tokenizers.Tokenizer, vocab_size: int
) -> None:
    """A model's vocabulary may exceed its tokenizer's; those ids, and special tokens the
    server would leave out of the text, are masked. EOS is allowed once the output is done."""
    padded = vocab_size + 40
    vocabulary = grammar_vocabulary(tokenizer, padded)
    assert vocabulary.vocab_size == padded
    assert vocabulary.vocab_type is xgr.VocabType.BYTE_LEVEL  # GPT-2 style "Ġ" spaces
    special = {i for i, token in text_tokenizer.get_added_tokens_decoder().items() if token.special}
    grammar = xgr.GrammarCompiler(vocabulary).compile_grammar(
        xgr.Grammar.from_ebnf('root ::= [^x]* "x"')  # anything, then x
    )
    matcher = new_matcher(grammar)
    bitmask = GrammarBitmask(4, padded, torch.device("cpu"), TorchStepOps())
    logits = torch.zeros(1, padded)
    bitmask.apply(logits, [matcher])
    allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    assert not allowed & special
    assert max(allowed) < vocab_size
    assert len(allowed) > vocab_size // 2
    assert matcher.accept_token(text_tokenizer.token_to_id("x"))
    logits = torch.zeros(1, padded)
    bitmask.apply(logits, [matcher])
    assert set(torch.nonzero(logits[0] == 0).flatten().tolist()) == set(tokenizer.eos_token_ids)


def test_a_step_masks_only_its_constrained_rows(
    compiler: GrammarCompiler,
    text_tokenizer: tokenizers.Tokenizer,
    tokenizer: TokenizerInfo,
    vocab_size: int,
) -> None:
    digits = compiled(compiler, StructuredOutputKind.REGEX, "[0-9]+")
    done = new_matcher(digits)
    assert done.accept_token(text_tokenizer.token_to_id("7"))
    assert done.accept_token(tokenizer.eos_token_ids[0])  # terminated: its request finished
    matchers = [new_matcher(digits), None, done, new_matcher(digits)]
    bitmask = GrammarBitmask(8, vocab_size, torch.device("cpu"), TorchStepOps())
    logits = torch.randn(4, vocab_size)
    raw = logits.clone()
    bitmask.apply(logits, matchers)
    for row in (1, 2):
        assert torch.equal(logits[row], raw[row])
    for row in (0, 3):
        allowed = torch.nonzero(logits[row] == raw[row]).flatten().tolist()
        assert {text_tokenizer.id_to_token(token) for token in allowed} == set("0123456789")
    # A later step with fewer rows reuses the same buffers.
    logits = torch.randn(1, vocab_size)
    raw = logits.clone()
    bitmask.apply(logits, [None])
    assert torch.equal(logits, raw)
