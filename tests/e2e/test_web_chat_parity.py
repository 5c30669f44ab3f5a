"""What llama.cpp's web UI users expect of the web chat: text files attached, a cut-off
answer continued, vLLM's samplers with the model's defaults shown, keyboard shortcuts, an
app manifest and icon, and tools whose calls and results show in their own boxes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect

from tandem.testing.processes import SMALL_KV_CACHE, engine_and_server
from tandem.testing.random_checkpoint import save_tiny_word_model
from tests.conftest import Cluster
from tests.e2e.web_chat_page import (
    answers,
    ask,
    chat_requests,
    chromium,
    not_pwned,
    open_chat,
    wait_answered,
    wait_saved,
)

# The tiny model's generation_config.json: the defaults the page must show.
GENERATION_CONFIG = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
}
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of the tiny random word model, whose generation_config.json sets defaults."""
    workdir = tmp_path_factory.mktemp("tiny")
    model = workdir / "model"
    save_tiny_word_model(model)
    (model / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    engine_args = ("--model", str(model), "--max-model-len", "256", *SMALL_KV_CACHE)
    with engine_and_server(workdir, *engine_args) as (_, url, _):
        yield url


def test_text_files_are_attached_with_their_names(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\n```\nfenced\n```\nThe meeting is at noon.\n")
    binary = tmp_path / "photo.bin"
    binary.write_bytes(bytes(range(256)))
    page = open_chat(browser, cluster.urls[0])
    sent = chat_requests(page)
    page.set_input_files("#attach-file", [str(notes), str(binary)])
    expect(page.locator("#pending-attachments .chip")).to_have_count(1)
    expect(page.locator("#pending-attachments .chip")).to_contain_text("notes.md")
    expect(page.locator(".attach-problem")).to_contain_text("photo.bin is not a text file")
    ask(page, "When is the meeting?")
    wait_answered(page)
    expect(page.locator("#pending-attachments .chip")).to_have_count(0)
    # The model got the file under its name, in a fence its own fence cannot close.
    question = sent[-1]["messages"][-1]
    assert question["role"] == "user"
    assert question["content"] == (
        "notes.md:\n````\n" + notes.read_text() + "\n````\n\nWhen is the meeting?"
    )
    shown = page.locator(".message.user")
    expect(shown.locator(".content")).to_have_text("When is the meeting?")
    expect(shown.locator(".attachment summary")).to_contain_text("notes.md")
    wait_saved(page)
    page.reload()  # kept with the conversation
    expect(page.locator(".message.user .attachment summary")).to_contain_text("notes.md")
    not_pwned(page)
    page.context.close()


def test_a_cut_off_answer_continues(cluster: Cluster, browser: Browser) -> None:
    page = open_chat(browser, cluster.urls[0], {"maxTokens": "4"})
    sent = chat_requests(page)
    ask(page, "Tell me about the sea.")
    wait_answered(page)
    expect(answers(page).locator(".meta")).to_contain_text("4 tokens · ")
    expect(answers(page).locator(".meta")).to_contain_text("length")
    before = sent[-1]
    cut = page.evaluate(
        "(async () => { const { ConversationStore } = await import('/static/js/storage.js');"
        " const store = await ConversationStore.open(() => {});"
        " return store.list()[0]; })()"
    )
    partial = next(m for m in cut["messages"].values() if m["role"] == "assistant")["content"]
    page.get_by_role("button", name="Continue the answer").click()
    wait_answered(page)
    expect(answers(page)).to_have_count(1)  # the same answer goes on
    expect(answers(page).locator(".meta")).to_contain_text("8 tokens")
    # vLLM's continuation: the answer so far is the prompt's last, unfinished message.
    body = sent[-1]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["messages"][:-1] == before["messages"]
    assert body["messages"][-1] == {"role": "assistant", "content": partial}
    text = answers(page).locator(".content").inner_text()
    assert len(text) > len(partial.strip()) and text.startswith(partial.strip()[:8]), (
        text,
        partial,
    )
    expect(page.get_by_role("button", name="Continue the answer")).to_be_visible()
    not_pwned(page)
    page.context.close()


def test_samplers_with_the_models_defaults(tiny_url: str, browser: Browser) -> None:
    # Fields left empty: the model's defaults apply and show as the placeholders.
    page = open_chat(browser, tiny_url, {"maxTokens": "", "temperature": ""})
    sent = chat_requests(page)
    page.click("#toggle-settings")
    expect(page.locator("#defaults-note")).to_contain_text("temperature 0.6")
    for field, shown in {
        "#temperature": "0.6 (model's)",
        "#top-p": "0.9 (model's)",
        "#top-k": "20 (model's)",
        "#min-p": "0.05 (model's)",
        "#repetition-penalty": "1.1 (model's)",
        "#max-tokens": "7 (model's)",
        "#presence-penalty": "0",
        "#seed": "random",
    }.items():
        expect(page.locator(field)).to_have_attribute("placeholder", shown)
    page.keyboard.press("Escape")
    ask(page, "w1 w2")
    wait_answered(page)
    left_out = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"}
    assert not left_out & sent[-1].keys(), sent[-1]
    assert "error" not in (answers(page).locator(".meta").get_attribute("class") or "")

    # Set: each is sent as vLLM names it, and the server takes them.
    page.click("#toggle-settings")
    for field, value in {
        "#temperature": "0.8",
        "#top-k": "5",
        "#min-p": "0.1",
        "#presence-penalty": "0.5",
        "#frequency-penalty": "0.25",
        "#repetition-penalty": "1.2",
        "#seed": "7",
        "#max-tokens": "3",
        "#stop-strings": "w9\nw10",
    }.items():
        page.fill(field, value)
        page.dispatch_event(field, "change")
    page.keyboard.press("Escape")
    ask(page, "w3 w4")
    wait_answered(page, 2)
    body = sent[-1]
    assert {k: body[k] for k in ("temperature", "top_k", "min_p", "seed", "max_tokens")} == {
        "temperature": 0.8,
        "top_k": 5,
        "min_p": 0.1,
        "seed": 7,
        "max_tokens": 3,
    }
    assert body["presence_penalty"] == 0.5 and body["frequency_penalty"] == 0.25
    assert body["repetition_penalty"] == 1.2 and body["stop"] == ["w9", "w10"]
    expect(answers(page).nth(1).locator(".meta")).to_contain_text("tokens")
    expect(answers(page).nth(1).locator(".meta")).not_to_have_class("meta error")
    not_pwned(page)
    page.context.close()


def test_keyboard_shortcuts_manifest_and_icon(tiny_url: str, browser: Browser) -> None:
    page = open_chat(browser, tiny_url, viewport={"width": 390, "height": 844})
    ask(page, "w5 w6")
    wait_answered(page)
    page.keyboard.press("Control+k")  # search: the conversation list opens on its field
    expect(page.locator("#sidebar")).to_be_visible()
    expect(page.locator("#search")).to_be_focused()
    page.keyboard.type("w5")
    expect(page.locator(".conversation-title")).to_have_count(1)
    page.keyboard.type("nothing")
    expect(page.locator(".conversation-title")).to_have_count(0)
    page.keyboard.press("Escape")
    expect(page.locator("#sidebar")).to_be_hidden()
    page.keyboard.press("Control+Shift+O")  # a new chat
    expect(page.locator(".message")).to_have_count(0)
    expect(page.locator("#input")).to_be_focused()

    devtools = page.context.new_cdp_session(page)
    manifest = devtools.send("Page.getAppManifest")
    assert manifest["errors"] == [], manifest
    parsed = json.loads(manifest["data"])
    assert parsed["name"] == "Tandem chat" and parsed["start_url"] == "/"
    icon = httpx.get(tiny_url + parsed["icons"][0]["src"])
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert page.locator("link[rel=icon]").get_attribute("href") == parsed["icons"][0]["src"]
    not_pwned(page)
    page.context.close()


def test_tools_calls_and_results(tools_server_url: str, browser: Browser) -> None:
    """A function defined in the settings goes with the question; the model's call (forced
    by a named tool_choice added in flight) shows in its box, the result the user types is
    sent back as a tool message, and the model answers it."""
    page = open_chat(browser, tools_server_url)
    sent = chat_requests(page)
    page.click("#toggle-settings")
    page.fill("#tools", "not json")
    page.dispatch_event("#tools", "change")
    expect(page.locator("#tools-note")).to_contain_text("Not sent")
    page.fill("#tools", json.dumps([WEATHER_TOOL]))
    page.dispatch_event("#tools", "change")
    expect(page.locator("#tools-note")).to_have_text("Sent with every question: get_weather.")
    page.keyboard.press("Escape")

    def force_the_call(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
        body["max_tokens"] = 40
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", force_the_call, times=1)
    ask(page, "What is the weather in Paris?")
    wait_answered(page, timeout_s=180)
    call = answers(page).locator(".tool-call")
    expect(call.locator("summary")).to_have_text("Tool call: get_weather")
    expect(call.locator("pre")).to_have_text('{\n  "city": "Paris"\n}')
    assert sent[-1]["tools"] == [{"type": "function", "function": WEATHER_TOOL}]
    page.get_by_label("Result of get_weather").fill('{"sky": "sunny", "celsius": 21}')
    page.get_by_role("button", name="Send results").click()
    wait_answered(page, 2)
    result = page.locator(".message.tool")
    expect(result.locator(".role")).to_have_text("Tool result: get_weather")
    expect(result.locator(".content")).to_have_text('{"sky": "sunny", "celsius": 21}')
    expect(answers(page).first.locator(".tool-result-field")).to_have_count(0)  # answered
    messages = sent[-1]["messages"]
    assistant, tool = messages[-2], messages[-1]
    call_id = assistant["tool_calls"][0]["id"]
    assert call_id and assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert tool == {
        "role": "tool",
        "tool_call_id": call_id,
        "content": '{"sky": "sunny", "celsius": 21}',
    }
    expect(answers(page).nth(1).locator(".meta")).not_to_have_class("meta error")
    wait_saved(page)
    page.reload()
    expect(page.locator(".message.tool")).to_have_count(1)
    not_pwned(page)
    page.context.close()
