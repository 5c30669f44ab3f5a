"""Structured outputs: a request's constraint as an xgrammar grammar, compiled once per distinct
constraint off the step loop, matched token by token, and applied to a step's logits as masks.

Four parts, used in this order:

- ``GrammarCompiler.compile`` turns a ``StructuredOutput`` into a future compiled grammar:
  building the grammar (parsing the schema, regex or EBNF) and compiling it against the
  vocabulary (the token masks of every grammar state) run on a thread pool, cached. A
  malformed constraint fails its future with the library's own message.
- ``CompilingRequests`` holds the requests whose grammars compile, outside the scheduler,
  until each is ready or fails; a compile that no request waits for any more is cancelled
  while it has not started.
- ``new_matcher`` starts a request's own place in its compiled grammar: each token the host
  reads is accepted into it, and it terminates once it accepts a stop token after a complete
  output.
- ``GrammarBitmask.apply`` masks a step's logits: one int32 bitmask row per sampled row, filled
  by the library for the constrained rows, moved in one copy, applied by the backend's
  ``StepOps.apply_token_bitmask`` (the library's Triton kernel in the Triton backend on CUDA,
  its PyTorch ops in the torch backend, its CPU loop on the CPU).
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future

import tokenizers
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from engine.backends.step_ops import StepOps
from engine.model_config import TokenizerInfo
from engine.scheduling.request import Request, RequestStatus
from protocol import StructuredOutput, StructuredOutputKind

logger = logging.getLogger(__name__)

# OpenAI's JSON mode promises a JSON object, as vLLM reads it.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# The library's messages start with its log prefix: "[10:51:54] /project/cpp/file.cc:83: ",
# and failed checks with "Check failed: (condition) is false: ". Neither means anything to users.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


# Bounds on a JSON schema (or a structural tag's schemas): the library's time to build a
# grammar grows about as the cube of its nesting and of its chain of $refs, and a build
# cannot be cancelled, so a few schemas far past these would hold every grammar thread.
# Within them a build is quick; OpenAI's structured outputs allow 10 levels of nesting.
MAX_SCHEMA_NESTING = 128  # levels of the schema's JSON document (a schema level takes two)
MAX_SCHEMA_REFS = 1000  # "$ref"s in it


class GrammarError(ValueError):
    """A constraint the grammar library refuses; the message is the library's, for the user."""


def build_grammar(constraint: StructuredOutput) -> xgr.Grammar:
    """The constraint as a grammar, or GrammarError saying what is wrong with it. This parses
    the schema, regex or grammar but does no work over the vocabulary: cheap for most, yet a
    schema nested a few hundred deep, or a long chain of $refs, takes the library seconds to
    minutes (it releases the GIL meanwhile)."""
    kind, spec = constraint.kind, constraint.spec
    if kind in (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.STRUCTURAL_TAG):
        _check_schema_size(spec)
    try:
        if kind == StructuredOutputKind.JSON_SCHEMA:
            # Any whitespace, as vLLM: small models pretty-print their JSON, and forced
            # onto one line they were seen to repeat an array item until max_tokens.
            return xgr.Grammar.from_json_schema(spec, any_whitespace=True, strict_mode=True)
        if kind == StructuredOutputKind.JSON_OBJECT:
            return xgr.Grammar.from_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=True)
        if kind == StructuredOutputKind.REGEX:
            return xgr.Grammar.from_regex(spec)
        if kind == StructuredOutputKind.CHOICE:
            return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(spec)))
        if kind == StructuredOutputKind.GRAMMAR:
            return xgr.Grammar.from_ebnf(spec)
        if kind == StructuredOutputKind.STRUCTURAL_TAG:
            return xgr.Grammar.from_structural_tag(spec)
    except (RuntimeError, ValueError) as exc:
        raise GrammarError(_LOG_PREFIX.sub("", str(exc)).strip()) from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


