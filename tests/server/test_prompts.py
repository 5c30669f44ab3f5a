"""Prompts from request bodies (server/prompts.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from protocol.chat_template import ChatTemplate
from server.openai_schemas import ChatMessage
from server.prompts import chat_prompt
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
