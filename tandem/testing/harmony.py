"""A small real tokenizer and chat template in OpenAI's harmony format (gpt-oss), for tests.

The tokenizer is byte-level (every byte one token, no merges: any text encodes and decodes)
with harmony's special tokens after the 256 bytes, as o200k_harmony holds them. The
template is written here, not gpt-oss's own: it renders what the parsers read (a turn per
message, tool calls as ``<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>ARGUMENTS<|call|>``, the prompt ending ``<|start|>assistant``) as gpt-oss's
chat_template.jinja renders them. generation_config.json names ``<|return|>`` and
``<|call|>`` as the ends of generation, as gpt-oss's does.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HARMONY_SPECIAL_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
HARMONY_VOCAB = 256 + len(HARMONY_SPECIAL_TOKENS)

HARMONY_TEMPLATE = """\
{{- '<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, commentary, \
final. Channel must be included for every message.' -}}
{%- if tools %}{{ "\\nCalls to these tools must go to the commentary channel: 'functions'." }}\
{% endif -%}
{{- '<|end|>' -}}
{%- if tools -%}
{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' -}}
{%- for tool in tools %}{{ '// ' ~ tool.function.description ~ '\\ntype ' ~ tool.function.name \
~ ' = (_: ' ~ (tool.function.parameters | tojson) ~ ') => any;\\n\\n' }}{% endfor -%}
{{- '} // namespace functions<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role in ('system', 'developer') -%}
{{- '<|start|>developer<|message|># Instructions\\n\\n' ~ message.content ~ '<|end|>' -}}
{%- elif message.role == 'user' -%}
{{- '<|start|>user<|message|>' ~ message.content ~ '<|end|>' -}}
{%- elif message.role == 'tool' -%}
{{- '<|start|>functions.' ~ (message.name or 'tool') ~ ' to=assistant<|channel|>commentary\
<|message|>' ~ message.content ~ '<|end|>' -}}
{%- elif message.tool_calls -%}
{%- for call in message.tool_calls -%}
{{- '<|start|>assistant to=functions.' ~ call.function.name ~ '<|channel|>commentary json\
<|message|>' ~ call.function.arguments ~ '<|call|>' -}}
{%- endfor -%}
{%- else -%}
{{- '<|start|>assistant<|channel|>final<|message|>' ~ message.content ~ '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}
"""


def harmony_tokenizer() -> Tokenizer:
    """Bytes as ids 0-255, harmony's special tokens from 256 on."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({char: i for i, char in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True) for token in HARMONY_SPECIAL_TOKENS]
    )
    return tokenizer


def save_harmony_tokenizer(directory: Path) -> None:
    """The tokenizer, the template and the ends of generation into a checkpoint directory."""
    tokenizer = harmony_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>"})
    )
    ends = [tokenizer.token_to_id(token) for token in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
