"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from server.chat_template import ChatTemplate, ChatTemplateError

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
