"""Prompts from request bodies, as token ids: messages through the model's chat template,
or a completion's prompts (text, or token ids checked against the vocabulary); and a chat
request made ready for the engine."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from protocol import StructuredOutput
from protocol.chat_template import ChatTemplateError
from server.answer_grammar import answer_constraint
from server.choices import PreparedGeneration
from server.errors import ApiError
from server.openai_schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from server.served_model import ServedModel
from server.tool_calling import ChatParsing, tool_use


async def chat_prompt(
    model: ServedModel,
    messages: list[ChatMessage],
    param: str,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages`` (and ``tools``, ``documents``) through the chat
    template; errors name ``param``, what the request calls its messages.
    ``add_generation_prompt`` ends the prompt where the assistant's answer starts.

    Rendered in a thread: the template is Python, its time grows with the request (a body of
    the default 4 MB holding a hundred thousand short messages takes seconds), and on the
    event loop it would stop every other request's stream meanwhile. In a thread the loop
    takes the GIL back at each switch interval and keeps streaming."""
    template = model.chat_template
    if template is None:
        assert model.chat_template_problem is not None
        raise ApiError(400, model.chat_template_problem, param=param)

    def render() -> str:
        return template.render(
            [message.model_dump(exclude_unset=True) for message in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            template_kwargs=template_kwargs,
        )

    try:
        return await asyncio.to_thread(render)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param=param) from exc


@dataclass(frozen=True, slots=True)
class ChatGeneration:
    generation: PreparedGeneration
    parsing: ChatParsing  # how each answer splits into reasoning, content and tool calls


async def chat_generation(
    model: ServedModel,
    body: ChatCompletionRequest,
    structured_output: StructuredOutput | None = None,
    peer: str = "",
) -> ChatGeneration:
    """A chat request made ready for the engine: its messages (and tools) through the chat
    template, cut as ``truncate_prompt_tokens`` says, its sampling (held to what its tools,
    its response format or ``structured_output``, and the model's reasoning make of the
    answer: ``server/answer_grammar.py``), stop strings and choices, and how its answers are
    read; ``peer``, the client's address, names its user if the body does not. The chat
    endpoint and the Responses API (which maps its requests to chat ones) both start here."""
    model.check_requests_at_once(body.num_candidates, "choices", "n")
    tools = tool_use(model, body)
    prompt = await chat_prompt(
        model,
        tools.prompt.messages(body.messages),
        body.prompt_param,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=tools.prompt.template_tools,
        documents=body.documents,
        template_kwargs=body.template_kwargs(),
    )
    # The template already holds the special tokens (as apply_chat_template does), unless
    # the request asks for them on top (vLLM's add_special_tokens).
    prompt_ids = await model.encode(prompt, add_special_tokens=body.add_special_tokens)
    prompt_ids = body.truncated_prompt(prompt_ids, model.max_model_len)
    parsing = ChatParsing(prompt, model.reasoning_parser, tools, body.include_reasoning)
    sampling = body.sampling_params(len(prompt_ids), model)
    # The Responses API's text.format, or the chat body's own response_format / guided_*.
    constraint = answer_constraint(
        model, body, tools, structured_output or sampling.structured_output, prompt
    )
    sampling = dataclasses.replace(sampling, structured_output=constraint)
    generation = PreparedGeneration(
        prompt_ids,
        sampling,
        body.stop,
        body.num_choices,
        body.include_stop_str_in_output,
        hidden_token_ids=body.hidden_token_ids(model, parsing.keeps_special_tokens),
        scheduling=body.scheduling(peer),
        prompt_logprobs_once=True,
    )
    return ChatGeneration(generation, parsing)


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    ids: list[int]
    echo: str | None  # with ``echo``: the text its choices start with; else None


async def completion_prompts(model: ServedModel, body: CompletionRequest) -> list[CompletionPrompt]:
    """Each of a completion's prompts: text tokenized (with the special tokens, if the body
    says; between fill-in-the-middle tokens, with a ``suffix``), or the ids given; then cut
    as ``truncate_prompt_tokens`` says."""
    return [await _completion_prompt(model, body, prompt) for prompt in body.prompt]


async def _completion_prompt(
    model: ServedModel, body: CompletionRequest, prompt: str | list[int]
) -> CompletionPrompt:
    if isinstance(prompt, list):
        model.check_token_ids(prompt, "prompt")
        ids = prompt
    else:
        text = prompt
        if body.suffix:
            if model.fill_in_middle is None:
                raise ApiError(
                    400,
                    f"suffix is not supported for {model.name}: its tokenizer has no "
                    "fill-in-the-middle tokens.",
                    param="suffix",
                    code="unsupported_parameter",
                )
            text = model.fill_in_middle.prompt(prompt, body.suffix)
        ids = await model.encode(text, add_special_tokens=body.add_special_tokens)
        if not ids:
            raise ApiError(400, "The prompt is empty.", param="prompt")
    kept = body.truncated_prompt(ids, model.max_model_len)
    if not body.echo:
        return CompletionPrompt(kept, None)
    # The prompt as given, unless it was token ids or was cut: then its tokens' text.
    echo = prompt if isinstance(prompt, str) and len(kept) == len(ids) else model.decode(kept)
    return CompletionPrompt(kept, echo)
