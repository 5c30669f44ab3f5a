"""Prompts from request bodies (server/prompts.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest
from starlette.requests import Request

from protocol.chat_template import ChatTemplate
from server.openai_schemas import ChatMessage
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
