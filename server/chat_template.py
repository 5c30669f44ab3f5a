"""Hugging Face chat templates, rendered exactly as transformers renders them.

A chat template is Jinja code shipped with the model, so it runs in Jinja's
immutable sandbox with the same environment transformers builds (the same globals
and filters, the same whitespace options); anything else would render prompts the
model was not trained on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refuses to render these messages."""


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``; raises ``ChatTemplateError``."""
        try:
            return self._template.render(
                messages=[_flatten_content(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                tools=None,
            )
        except Exception as exc:
            # The template is the model author's code running on the user's input:
            # whatever it fails with (raise_exception, an undefined attribute, a type
            # error on unexpected content) means this conversation cannot be rendered.
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc


def _flatten_content(message: Message) -> dict[str, Any]:
    # OpenAI allows content as a list of parts; most templates expect a string.
    # Text parts are joined with newlines, as vLLM does.
    content = message.get("content")
    if isinstance(content, list):
        text = "\n".join(part["text"] for part in content if part.get("type") == "text")
        return {**message, "content": text}
    return dict(message)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces Jinja's tojson, which escapes HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without the class itself (no attribute tricks on it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore names, which lead to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Jinja's own signature trick, so that namespace(self=...) still works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers uses to find the
    assistant's tokens for training; rendering the body unchanged is all serving needs."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment
