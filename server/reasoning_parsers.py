"""Reasoning parsers by name (vLLM's ``--reasoning-parser`` names), and the one a chat
template's markers call for."""

from __future__ import annotations

from server.harmony import CHANNEL, HarmonyReasoningParser
from server.reasoning import ReasoningParser, ThinkReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (ThinkReasoningParser, HarmonyReasoningParser)
}


def reasoning_parser_for_template(template_source: str) -> str | None:
    """The reasoning parser for a template whose model thinks in ``<think>`` blocks, or in
    harmony's analysis channel (gpt-oss)."""
    if CHANNEL in template_source:
        return HarmonyReasoningParser.name
    return ThinkReasoningParser.name if ThinkReasoningParser.end in template_source else None
