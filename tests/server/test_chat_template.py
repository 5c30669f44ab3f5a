"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.checkpoint.gguf_file import read_gguf
from engine.checkpoint.resolve import default_model_path
from protocol.chat_template import ChatTemplate, ChatTemplateError
from server.tool_parsers import tool_parser_for_template
from tests.server.renderings import (
    MISTRAL_NEMO,
    MISTRAL_SMALL_32,
    QWEN3,
    QWEN25,
    QWQ,
    WEATHER_TOOLS,
    chat_template,
    special_tokens,
    template_source,
    tool_call,
)

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta-Llama-3-8B-Instruct's template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Mistral-style: refuses conversations whose roles do not alternate.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# Uses the filters and globals transformers adds, and whitespace control around blocks.
FEATURES = """{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% set ns.count = ns.count + 1 %}
    {{ message | tojson }}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% generation %}[{{ message['role'] }}]{% endgeneration %}
{% endfor %}
{{ ns.count }} {{ tools is none }} {{ strftime_now('%Y') | length }}
"""

CONVERSATION = [
    {"role": "system", "content": "You are terse. Réponds en français si on te parle français."},
    {"role": "user", "content": "Bonjour ! Ça va ? 你好 🎉"},
    {"role": "assistant", "content": "  Oui, très bien.  "},
    {"role": "user", "content": "Say \"<b>\" & 'quote'"},
]


def transformers_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["hello world"], trainers.BpeTrainer(vocab_size=50))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=template,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    rendered = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


def render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return ChatTemplate(template, "<|begin_of_text|>", "<|eot_id|>").render(
        messages, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("template", [CHATML, LLAMA3, FEATURES], ids=["chatml", "llama3", "misc"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_same_as_transformers(template: str, add_generation_prompt: bool) -> None:
    expected = transformers_render(
        template, CONVERSATION, add_generation_prompt=add_generation_prompt
    )
    assert render(template, CONVERSATION, add_generation_prompt) == expected


def test_llama3_starts_with_bos_once() -> None:
    prompt = render(LLAMA3, CONVERSATION, add_generation_prompt=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert prompt.count("<|begin_of_text|>") == 1
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tojson_does_not_escape_html_or_unicode() -> None:
    prompt = render("{{ messages[0] | tojson }}", [{"role": "user", "content": "<b> é"}], False)
    assert prompt == '{"role": "user", "content": "<b> é"}'


def test_content_as_a_list_of_text_parts() -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        }
    ]
    joined = [{"role": "user", "content": "first\nsecond"}]
    prompt = render(CHATML, parts, add_generation_prompt=True)
    assert prompt == render(CHATML, joined, add_generation_prompt=True)
    assert prompt == transformers_render(CHATML, joined, add_generation_prompt=True)


def test_raise_exception_becomes_a_clear_error() -> None:
    messages = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render(ALTERNATING, messages, add_generation_prompt=True)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(ALTERNATING, good, True) == transformers_render(ALTERNATING, good)


def test_missing_fields_and_type_errors_are_template_errors() -> None:
    with pytest.raises(ChatTemplateError):
        render(CHATML, [{"role": "user"}], add_generation_prompt=True)  # content is undefined


def test_syntax_error_is_reported_at_compile_time() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for message in messages %}", None, None)


def test_the_sandbox_holds() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        render(escape, CONVERSATION, add_generation_prompt=False)
    underscore = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    with pytest.raises(ChatTemplateError):
        render(underscore, CONVERSATION, add_generation_prompt=False)


def test_the_callers_messages_are_not_changed() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    render(CHATML, messages, add_generation_prompt=True)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


# --- tools, tool calls, continue_final_message, chat_template_kwargs -------------------------

REAL_TEMPLATES = [QWEN25, QWEN3, QWQ, MISTRAL_NEMO, MISTRAL_SMALL_32, "chatml_tools"]

# Mistral's templates want call ids of nine letters or digits.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            tool_call("abcDEF123", "get_weather", {"city": "Paris"}),
            tool_call("xyz789QRS", "get_weather", {"city": "Zürich", "unit": "celsius"}),
        ],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "22 °C"},
    {"role": "tool", "tool_call_id": "xyz789QRS", "content": "18 °C"},
    {"role": "assistant", "content": "Paris: 22 °C. Zürich: 18 °C."},
    {"role": "user", "content": "Thanks!"},
]


