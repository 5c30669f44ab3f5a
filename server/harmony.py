"""Reading answers in OpenAI's harmony format (gpt-oss), as vLLM's ``openai_gptoss``
reasoning parser reads them.

A harmony answer is a sequence of messages. The prompt ends with ``<|start|>assistant``, so
the first message's header follows at once; later ones start with ``<|start|>assistant``.
A header names the message's channel (``<|channel|>analysis``, ``commentary``, ``final``)
and, for a tool call, its recipient (`` to=functions.NAME``, before or after the channel,
perhaps with ``<|constrain|>json``); ``<|message|>`` ends it. The body runs to ``<|end|>``
(another message follows), ``<|call|>`` (a tool call: the model stops there) or
``<|return|>`` (the answer's end); the last two are stop tokens, whose text the server
leaves out, so the body may also run to the end of the text.

``HarmonyReasoningParser`` sends the analysis channel to ``reasoning_content`` and the final
channel (and commentary the model writes to no recipient: its preambles) to ``content``;
a message to a function goes on as content in one form, ``<|channel|>commentary
to=functions.NAME<|message|>ARGUMENTS<|call|>``, which the ``openai`` tool-call parser
(``server/tool_parsers/harmony.py``) turns into a tool call. An answer that does not begin
as harmony does (a model that does not write it) is all content.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from server.reasoning import StreamingReasoningParser
from server.tool_parsers.base import partial_marker_length
from server.tool_parsers.harmony import CALL, CALL_HEADER, MESSAGE

START = "<|start|>"
CHANNEL = "<|channel|>"
END = "<|end|>"
RETURN = "<|return|>"
CONSTRAIN = "<|constrain|>"
_BODY_ENDS = (END, CALL, RETURN, START)
# How a harmony answer's first header may begin, after the prompt's <|start|>assistant.
_HEADER_STARTS = (CHANNEL, START, " to=", "to=", CONSTRAIN)
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class HarmonyReasoningParser(StreamingReasoningParser):
    """Splits one harmony answer into reasoning and content; one instance per answer."""

    name = "openai_gptoss"
    # For a grammar over the answer (``server/answer_grammar.py``): the analysis message,
    # then the final message's header, after which the answer proper starts.
    start: ClassVar[str] = f"{CHANNEL}analysis{MESSAGE}"
    end: ClassVar[str] = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"

    def __init__(self, prompt: str) -> None:
        super().__init__()
        self._state: Literal["first header", "header", "body", "plain"] = "first header"
        self._kind: Literal["reasoning", "content", "call"] = "content"
        # How far the header in _pending was searched for its end: each delta searches only
        # what came since (a header that never ends cost quadratic time, searched whole).
        self._header_searched = 0

    def _consume(self, final: bool) -> None:
        while True:
            if self._state == "first header":
                if not final and any(start.startswith(self._pending) for start in _HEADER_STARTS):
                    return  # too little to tell
                if not self._pending.startswith(_HEADER_STARTS):
                    self._state = "plain"
                    continue
                self._state = "header"
            if self._state == "plain":
                self._out.content += self._pending
                self._pending = ""
                return
            if self._state == "header":
                end = self._pending.find(MESSAGE, self._header_searched)
                if end < 0:
                    if final and self._pending:  # a header broken off: shown as written
                        self._out.content += self._pending
                        self._pending = ""
                    self._header_searched = max(0, len(self._pending) - len(MESSAGE) + 1)
                    return
                self._header_searched = 0
                self._begin_body(self._pending[:end])
                self._pending = self._pending[end + len(MESSAGE) :]
                self._state = "body"
            ends = [i for marker in _BODY_ENDS if (i := self._pending.find(marker)) >= 0]
            if not ends:
                keep = 0 if final else partial_marker_length(self._pending, *_BODY_ENDS)
                self._body(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                if final:
                    self._end_body()
                return
            end = min(ends)
            self._body(self._pending[:end])
            self._end_body()
            rest = self._pending[end:]
            marker = next(marker for marker in _BODY_ENDS if rest.startswith(marker))
            # <|start|> begins the next header; the others end this message.
            self._pending = rest if marker == START else rest[len(marker) :]
            self._state = "header"

    def _begin_body(self, header: str) -> None:
        recipient = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        channel = _CHANNEL_NAME.search(header)
        if recipient is not None and recipient[1].startswith("functions."):
            self._kind = "call"
            name = recipient[1].removeprefix("functions.")
            self._out.content += f"{CALL_HEADER}{name}{MESSAGE}"
        elif channel is not None and channel[1] == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _body(self, text: str) -> None:
        if self._kind == "reasoning":
            self._out.reasoning_content += text
        else:
            self._out.content += text

    def _end_body(self) -> None:
        if self._kind == "call":
            self._out.content += CALL
        self._kind = "content"
