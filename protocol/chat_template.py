"""Hugging Face chat templates, rendered exactly as transformers renders them.

A chat template is Jinja code shipped with the model, so it runs in Jinja's
immutable sandbox with the same environment transformers builds (the same globals
and filters, the same whitespace options); anything else would render prompts the
model was not trained on. The template receives what transformers'
``apply_chat_template`` passes it: the messages, ``tools`` as OpenAI function
schemas, ``documents``, ``add_generation_prompt``, the special tokens and any extra
variables (a request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

# For continue_final_message transformers appends this to the final message's
# content, renders, and cuts the prompt where the tag appears.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The names a message's reasoning may come under. Templates read reasoning_content
# (gpt-oss's read thinking), so transformers fills both from whichever is given.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables that render() passes itself; chat_template_kwargs cannot replace them.
_RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


class ChatTemplateError(ValueError):
    """The template cannot be compiled, or refuses to render these messages."""


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(environment.parse(source))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        self.source = source
        # A template that never reads `tools` would drop them without a word, so the
        # API refuses tools for its model instead.
        self.supports_tools = "tools" in variables
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; raises ``ChatTemplateError``.

        ``tools`` are OpenAI tool dicts (``{"type": "function", "function": {...}}``),
        given to the template as they are, and so are ``documents`` (for retrieval-augmented
        generation: each a dict, typically of "title" and "text").
        ``continue_final_message`` leaves the last message open, so that the model goes on
        with its content. ``template_kwargs`` are extra template variables.
        """
        extra = dict(template_kwargs or {})
        if reserved := sorted(_RESERVED_VARIABLES & extra.keys()):
            raise ChatTemplateError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                "the request has fields of their own for them"
            )
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true: "
                "either the final message goes on or a new one starts after it"
            )
        conversation = [_template_message(message) for message in messages]
        final_content = _tag_final_message(conversation) if continue_final_message else None
        variables = {"bos_token": self._bos_token, "eos_token": self._eos_token, **extra}
        try:
            prompt = self._template.render(
                messages=conversation,
                tools=None if tools is None else list(tools),
                documents=None if documents is None else list(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as exc:
            # The template is the model author's code running on the user's input:
            # whatever it fails with (raise_exception, an undefined attribute, a type
            # error on unexpected content) means this conversation cannot be rendered.
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc
        if final_content is None:
            return prompt
        return _cut_after_final_message(prompt, final_content)


def _template_message(message: Message) -> dict[str, Any]:
    """A copy of the message in the shape templates read (as transformers and vLLM give it)."""
    result = dict(message)
    # OpenAI allows content as a list of parts; most templates expect a string.
    # Text parts are joined with newlines, as vLLM does. A null content (an assistant
    # message with only tool calls) is empty text, as vLLM gives it: templates such
    # as Qwen3's look inside it.
    content = result.get("content")
    if isinstance(content, list):
        result["content"] = "\n".join(
            part["text"] for part in content if part.get("type") == "text"
        )
    elif content is None and "content" in result:
        result["content"] = ""
    given = (result[key] for key in _REASONING_FIELDS if result.get(key) is not None)
    reasoning = next(given, None)
    if reasoning is not None:
        result = {"thinking": reasoning, **result, "reasoning_content": reasoning}
    if isinstance(result.get("tool_calls"), list):
        result["tool_calls"] = [_template_tool_call(call) for call in result["tool_calls"]]
    return result


def _template_tool_call(call: Any) -> Any:
    # OpenAI sends a call's arguments as a JSON string; templates expect the object
    # (Llama 3.1's and Qwen2.5's apply tojson to it), so it is parsed, as vLLM does.
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as exc:  # or nested too deep
            raise ChatTemplateError(
                f"the arguments of a tool call are not valid JSON: {arguments!r}"
            ) from exc
    return {**call, "function": function}


def _tag_final_message(conversation: list[dict[str, Any]]) -> str:
    """Marks the end of the final message's content; returns that content."""
    if not conversation:
        raise ChatTemplateError("continue_final_message needs a final message to continue")
    content = conversation[-1].get("content")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message: the final message has no content")
    conversation[-1]["content"] = content + _CONTINUE_TAG
    return content


def _cut_after_final_message(prompt: str, final_content: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_content.strip() not in prompt or tag not in prompt:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final "
            "message's content as it is, so it cannot be continued"
        )
    cut = prompt.rindex(tag)
    if prompt.startswith(_CONTINUE_TAG, cut):
        return prompt[:cut]
    # The template trimmed the content's trailing whitespace, and the tag's with it.
    return prompt[:cut].rstrip()


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