def _check_schema_size(spec: str) -> None:
    """GrammarError if the JSON document ``spec`` nests deeper than MAX_SCHEMA_NESTING or
    holds more than MAX_SCHEMA_REFS "$ref"s; a document that is not JSON is left to the
    library's own message."""
    too_deep = GrammarError(
        f"the JSON schema nests deeper than {MAX_SCHEMA_NESTING} levels of JSON "
        f"(about {MAX_SCHEMA_NESTING // 2} of objects, arrays or properties)"
    )
    try:
        document = json.loads(spec)
    except RecursionError:  # deeper than Python's own parser goes
        raise too_deep from None
    except ValueError:
        return
    refs, level = 0, [(document, 1)]
    while level:
        value, depth = level.pop()
        if depth > MAX_SCHEMA_NESTING:
            raise too_deep
        if isinstance(value, dict):
            refs += "$ref" in value
            level.extend((child, depth + 1) for child in value.values())
        elif isinstance(value, list):
            level.extend((child, depth + 1) for child in value)
    if refs > MAX_SCHEMA_REFS:
        raise GrammarError(f"the JSON schema holds {refs} $refs, more than {MAX_SCHEMA_REFS}")


def grammar_problem(constraint: StructuredOutput) -> str | None:
    """Why the library refuses this constraint, or None: the check ``SamplingParams.validate``
    leaves to the engine."""
    try:
        build_grammar(constraint)
    except GrammarError as exc:
        return str(exc)
    return None


