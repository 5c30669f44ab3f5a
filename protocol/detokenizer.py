"""Token ids to text, incrementally, with stop strings.

Decoding each token on its own is wrong: a multi-byte character can span several
tokens, and some decoders change a token's text depending on what precedes it
(leading spaces). Decoding the whole output each step is right but O(length) per
token. So we keep a short window: ``prefix`` tokens already emitted, as context,
followed by tokens not emitted yet; each step decodes the window with and without
the new tokens and emits the difference (the technique vLLM and TGI use). The window
is trimmed as text is emitted, so each step costs O(1) in the output's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# The decoder's output for an incomplete UTF-8 byte sequence at the end of the ids.
_REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as context before the first output token, so that the first
# output token decodes as it does after the prompt (e.g. keeps its leading space).
_PROMPT_CONTEXT_TOKENS = 5
# The most steps in a row that may hold their tokens back (UTF-8 takes at most 4 bytes: a
# character completes within 3 steps of a byte each); after them, what the window decodes to
# is emitted as it is. Each step decodes the whole window, so a window that never emptied
# (tokens that end inside a character again and again, as a request allowed only a lead byte
# makes; special tokens that decode to nothing) made detokenizing quadratic in the length.
_MOST_HELD_STEPS = 16


class IncrementalDetokenizer:
    """Turns the output ids of one request into final text, a step at a time.

    ``push`` returns only text that can no longer change: never half a character, and
    nothing that could be the start of a stop string. Once a stop string appears,
    ``stopped`` is set, and the text is cut before it (after it, with
    ``include_stop``); the caller then ends the request. As in vLLM, a stop string only
    counts once the output has more than ``min_tokens`` tokens: it must end in the text of
    a later token.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
        hidden_ids: frozenset[int] | None = None,
        min_tokens: int = 0,
    ) -> None:
        """``hidden_ids``: None decodes without special tokens; a set decodes with them,
        but for these ids (EOS, stop tokens), which are dropped as they arrive."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = hidden_ids is None
        self._hidden_ids = hidden_ids or frozenset()
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output tokens pushed
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        # ids[:read_offset] have been emitted; ids[prefix_offset:read_offset] are context.
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._held_steps = 0  # steps in a row that emitted nothing
        self._stop = _StopStringMatcher(stop, include_stop)
        # Of the last step's tokens, those its text was made of: all of them, but those
        # after the token a stop string ended in.
        self.tokens_taken = 0

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds the new tokens of one engine step; returns the text that became final."""
        if not self._stop.watching or len(token_ids) < 2:
            self.tokens_taken = len(token_ids)
            return self._push(token_ids)
        # With stop strings, the tokens of a step of several (verified drafts) are read one
        # at a time, as if each were a step: a stop string counts only if it ends in the
        # text of a token after the first ``min_tokens``, and the step's tokens after the one
        # it ends in are no part of the answer (its text, usage and log-probabilities).
        pieces = []
        self.tokens_taken = 0
        for token_id in token_ids:
            pieces.append(self._push([token_id]))
            self.tokens_taken += 1
            if self._stop.stopped:
                break
        return "".join(pieces)

    def _push(self, token_ids: Sequence[int]) -> str:
        if self._stop.stopped:
            return ""
        self._num_tokens += len(token_ids)  # the engine's count, hidden ones included
        if self._hidden_ids:
            token_ids = [token_id for token_id in token_ids if token_id not in self._hidden_ids]
        self._ids.extend(token_ids)
        end = len(self._ids)
        text = self._decode(self._ids[self._prefix_offset :])
        # A trailing replacement character means the last token ends inside a character:
        # the tokens from the one that starts it wait until it is complete. Those before it,
        # if they complete characters of their own, go out now (a step of several tokens can
        # end inside a character step after step: a run of emoji).
        if self._held_steps < _MOST_HELD_STEPS and text.endswith(_REPLACEMENT_CHAR):
            end, text = self._last_complete(end - len(token_ids), end - 1)
        if self._held_steps < _MOST_HELD_STEPS and len(text) <= len(self._prefix_text):
            self._held_steps += 1
            return ""
        self._held_steps = 0
        new_text = text[len(self._prefix_text) :]
        self._advance(end)
        return self._stop.feed(new_text, searched=self._num_tokens > self._min_tokens)

    def _last_complete(self, first: int, last: int) -> tuple[int, str]:
        """The window's longest prefix ending at one of ids[first:last] (exclusive ends
        ``first + 1`` to ``last``, the step's tokens but its last) whose text ends on a
        whole character, and that text; else the window up to ``first``. A step is a few
        tokens: a few decodes, only in a step that ends inside a character."""
        for end in range(last, max(first, self._read_offset), -1):
            text = self._decode(self._ids[self._prefix_offset : end])
            if not text.endswith(_REPLACEMENT_CHAR):
                return end, text
        return self._read_offset, self._prefix_text

    def finish(self) -> str:
        """Everything still held back, once the engine has finished the request."""
        if self._stop.stopped:
            return ""
        # The request is over, so an incomplete character will never complete: emit
        # what the decoder makes of it, as decoding all the ids at once would.
        text = self._decode(self._ids[self._prefix_offset :])
        new_text = text[len(self._prefix_text) :]
        self._advance()
        return self._stop.feed(new_text) + self._stop.release()

    def _advance(self, end: int | None = None) -> None:
        # The tokens emitted (those before ``end``; all by default) become the next step's
        # context, the rest wait; older ones are dropped, which keeps the window (and so the
        # decode cost) small.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids) if end is None else end - self._read_offset
        self._prefix_text = self._decode(self._ids[: self._read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class _StopStringMatcher:
    """Cuts text before the first stop string (after it, with ``include_stop``), holding
    back possible beginnings of one."""

    def __init__(self, stop: Sequence[str], include_stop: bool) -> None:
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._held = ""  # a suffix of the text so far that some stop string starts with
        self.stopped = False

    @property
    def watching(self) -> bool:
        """There are stop strings, none found yet."""
        return bool(self._stop) and not self.stopped

    def feed(self, text: str, searched: bool = True) -> str:
        """Returns the part of ``text`` (after what was held) that is final. Only a stop
        string that ends in ``text`` counts, and none if ``searched`` is false."""
        if not self._stop:
            return text
        buffer = self._held + text
        held = len(self._held)
        found = [
            (at, stop)
            for stop in (self._stop if searched else ())
            if (at := buffer.find(stop, max(held - len(stop) + 1, 0))) >= 0
        ]
        if found:
            # The first stop string to appear; of those starting together, the first listed.
            at, stop = min(found, key=lambda match: match[0])
            self.stopped = True
            self._held = ""
            return buffer[: at + len(stop)] if self._include_stop else buffer[:at]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def release(self) -> str:
        """The held text, once no more text will come (so it cannot become a stop string)."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        # Only the last len(stop) - 1 characters can start an incomplete stop string, so
        # this costs O(stop length) whatever the length of the output.
        longest = 0
        for stop in self._stop:
            start = max(len(buffer) - len(stop) + 1, 0)
            start = buffer.find(stop[0], start)
            while start >= 0 and len(buffer) - start > longest:
                if stop.startswith(buffer[start:]):
                    longest = len(buffer) - start
                    break
                start = buffer.find(stop[0], start + 1)
        return longest
