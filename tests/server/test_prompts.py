"""Request bodies and the prompts from them (server/openai_schemas.py's reading,
server/prompts.py), and what of them runs off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest
from starlette.requests import Request

from protocol.chat_template import ChatTemplate
from server import openai_schemas
from server.openai_schemas import ChatMessage, CompletionRequest, read_request
from server.prompts import chat_prompt
from server.routes.tokenize import Tokenization
from server.served_model import ChatOptions, ServedModel
from tests.server.test_openai_schemas import CHATML, handshake


def test_the_chat_template_renders_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # A template's time grows with the request (seconds for a body of many short messages):
    # on the event loop it would stop every other request's stream while it renders.
    model = ServedModel.from_handshake(handshake(CHATML), ChatOptions())
    rendered_on: list[int] = []
    render = ChatTemplate.render

    def recorded(self: ChatTemplate, *args: object, **kwargs: object) -> str:
        rendered_on.append(threading.get_ident())
        return render(self, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", recorded)
    messages = [ChatMessage(role="user", content=f"message {i}") for i in range(3)]

    async def prompt() -> tuple[str, int]:
        return await chat_prompt(model, messages, "messages"), threading.get_ident()

    text, loop_thread = asyncio.run(prompt())
    assert "message 2" in text
    assert rendered_on and loop_thread not in rendered_on


def test_detokenize_decodes_off_the_event_loop() -> None:
    # /detokenize takes as many ids as a body holds (about two million in 4 MB): decoding
    # them on the event loop stopped every other request's stream for a third of a second.
    reply = handshake(CHATML)
    model = ServedModel.from_handshake(reply, ChatOptions())
    decoded_on: list[int] = []

    class RecordingTokenizer:
        def decode(self, *args: object, **kwargs: object) -> str:
            decoded_on.append(threading.get_ident())
            return model.tokenizer.decode(*args, **kwargs)

        def decode_batch(self, *args: object, **kwargs: object) -> list[str]:
            decoded_on.append(threading.get_ident())
            return model.tokenizer.decode_batch(*args, **kwargs)

    recording = dataclasses.replace(model, tokenizer=RecordingTokenizer())
    ids = model.tokenizer.encode("hello world").ids
    body = json.dumps({"tokens": ids}).encode()

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def detokenize() -> tuple[bytes, int]:
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        response = await Tokenization(recording).detokenize(request)
        return bytes(response.body), threading.get_ident()

    answer, loop_thread = asyncio.run(detokenize())
    assert json.loads(answer) == {"prompt": "hello world"}
    assert decoded_on and loop_thread not in decoded_on


@pytest.mark.parametrize("prompt_chars", [10, 200_000])
def test_a_large_body_is_parsed_off_the_event_loop(
    prompt_chars: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A body's parse grows with it (a tenth of a second or more for a 4 MB one): a large one
    # on the event loop would stop every other request's stream meanwhile. A small one, nearly
    # every request, is parsed on the loop, where a thread's hand-off would cost more.
    parsed_on: list[int] = []
    parse = openai_schemas.parse_request

    def recorded(model: type[CompletionRequest], body: bytes) -> CompletionRequest:
        parsed_on.append(threading.get_ident())
        return parse(model, body)

    monkeypatch.setattr(openai_schemas, "parse_request", recorded)
    body = json.dumps({"prompt": "w" * prompt_chars}).encode()

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def read() -> tuple[CompletionRequest, int]:
        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        return await read_request(CompletionRequest, request), threading.get_ident()

    completion, loop_thread = asyncio.run(read())
    assert completion.prompt == ["w" * prompt_chars]
    assert parsed_on and (loop_thread in parsed_on) == (prompt_chars < 1000)
