"""Prompts from request bodies, as token ids: messages through the model's chat template,
or a completion's prompt (text, or token ids checked against the vocabulary)."""

from __future__ import annotations

from server.chat_template import ChatTemplateError
from server.errors import ApiError
from server.openai_schemas import ChatMessage
from server.served_model import ServedModel


async def chat_prompt_ids(
    model: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    """``messages`` rendered with the chat template and tokenized; ``add_generation_prompt``
    ends the prompt where the assistant's answer starts."""
    template = model.chat_template
    if template is None:
        assert model.chat_template_problem is not None
        raise ApiError(400, model.chat_template_problem, param="messages")
    dumped = [message.model_dump(exclude_unset=True) for message in messages]
    try:
        prompt = template.render(dumped, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    # The template already holds the special tokens (as apply_chat_template does).
    return await model.encode(prompt, add_special_tokens=False)


async def completion_prompt_ids(model: ServedModel, prompt: str | list[int]) -> list[int]:
    """A completion's prompt: text tokenized with the special tokens, or the ids given."""
    if isinstance(prompt, str):
        prompt_ids = await model.encode(prompt, add_special_tokens=True)
        if not prompt_ids:
            raise ApiError(400, "The prompt is empty.", param="prompt")
        return prompt_ids
    model.check_token_ids(prompt, "prompt")
    return prompt