def _choice_ebnf(choices: list[str]) -> str:
    """A grammar whose root is exactly one of ``choices``. JSON string literals are valid EBNF
    string literals, escapes included; a NUL would end the library's C string early."""
    if any("\0" in choice for choice in choices):
        raise ValueError("choices must not contain a NUL character")
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def grammar_vocabulary(tokenizer: TokenizerInfo, vocab_size: int) -> xgr.TokenizerInfo:
    """The vocabulary as the grammar library sees it, from the tokenizer.json and EOS ids the
    engine has (no hub, no files). ``vocab_size`` is the model's: the logits' width, which may
    exceed the tokenizer's (ids past it are never allowed).

    The library detects how tokens spell bytes (byte-level BPE as GPT-2's "Ġ" for a space, or
    SentencePiece's "<0x0A>" byte fallback) from the tokenizer; special tokens are then blanked,
    which makes them unmatchable: the server leaves them out of the text, so a grammar must
    not count on them spelling anything. The EOS ids stay the stop tokens, allowed exactly
    where the grammar is complete."""
    backend = tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json)
    stop_token_ids = list(tokenizer.eos_token_ids) or None  # None: the library detects them
    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
    )
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    encoded_vocab = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in special:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo(
        encoded_vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


def _compiled_bytes(future: Future[xgr.CompiledGrammar]) -> int:
    """A compiled grammar's bytes; none yet while it compiles, none if its compile failed."""
    if not future.done() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


class GrammarCompiler:
    """Compiled grammars of one model's vocabulary, by constraint: each distinct one is compiled
    once, on ``executor``'s threads (the library releases the GIL, so the step loop runs on),
    and the most recently asked for are kept: ``max_cached`` at most, of ``max_cached_bytes``
    at most once compiled (a grammar's size grows with its constraint's, which a request body
    bounds only loosely, and a long choice list compiles to many times its own size). The
    compiles not done yet are counted (``num_compiling``) for the service to bound them: the
    pool's queue has no bound of its own. Call from one thread: the step loop."""

    def __init__(
        self,
        tokenizer: TokenizerInfo,
        vocab_size: int,
        executor: Executor,
        *,
        max_cached: int = 256,
        max_cached_bytes: int = 2 * 1024**3,
        threads_per_compile: int = 4,
    ) -> None:
        # Reading the vocabulary takes a second or so, holding the GIL: done on the pool at
        # the first compile, so that an engine never asked for one never pays for it.
        self._vocabulary = (tokenizer, vocab_size, threads_per_compile)
        self._compiler: Future[xgr.GrammarCompiler] | None = None
        self._executor = executor
        self._max_cached = max_cached
        self._max_cached_bytes = max_cached_bytes
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        # The cache's bytes as a running total, each entry's added once its compile is seen
        # done and taken off as it leaves: summing every entry at each compile would cost the
        # cache's length. Only the entries not seen done yet are looked at again, and they
        # are few (the compiles in flight, which the service bounds).
        self._cached_bytes = 0
        self._entry_bytes: dict[StructuredOutput, int] = {}
        self._not_counted: set[StructuredOutput] = set()
        # The compiles submitted and not done when last counted (one evicted from the cache
        # still counts until it is done).
        self._not_done: set[Future[xgr.CompiledGrammar]] = set()

    @staticmethod
    def _new_compiler(
        tokenizer: TokenizerInfo, vocab_size: int, threads_per_compile: int
    ) -> xgr.GrammarCompiler:
        # The library's own cache is off: this one also dedups compiles still running and
        # answers a repeat at once, without a trip through the pool.
        return xgr.GrammarCompiler(
            grammar_vocabulary(tokenizer, vocab_size),
            max_threads=threads_per_compile,
            cache_enabled=False,
        )

    @property
    def num_compiling(self) -> int:
        """Compiles queued on the pool or running: those submitted and not done (a cancelled
        one is done)."""
        self._not_done = {future for future in self._not_done if not future.done()}
        return len(self._not_done)

    @property
    def cached_bytes(self) -> int:
        """The compiled grammars' bytes in the cache; one still compiling counts none yet."""
        for constraint in [c for c in self._not_counted if self._cache[c].done()]:
            self._not_counted.remove(constraint)
            self._entry_bytes[constraint] = _compiled_bytes(self._cache[constraint])
            self._cached_bytes += self._entry_bytes[constraint]
        return self._cached_bytes

    def _forget(self, constraint: StructuredOutput) -> None:
        """Take the constraint's entry, gone from the cache, off the byte total."""
        self._not_counted.discard(constraint)
        self._cached_bytes -= self._entry_bytes.pop(constraint, 0)

    def would_compile(self, constraint: StructuredOutput) -> bool:
        """Whether ``compile`` would start a compile for this constraint: the cache holds no
        grammar of it, compiled or compiling."""
        return constraint not in self._cache

    def compile(self, constraint: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The constraint's compiled grammar, maybe still compiling. One the library refuses
        holds its GrammarError. The grammar is built on the pool too: for a deep schema that
        takes minutes, which on the step loop would stall every request."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            return future
        if self._compiler is None:
            self._compiler = self._executor.submit(self._new_compiler, *self._vocabulary)
        future = self._executor.submit(self._compile, self._compiler, constraint)
        self._not_done.add(future)
        self._cache[constraint] = future
        self._not_counted.add(constraint)
        # The least recently asked for go first; requests compiling one keep their reference.
        while len(self._cache) > self._max_cached or (
            len(self._cache) > 1 and self.cached_bytes > self._max_cached_bytes
        ):
            evicted, _ = self._cache.popitem(last=False)
            self._forget(evicted)
        return future

    def cancel_unstarted(
        self, constraint: StructuredOutput, future: Future[xgr.CompiledGrammar]
    ) -> None:
        """Cancel ``future``, the constraint's compile that no request waits for any more, if
        it has not started, and forget it: queued, it would delay every compile behind it, for
        a grammar nobody may ask for again. A running compile cannot be stopped (the library
        has no way to), so it finishes, for the cache."""
        if future.cancel() and self._cache.get(constraint) is future:
            del self._cache[constraint]
            self._forget(constraint)

    @staticmethod
    def _compile(
        compiler_future: Future[xgr.GrammarCompiler], constraint: StructuredOutput
    ) -> xgr.CompiledGrammar:
        grammar = build_grammar(constraint)
        compiler = compiler_future.result()
        try:
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(_LOG_PREFIX.sub("", str(exc)).strip()) from None


def new_matcher(
    compiled: xgr.CompiledGrammar, stop_token_ids: Sequence[int] = ()
) -> xgr.GrammarMatcher:
    """One request's place in its grammar, at the start. Once the output is complete the
    grammar allows only stop tokens: the EOS ids and the request's own ``stop_token_ids``;
    accepting one terminates the matcher, and the request should finish then."""
    if not stop_token_ids:
        return xgr.GrammarMatcher(compiled)
    stops = sorted({*compiled.tokenizer_info.stop_token_ids, *stop_token_ids})
    return xgr.GrammarMatcher(compiled, override_stop_tokens=stops)


def allows_no_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Whether the grammar allows no token at all where ``matcher`` is, not even a stop token:
    it matches no text (``root ::= root``), or none that the vocabulary can spell."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


class CompilingRequests:
    """Requests whose grammars are compiling. A constrained request waits here, outside the
    scheduler, until its grammar is ready (it gets its matcher then, and is scheduled) or
    fails; one that waits more than ``timeout_s`` fails too. ``take_done`` is called once a
    step, from the step loop."""

    def __init__(self, compiler: GrammarCompiler, timeout_s: float = 30.0) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._waiting: dict[Request, tuple[Future[xgr.CompiledGrammar], float]] = {}
        # How many of the waiting requests each compile has: once none, it may be cancelled.
        self._num_waiting_for: Counter[Future[xgr.CompiledGrammar]] = Counter()

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._waiting)

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar (n requests of one constraint share one
        compile); one the library refuses fails in ``take_done``."""
        assert request.sampling.structured_output is not None
        future = self.compiler.compile(request.sampling.structured_output)
        self._waiting[request] = (future, time.monotonic() + self.timeout_s)
        self._num_waiting_for[future] += 1
        request.status = RequestStatus.COMPILING

    def remove(self, request: Request) -> None:
        """Forget a request (aborted, or done waiting); a compile that no request waits for
        any more is cancelled if it has not started."""
        future, _ = self._waiting.pop(request)
        self._num_waiting_for[future] -= 1
        if self._num_waiting_for[future] == 0:
            del self._num_waiting_for[future]
            assert request.sampling.structured_output is not None
            self.compiler.cancel_unstarted(request.sampling.structured_output, future)

    def take_done(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose grammars are ready, each with its matcher, and those whose
        compile failed or ran out of time, each with the message for its user. A compile
        that the requests out of time leave unwaited for is cancelled if it has not started."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for request, (future, deadline) in list(self._waiting.items()):
            if future.done():
                error = future.exception()
                if error is None:
                    stops = request.sampling.stop_token_ids
                    request.grammar = new_matcher(future.result(), stops)
                    ready.append(request)
                else:
                    if not isinstance(error, GrammarError):
                        logger.error("compiling a grammar failed", exc_info=error)
                    failed.append((request, str(error)))
            elif now > deadline:
                failed.append(
                    (request, f"the grammar took more than {self.timeout_s:g} s to compile")
                )
            else:
                continue
            self.remove(request)
        return ready, failed


class GrammarBitmask:
    """Masks the logits of a step's sampled rows with their requests' grammars. One int32
    bitmask of ``max_rows`` rows, a bit per token, allocated once (pinned on CUDA, with its
    device copy); a step fills the rows it needs and moves them in one non-blocking copy."""

    def __init__(
        self, max_rows: int, vocab_size: int, device: torch.device, step_ops: StepOps
    ) -> None:
        shape = xgr.get_bitmask_shape(max_rows, vocab_size)
        self.step_ops = step_ops  # the backend's, whose kernel applies the masks
        on_cuda = device.type == "cuda"
        self._host = torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=on_cuda)
        # On CUDA, the device copy and the event that marks the host rows read by it.
        self._device = (
            torch.empty(shape, dtype=xgr.bitmask_dtype, device=device) if on_cuda else None
        )
        self._copied = torch.cuda.Event() if on_cuda else None
        # One thread: handing the rows to the library's threads costs more than filling them
        # (``scripts/bench_structured_output.py --model DIR`` prints the host's time in the
        # fill, "of which: fill").
        self._filler = xgr.BatchGrammarMatcher(max_threads=1)
        if self._device is not None:
            # Compile the mask's kernel now, not mid-step, where it is the library's Triton
            # kernel: Triton compiles a variant for a row count of 1, a multiple of 16 and any
            # other.
            for rows in sorted({1, min(2, max_rows), min(16, max_rows)}):
                allow_all = self._device[:rows].fill_(-1)
                logits = torch.zeros(rows, vocab_size, device=device)
                step_ops.apply_token_bitmask(logits, allow_all)

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Set to -inf, in place, each row's logits of the tokens its grammar forbids next.
        ``matchers`` holds one per row of ``logits``: None, or one terminated since the step
        was scheduled (its request finished: the row is dropped), leaves the row as it is."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host rows: free to refill
        num_rows = len(matchers)
        host = self._host[:num_rows]
        host.fill_(-1)  # every bit set: every token allowed
        self._filler.batch_fill_next_token_bitmask(
            [matchers[i] for i in rows], self._host, indices=rows
        )
        bitmask = host
        if self._device is not None and self._copied is not None:
            bitmask = self._device[:num_rows]
            bitmask.copy_(host, non_blocking=True)
            self._copied.record()
        self.step_ops.apply_token_bitmask(logits, bitmask)
