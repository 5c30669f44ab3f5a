"""Real chat templates and the answers they teach, for the parser tests.

The templates under templates/ are the models' own (Apache-2.0; see its README). A
model's answer, as its template teaches it, is what rendering the conversation with
the answer adds to rendering it with the generation prompt alone.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from protocol.chat_template import ChatTemplate

TEMPLATE_DIR = Path(__file__).parent / "templates"
CHATML_TOOLS = Path(__file__).parents[2] / "server" / "templates" / "chatml_tools.jinja"

QWEN25 = "Qwen-Qwen2.5-7B-Instruct"
QWEN3 = "Qwen-Qwen3-0.6B"
QWQ = "Qwen-QwQ-32B"
MISTRAL_NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
MISTRAL_SMALL_32 = "Mistral-Small-3.2-24B-Instruct-2506"

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]


def template_source(name: str) -> str:
    if name == "chatml_tools":
        return CHATML_TOOLS.read_text()
    return (TEMPLATE_DIR / f"{name}.jinja").read_text()


def special_tokens(name: str) -> tuple[str | None, str]:
    """(bos, eos) of the template's model."""
    if name.startswith(("mistralai", "Mistral")):
        return "<s>", "</s>"
    return None, "<|im_end|>"


def chat_template(name: str) -> ChatTemplate:
    return ChatTemplate(template_source(name), *special_tokens(name))


def tool_call(call_id: str, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as OpenAI clients send it (arguments as JSON text)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def split_turn(
    template: ChatTemplate,
    conversation: Sequence[Mapping[str, Any]],
    answer: Mapping[str, Any],
    end_of_turn: str,
    **options: Any,
) -> tuple[str, str]:
    """(prompt, answer text): the answer as the template renders it, up to its end token."""
    prompt = template.render(conversation, add_generation_prompt=True, **options)
    whole = template.render([*conversation, answer], add_generation_prompt=False, **options)
    assert whole.startswith(prompt), (prompt, whole)
    text = whole[len(prompt) :]
    return prompt, text[: text.index(end_of_turn)]


def chunkings(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Ways a stream may cut ``text``: a character at a time, every cut in two, random sizes."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(20):
        pieces, start = [], 0
        while start < len(text):
            size = rng.randint(1, 8)
            pieces.append(text[start : start + size])
            start += size
        yield pieces