def as_transformers_gets_it(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as transformers users pass it: arguments as objects."""
    converted = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if "tool_calls" in message:
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": json.loads(args)}}
                for call in message["tool_calls"]
                if (args := call["function"]["arguments"]) is not None
            ]
        converted.append(message)
    return converted


def real_render(name: str, messages: list[dict[str, Any]], **options: Any) -> str:
    return chat_template(name).render(messages, **options)


def real_transformers_render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    bos, eos = special_tokens(name)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()),
        chat_template=template_source(name),
        bos_token=bos,
        eos_token=eos,
    )
    rendered = hf.apply_chat_template(as_transformers_gets_it(messages), tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


@pytest.mark.parametrize("name", REAL_TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_and_tool_calls_same_as_transformers(name: str, add_generation_prompt: bool) -> None:
    ours = real_render(
        name, TOOL_CONVERSATION, add_generation_prompt=add_generation_prompt, tools=WEATHER_TOOLS
    )
    theirs = real_transformers_render(
        name, TOOL_CONVERSATION, add_generation_prompt=add_generation_prompt, tools=WEATHER_TOOLS
    )
    assert ours == theirs
    assert '"name": "get_weather"' in ours  # the tools and the calls are in the prompt
    assert "18 °C" in ours  # and the tool results


def test_tool_call_arguments_become_objects() -> None:
    # Qwen2.5's template applies tojson to the arguments: a JSON string would come out quoted.
    prompt = real_render(QWEN25, TOOL_CONVERSATION[:3], add_generation_prompt=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '"arguments": "{' not in prompt


def test_tool_call_arguments_that_are_not_json_are_refused() -> None:
    messages = [*TOOL_CONVERSATION[:2], dict(TOOL_CONVERSATION[2])]
    messages[2]["tool_calls"] = [
        {"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    ]
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        real_render(QWEN25, messages)


def test_which_templates_support_tools() -> None:
    for name in REAL_TEMPLATES:
        assert chat_template(name).supports_tools, name
    for source in (CHATML, LLAMA3, ALTERNATING):
        assert not ChatTemplate(source, None, None).supports_tools


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_kwargs_reach_the_template(enable_thinking: bool) -> None:
    messages = [{"role": "user", "content": "2 + 2?"}]
    kwargs = {"enable_thinking": enable_thinking}
    ours = real_render(QWEN3, messages, template_kwargs=kwargs)
    assert ours == real_transformers_render(QWEN3, messages, add_generation_prompt=True, **kwargs)
    assert ours.endswith("<think>\n\n</think>\n\n") != enable_thinking


def test_chat_template_kwargs_cannot_replace_the_request_fields() -> None:
    kwargs = {"messages": [], "add_generation_prompt": False, "enable_thinking": False}
    with pytest.raises(ChatTemplateError, match="cannot set add_generation_prompt, messages"):
        real_render(QWEN3, CONVERSATION, template_kwargs=kwargs)


def test_reasoning_content_reaches_the_template() -> None:
    # Qwen3 renders the latest turn's reasoning back into the prompt; vLLM's name for the
    # field ("reasoning") reaches it too, as transformers aliases it.
    for field in ("reasoning_content", "reasoning"):
        messages = [
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4", field: "\nSimple sum.\n"},
        ]
        ours = real_render(QWEN3, messages, add_generation_prompt=False)
        assert ours.endswith("<think>\nSimple sum.\n</think>\n\n4<|im_end|>\n")
        assert ours == real_transformers_render(QWEN3, messages)


CONTINUED = [
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "One, two, "},
]


@pytest.mark.parametrize(
    ("name", "template"),
    [("chatml", CHATML), ("llama3", LLAMA3), ("qwen3", None)],
)
def test_continue_final_message_same_as_transformers(name: str, template: str | None) -> None:
    if template is None:
        options = {"add_generation_prompt": False, "continue_final_message": True}
        ours = real_render(QWEN3, CONTINUED, **options)
        theirs = real_transformers_render(QWEN3, CONTINUED, continue_final_message=True)
    else:
        ours = ChatTemplate(template, "<|begin_of_text|>", "<|eot_id|>").render(
            CONTINUED, add_generation_prompt=False, continue_final_message=True
        )
        theirs = transformers_render(template, CONTINUED, continue_final_message=True)
    assert ours == theirs
    # The prompt ends inside the assistant's message, where the model goes on.
    assert ours.rstrip().endswith("One, two,")
    assert ours.endswith("One, two, ") == (name != "llama3")  # Llama 3's template trims


def test_continue_final_message_refusals() -> None:
    template = ChatTemplate(CHATML, None, None)
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        template.render(CONTINUED, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="needs a final message"):
        template.render([], add_generation_prompt=False, continue_final_message=True)
    drops_content = "{% for message in messages %}{{ message['role'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        ChatTemplate(drops_content, None, None).render(
            CONTINUED, add_generation_prompt=False, continue_final_message=True
        )


def test_chatml_tools_is_smollm2s_template_when_there_are_no_tools() -> None:
    """The tool template for SmolLM2 (the default model, whose own template has no tools)
    renders a conversation without tools as SmolLM2's own template does."""
    smollm2 = read_gguf(default_model_path()).metadata["tokenizer.chat_template"]
    assert not ChatTemplate(smollm2, None, None).supports_tools
    assert tool_parser_for_template(smollm2) is None
    ours = real_render("chatml_tools", CONVERSATION)
    assert ours == ChatTemplate(smollm2, None, None).render(CONVERSATION)


def test_documents_reach_the_template_as_transformers_gives_them() -> None:
    """A retrieval-augmented template reads ``documents`` (the chat endpoint's field)."""
    source = (
        "{% for document in documents or [] %}[{{ document.title }}] {{ document.text }}\n"
        "{% endfor %}{% for message in messages %}{{ message.role }}: {{ message.content }}\n"
        "{% endfor %}"
    )
    documents = [{"title": "Paris", "text": "The capital of France."}, {"title": "B", "text": "b"}]
    messages = [{"role": "user", "content": "What is Paris?"}]
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=source)
    expected = reference.apply_chat_template(
        messages, documents=documents, tokenize=False, add_generation_prompt=False
    )
    template = ChatTemplate(source, None, None)
    assert template.render(messages, False, documents=documents) == expected
    assert "[Paris] The capital of France." in expected
    assert template.render(messages, False) == "user: What is Paris?\n"
